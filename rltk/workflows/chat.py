"""Public helpers for workflows that talk in chat messages over several turns.

What a multi-turn workflow needs and a plugin author should not rewrite (or
reach into ``SingleTurnWorkflow``'s private methods for):

* :func:`render_ids` / :func:`render_text`: chat messages (and tool schemas)
  through the tokenizer's chat template (defined in :mod:`rltk.data.chat`, beside
  the warm-up's transcripts, so the endpoint renders requests the same way).
* :class:`TurnRenderer`: token-in/token-out continuation of a transcript.
  After an assistant turn it returns the ids of the newly appended
  observation messages plus the next generation prompt, **without
  re-tokenizing anything before them** (see :meth:`TurnRenderer.delta_ids`
  for the method and why it is exact).
* :func:`generate_checked`: one engine call, its contract checked.
* :func:`score_responses`: one reward call for a step's final answers.
* :func:`row_messages`: the opening messages of a row (``messages``, else ``prompt`` as a user message).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rltk.data.chat import render_ids, render_text, template_name
from rltk.rollout.base import Completion, RolloutEngine, SamplingParams
from rltk.workflows.base import score_samples

__all__ = ["TurnRenderer", "generate_checked", "render_ids", "render_text", "row_messages", "score_responses",
           "template_name"]

#: Assistant content used to find what a template writes after an assistant message (see TurnRenderer).
_PROBE = "rltk-probe-7f3a"


def row_messages(row: Mapping, where: str = "row") -> list[dict]:
    """The opening chat messages of a row: ``row["messages"]`` if present, else ``row["prompt"]`` as one user message.

    For multi-turn work ``prompt`` is the raw user text (the chat template is
    applied by the workflow, so it must not be applied by the data loader too).
    """
    messages = row.get("messages")
    if messages is not None:
        if not isinstance(messages, (list, tuple)) or not messages or not all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str) and _is_content(m.get("content"))
                for m in messages):
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role': str, 'content': str or "
                             f"a list of content parts}} dicts, got {messages!r:.120}")
        from rltk.workflows.vision_turns import with_row_images

        return with_row_images([dict(m) for m in messages], row, where)
    prompt = row.get("prompt")
    if not isinstance(prompt, str):
        raise KeyError(f"{where} has neither 'messages' (a list of chat messages) nor a text 'prompt'; "
                       f"its keys are {sorted(row)}")
    return [{"role": "user", "content": prompt}]


def _is_content(content: Any) -> bool:
    """A message's content: text, or a list of content parts (``{"type": "text" | "image", ...}``)."""
    return isinstance(content, str) or (isinstance(content, list) and all(
        isinstance(part, Mapping) and isinstance(part.get("type"), str) for part in content))


class TurnRenderer:
    """Token-in/token-out rendering of one chat template across the turns of episodes.

    The opening is rendered with :func:`render_ids` (generation prompt
    included). After each assistant turn, :meth:`delta_ids` gives only the
    ids to append: the earlier ids, the opening's and the engine's own
    generated ids, are never re-tokenized, so the trajectory's ids stay
    exactly what the engine received and produced (re-tokenizing a decoded
    transcript can merge or split tokens differently and misalign log-probs).

    Method (text suffix): let ``before`` be the template's text of the
    messages so far (the last one the assistant's turn, no generation prompt)
    and ``after`` that of the same messages plus the new observation messages
    with the generation prompt. ``after`` must start with ``before`` (a
    template that rewrites earlier turns when a message is added, e.g. one
    that drops earlier reasoning, breaks this and is an error naming the
    template); the suffix ``after[len(before):]`` is tokenized on its own.
    It starts at a message boundary (a role marker or the whitespace a
    template puts between messages), where tokenizers do not merge across.

    The closing of the assistant message (e.g. ``<|im_end|>\\n`` for Qwen,
    ``<|eos|>`` for the tiny template) is part of ``before`` but only partly
    in the generated ids: the engine stops *on* the stop token. So the text
    the template writes after an assistant message's content is found once
    (by rendering a probe message), and what the generated ids lack of it is
    prepended to the suffix: nothing when the turn ended with the whole
    closing, the rest after the stop token (Qwen's ``\\n``), or the whole
    closing when the turn was cut by a length limit (mask 0: the policy did
    not write it).

    With a vision-language policy's ``processor``, :meth:`opening` and :meth:`delta` also take messages with
    image parts (:mod:`rltk.workflows.vision_turns`): the newly rendered text and its images go through the
    processor, which expands each image's marker into its image tokens, and the images' inputs come back
    beside the ids. Earlier ids are never touched, as for text.
    """

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None, processor: Any = None):
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.processor = processor
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE}]
        text = render_text(tokenizer, probe, tools=self.tools, add_generation_prompt=False)
        if _PROBE not in text:
            raise ValueError(f"{template_name(tokenizer)} does not render assistant messages' content verbatim, "
                             f"so the end of an assistant turn cannot be found; multi-turn rendering needs a "
                             f"template that writes content as given")
        #: what the template writes after an assistant message's content
        self.assistant_close = text[text.rindex(_PROBE) + len(_PROBE):]

    def opening_ids(self, messages: Sequence[Mapping]) -> list[int]:
        """The ids of the opening messages with the generation prompt (:func:`render_ids`)."""
        return render_ids(self.tokenizer, messages, tools=self.tools, add_generation_prompt=True)

    def missing_close(self, turn_ids: Sequence[int], finish_reason: str) -> str:
        """The part of the template's assistant closing that the generated ``turn_ids`` do not hold.

        A turn that stopped (``finish_reason == "stop"``) ends with its stop
        token; if the closing starts with that token's text, only the rest is
        missing. A turn cut by a length limit (or stopped on a token the
        closing does not start with) lacks the whole closing.
        """
        close = self.assistant_close
        if finish_reason == "stop" and turn_ids:
            last = self.tokenizer.decode([int(turn_ids[-1])], skip_special_tokens=False)
            if last and close.startswith(last):
                return close[len(last):]
        return close

    def opening(self, messages: Sequence[Mapping], where: str = "episode") -> tuple[list[int], Any]:
        """``(ids, image inputs or None)`` of the opening messages, their images (if any) through the processor."""
        from rltk.workflows.vision_turns import encode_images, message_images

        images = message_images(messages, where)
        if not images:
            return self.opening_ids(messages), None
        self._need_processor(len(images), where)
        text = render_text(self.tokenizer, messages, tools=self.tools, add_generation_prompt=True)
        return encode_images(self.processor, text, images)

    def delta(self, messages: Sequence[Mapping], new_messages: Sequence[Mapping], turn_ids: Sequence[int],
              finish_reason: str = "stop", where: str = "episode") -> tuple[list[int], Any]:
        """:meth:`delta_ids` and the image inputs of ``new_messages``' images (None when they have none)."""
        from rltk.workflows.vision_turns import encode_images, message_images

        images = message_images(new_messages, where)
        if not images:
            return self.delta_ids(messages, new_messages, turn_ids, finish_reason), None
        self._need_processor(len(images), where)
        return encode_images(self.processor, self._delta_text(messages, new_messages, turn_ids, finish_reason),
                             images)

    def _need_processor(self, count: int, where: str) -> None:
        if self.processor is None:
            raise ValueError(f"{where}: the messages show {count} image(s) but the policy has no processor (a text "
                             f"model cannot see them); use a vision-language policy (model.tiny.vision.depth > 0 "
                             f"or a VLM folder as model.path)")

    def delta_ids(self, messages: Sequence[Mapping], new_messages: Sequence[Mapping],
                  turn_ids: Sequence[int], finish_reason: str = "stop") -> list[int]:
        """Ids to append after an assistant turn: the rest of its closing, ``new_messages``, the generation prompt.

        ``messages`` is the transcript so far ending with the assistant turn
        whose generated ids are ``turn_ids`` (ended by ``finish_reason``). Raises ``ValueError`` naming the
        template when the rendering of ``messages + new_messages`` does not
        extend that of ``messages`` (see the class docstring).
        """
        text = self._delta_text(messages, new_messages, turn_ids, finish_reason)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def _delta_text(self, messages: Sequence[Mapping], new_messages: Sequence[Mapping],
                    turn_ids: Sequence[int], finish_reason: str) -> str:
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("TurnRenderer.delta_ids: messages must end with the assistant turn just generated")
        before = render_text(self.tokenizer, messages, tools=self.tools, add_generation_prompt=False)
        after = render_text(self.tokenizer, list(messages) + list(new_messages), tools=self.tools,
                            add_generation_prompt=True)
        if not after.startswith(before):
            at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
            raise ValueError(
                f"{template_name(self.tokenizer)} re-renders earlier turns when messages are appended (the text "
                f"differs at character {at}: {before[at:at + 40]!r} became {after[at:at + 40]!r}), so new turns "
                f"cannot be appended token-in/token-out; use a template that renders a conversation as the "
                f"concatenation of its messages")
        if not before.endswith(self.assistant_close):
            raise ValueError(f"{template_name(self.tokenizer)} closes the last assistant message differently from "
                             f"an earlier one ({before[-40:]!r} does not end with {self.assistant_close!r})")
        return self.missing_close(turn_ids, finish_reason) + after[len(before):]


def generate_checked(engine: RolloutEngine, prompt_ids: list[list[int]], params: SamplingParams,
                     workflow: str = "workflow", *, vision_inputs: list | None = None) -> list[list[Completion]]:
    """``engine.generate(prompt_ids, params)``, refusing results that break the engine contract (wrong counts).

    ``vision_inputs`` (one per prompt, None for a prompt without images) go to an engine that takes them
    (``generate(..., vision_inputs=)``, the ``hf`` engine); an engine that does not is an error naming it.
    """
    if vision_inputs is None:
        groups = engine.generate(prompt_ids, params)
    else:
        import inspect

        if "vision_inputs" not in inspect.signature(engine.generate).parameters:
            raise ValueError(f"{workflow}: the prompts show images but rollout engine {type(engine).__name__} "
                             f"generates from token ids only (no vision_inputs); use rollout.engine=hf")
        groups = engine.generate(prompt_ids, params, vision_inputs=vision_inputs)
    if len(groups) != len(prompt_ids) or any(len(g) != params.n for g in groups):
        raise RuntimeError(
            f"{workflow}: rollout engine {type(engine).__name__} broke its contract: asked for {params.n} "
            f"completions for each of {len(prompt_ids)} prompts, got group sizes {[len(g) for g in groups]}")
    return groups


def score_responses(reward: Any, rows: Sequence[Mapping], responses: Sequence[str], prompts: Sequence[str],
                    workflow: str = "workflow") -> list[tuple[float, dict[str, float]]]:
    """``(score, details)`` of ``responses[i]`` (an answer to ``rows[i]`` whose prompt text is ``prompts[i]``).

    One reward call for the whole list when the reward has ``score_batch``
    (see :func:`rltk.workflows.base.score_samples`); ``extras`` are copied per
    sample, so a reward that edits them cannot change another sample's input.
    """
    samples, wheres = [], []
    for index, (row, response, prompt) in enumerate(zip(rows, responses, prompts)):
        samples.append({"prompt": prompt, "response": response, "ground_truth": row.get("ground_truth", ""),
                        "extras": dict(row.get("extras") or {})})
        wheres.append(f"row {index} (id {row.get('id', str(index))!r})")
    return score_samples(reward, samples, wheres, workflow)
