"""Chat-message rows: checking messages, splitting transcripts, tokenizing them for SFT.

A row may carry chat messages (OpenAI's format)::

    {"role": "system" | "user" | "assistant" | "tool",
     "content": str,                       # may be null on an assistant turn with tool calls
     "tool_calls": [{"type": "function", "function": {"name": str, "arguments": dict | JSON str}}]}
                                           # assistant only; {"name", "arguments"} also accepted

``row["messages"]`` holds the opening messages of an episode (what the
policy reads before its first turn); ``row["sft_messages"]`` a whole
demonstration transcript for the supervised warm-up. A dataset's ``messages``
column that ends with an assistant turn is such a transcript: the messages
before its first assistant turn open the episode (see
:func:`split_transcript`).

:func:`tokenize_transcript` turns a transcript into the token stream a
multi-turn rollout produces for it, with the loss on the assistant turns only:
the opening rendered with the generation prompt, then each later message's
rendering appended as the text it adds to the rendering of the conversation
so far, tokenized on its own. A rollout does exactly that (earlier turns are
never re-tokenized), so the warm-up teaches the very token sequence RL samples.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages: Any, where: str) -> list[dict]:
    """A checked copy of ``messages``; ``ValueError`` naming ``where``, the message and what is valid.

    Each message needs a ``role`` among :data:`ROLES` and a string
    ``content`` (``None`` or missing is allowed on an assistant message with
    ``tool_calls``). ``tool_calls`` (assistant messages only) is a list of
    ``{"type": "function", "function": {"name", "arguments"}}`` or
    ``{"name", "arguments"}``; arguments are a dict or a JSON object as text.
    Other keys of a message (``name``, ``tool_call_id``) are kept.

    Args:
        messages: the value to check.
        where: names the value in errors, e.g. ``"data/train.jsonl: row 3 (column 'messages')"``.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: messages must be a non-empty list of {{'role', 'content'}} objects, "
                         f"got {type(messages).__name__}: {str(messages)[:80]!r}")
    checked = []
    for index, message in enumerate(messages):
        at = f"{where}: message {index}"
        if not isinstance(message, Mapping):
            raise ValueError(f"{at} is a {type(message).__name__}, expected an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"{at} has role {role!r}; valid roles: {', '.join(ROLES)}")
        calls = message.get("tool_calls")
        if calls is not None and role != "assistant":
            raise ValueError(f"{at} ({role}) has tool_calls; only assistant messages make tool calls")
        content = message.get("content")
        if not (isinstance(content, str) or (content is None and role == "assistant" and calls)):
            raise ValueError(f"{at} ({role}) has content {content!r}; content must be a string (null only on an "
                             f"assistant message with tool_calls)")
        out = dict(message)
        out["content"] = content if content is not None else ""
        if calls is not None:
            out["tool_calls"] = [_check_call(call, f"{at}: tool call {k}") for k, call in enumerate(_as_list(calls, at))]
        checked.append(out)
    return checked


def _as_list(calls: Any, at: str) -> list:
    if not isinstance(calls, list):
        raise ValueError(f"{at}: tool_calls must be a list of calls, got {type(calls).__name__}")
    return calls


def _check_call(call: Any, at: str) -> dict:
    fn = call.get("function") if isinstance(call, Mapping) and "function" in call else call
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{at} must be {{'type': 'function', 'function': {{'name': str, 'arguments': {{...}}}}}} "
                         f"or {{'name': str, 'arguments': {{...}}}}, got {str(call)[:120]!r}")
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{at} ('{fn['name']}'): arguments are not valid JSON ({exc}): {fn['arguments']!r}") from None
    if not isinstance(arguments, Mapping):
        raise ValueError(f"{at} ('{fn['name']}'): arguments must be an object of named values, got {arguments!r}")
    return {"type": "function", "function": {"name": fn["name"], "arguments": dict(arguments)}}


def split_transcript(messages: list[dict]) -> tuple[list[dict], list[dict] | None]:
    """``(opening, transcript)``: a transcript ending in an assistant turn opens with what precedes its first one.

    Messages that end with an assistant message are a demonstration: the
    opening is every message before the first assistant message, the
    transcript all of them. Messages that end otherwise are a conversation
    to continue: all of them are the opening and there is no transcript.
    ``ValueError`` if a transcript starts with an assistant message (an
    episode opens with system or user messages).
    """
    if messages[-1]["role"] != "assistant":
        return list(messages), None
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    if first == 0:
        raise ValueError("the messages start with an assistant message; an episode opens with system or user "
                         "messages before the first assistant turn")
    return list(messages[:first]), list(messages)


def template_name(tokenizer: Any) -> str:
    """How errors name a tokenizer's chat template: its ``name_or_path`` or its class."""
    return f"the chat template of tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r}"


def render_text(tokenizer: Any, messages: Sequence[Mapping], *, tools: list[dict] | None = None,
                add_generation_prompt: bool = True) -> str:
    """``messages`` rendered by the tokenizer's chat template as text (``tools`` as its ``tools=``)."""
    try:
        return tokenizer.apply_chat_template(list(messages), tools=tools or None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:
        roles = [m.get("role") for m in messages]
        raise ValueError(f"{template_name(tokenizer)} cannot render messages with roles {roles}: "
                         f"{type(exc).__name__}: {exc}") from exc


def render_ids(tokenizer: Any, messages: Sequence[Mapping], *, tools: list[dict] | None = None,
               add_generation_prompt: bool = True) -> list[int]:
    """``messages`` rendered by the chat template and tokenized, as the template itself tokenizes them.

    This is ``tokenizer.apply_chat_template(messages, tools=tools,
    add_generation_prompt=True, tokenize=True)``: the opening of an episode.
    """
    try:
        ids = tokenizer.apply_chat_template(list(messages), tools=tools or None, tokenize=True, return_dict=False,
                                            add_generation_prompt=add_generation_prompt)
    except Exception as exc:
        roles = [m.get("role") for m in messages]
        raise ValueError(f"{template_name(tokenizer)} cannot render messages with roles {roles}: "
                         f"{type(exc).__name__}: {exc}") from exc
    if isinstance(ids, Mapping):  # tokenizers that return an encoding whatever return_dict says
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def tokenize_transcript(
    messages: list[dict], tokenizer, *, tools: list[dict] | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """``(prompt_ids, response_ids, loss_mask)`` of a transcript, the loss on assistant tokens only.

    ``prompt_ids`` are the opening (every message before the first assistant
    turn) rendered with the generation prompt. ``response_ids`` append, for
    each later message, the text its rendering adds to the rendering of the
    messages before it (with the generation prompt when an assistant turn
    follows), tokenized on its own: the ids a multi-turn rollout builds, one
    turn at a time, never re-tokenizing what it has. ``loss_mask[t]`` is 1 on
    an assistant turn's tokens up to and including the first eos (what the
    model generates: content, tool calls, eos) and 0 on everything else (tool
    results, user or environment messages, the template's tokens after eos).

    Needs a chat template under which rendering a conversation's prefix gives
    a prefix of its rendering (the tiny template, Qwen's, Llama's ...); a
    template that rewrites earlier turns (e.g. drops past reasoning) is a
    ``ValueError`` naming the message.

    Shape: ``len(response_ids) == len(loss_mask)``.
    """
    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError("tokenize_transcript: a transcript ends with an assistant message (what the loss teaches)")
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    if first == 0:
        raise ValueError("tokenize_transcript: the transcript starts with an assistant message; it needs at least "
                         "one system or user message before the first assistant turn")
    eos = tokenizer.eos_token_id

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    rendered = render_text(tokenizer, messages[:first], tools=tools, add_generation_prompt=True)
    prompt_ids = encode(rendered)
    response_ids: list[int] = []
    loss_mask: list[int] = []
    for j in range(first, len(messages)):
        role = messages[j]["role"]
        if role == "assistant" and messages[j - 1]["role"] == "assistant":
            # two assistant turns in a row: the second one's generation prompt is the template's, not the model's
            prompt = render_text(tokenizer, messages[:j], tools=tools, add_generation_prompt=True)
            if prompt.startswith(rendered):  # else the check below names the template's problem
                ids = encode(prompt[len(rendered):])
                response_ids += ids
                loss_mask += [0] * len(ids)
                rendered = prompt
        next_is_assistant = j + 1 < len(messages) and messages[j + 1]["role"] == "assistant"
        text = render_text(tokenizer, messages[: j + 1], tools=tools,
                           add_generation_prompt=role != "assistant" and next_is_assistant)
        if not text.startswith(rendered):
            raise ValueError(
                f"tokenize_transcript: the chat template renders messages 0..{j} so that the rendering of messages "
                f"0..{j - 1} is not its beginning (message {j}, {role}, changes what came before); transcripts need "
                f"a template whose renderings of a conversation's prefixes are prefixes of its rendering"
            )
        ids = encode(text[len(rendered):])
        if role == "assistant":
            # the model writes the turn and its eos; a template's text after eos is not generated
            end = ids.index(eos) + 1 if eos in ids else len(ids)
            mask = [1] * end + [0] * (len(ids) - end)
        else:
            mask = [0] * len(ids)
        response_ids += ids
        loss_mask += mask
        rendered = text
    return prompt_ids, response_ids, loss_mask
