"""Workflow ``single_turn``: one prompt, ``n`` sampled responses, one reward each.

The workflow of GRPO-style training on verifiable tasks: every row's prompt is
sampled ``n`` times in a single engine call for the whole batch, each response
is scored by the reward, and the ``n`` experiences of a row form one group
(the unit group-relative advantages normalise over: GRPO, Shao et al. 2024,
"DeepSeekMath", arXiv:2402.03300; RLOO, Ahmadian et al. 2024,
arXiv:2402.14740).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import rltk
from rltk.batch import Experience
from rltk.models.vision.inputs import encode_prompt
from rltk.rollout.base import POLICY_VERSIONS, Completion, RolloutEngine, SamplingParams
from rltk.workflows.base import (
    GroupNumbering, Workflow, check_rows, check_workflow_parts, held_out_metrics, reward_means, score_samples,
)


class SingleTurnWorkflow(GroupNumbering, Workflow):
    """Rows -> ``n`` completions each -> rewards -> experiences (registered as ``single_turn``).

    Args:
        engine: the rollout engine (``hf``, ``vllm`` or a plugin's).
        tokenizer: tokenizes prompts (``add_special_tokens=False``: the prompt
            text is final, chat template included) and decodes responses with
            ``skip_special_tokens=True`` for the reward.
        reward: ``reward(prompt=, response=, ground_truth=, extras=)`` returning
            ``(score, details)``, a float, or a dict of named scores.
        sampling: sampling parameters of training rollouts (``n`` = group size).
        max_prompt_tokens: prompts longer than this are an error naming the row
            (filter them when loading data); ``None`` accepts any length.
        processor: a vision-language policy's processor (``None`` for a text policy): a row's ``images``
            and prompt go through it (:func:`rltk.models.vision.inputs.encode_prompt`, image placeholders
            expanded into image tokens), the engine samples with each prompt's
            :class:`rltk.batch.PromptImages` (``vision_inputs=``) and every experience keeps its prompt's.

    Group ids come from a counter owned by the workflow, so no two rows ever
    share one, across calls included. Each experience's ``info`` holds the
    prompt text, response text, ground truth, row id and sample index.
    """

    workflow_name = "single_turn"

    def __init__(self, *, engine: RolloutEngine, tokenizer: Any, reward: Any, sampling: SamplingParams,
                 max_prompt_tokens: int | None = None, processor: Any = None):
        check_workflow_parts(self.workflow_name, sampling, reward)
        if max_prompt_tokens is not None and (
            not isinstance(max_prompt_tokens, int) or isinstance(max_prompt_tokens, bool) or max_prompt_tokens < 1
        ):
            raise ValueError(
                f"single_turn: max_prompt_tokens (rollout.workflow_args.max_prompt_tokens) must be an integer "
                f">= 1 or null, got {max_prompt_tokens!r}"
            )
        self.engine = engine
        self.tokenizer = tokenizer
        self.reward = reward
        self.sampling = sampling
        self.max_prompt_tokens = max_prompt_tokens
        self.processor = processor
        self._next_group_id = 0  # group ids stay unique across calls (the Workflow contract)
        self._metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ training rollouts

    def run(self, rows: list[dict], *, greedy_baseline: bool = False) -> list[Experience]:
        """``sampling.n`` experiences per row, in row order, one group per row.

        With ``greedy_baseline=True`` every row also gets one greedy response
        (same ``max_new_tokens``), scored by the same reward; its score is the
        ``baseline_score`` of each of the row's experiences (ReMax's baseline,
        Li et al. 2023, arXiv:2310.10505). The greedy response itself is not
        trained on. The recipes ask for it when the advantage estimator names
        ``baseline_scores`` in its signature.
        """
        rows = check_rows(rows, "single_turn")
        if not rows:
            self._metrics = {}
            return []
        prompt_ids, visions = self._tokenize(rows)

        tick = time.perf_counter()
        groups = self._generate(prompt_ids, self.sampling, visions)
        greedy = None
        if greedy_baseline:
            greedy = self._generate(prompt_ids, replace(self.sampling, n=1, greedy=True), visions)
        generate_s = time.perf_counter() - tick

        tick = time.perf_counter()
        responses = [[self._decode(completion) for completion in completions] for completions in groups]
        to_score = responses
        if greedy is not None:  # each row's greedy response is scored last in its row, in the same call
            to_score = [row_responses + [self._decode(greedy[index][0])] for index, row_responses in enumerate(responses)]
        scored = iter(self._score_all(rows, to_score))  # one reward call for the whole step
        experiences = []
        baselines = []
        for index, (row, ids, completions, vision) in enumerate(zip(rows, prompt_ids, groups, visions)):
            group_id = self.new_group_id()
            row_scored = [next(scored) for _ in completions]
            baseline = None
            if greedy is not None:
                baseline, _ = next(scored)
                baselines.append(baseline)
            for sample_index, (completion, response, (score, details)) in enumerate(
                zip(completions, responses[index], row_scored)
            ):
                experiences.append(
                    Experience(
                        prompt_ids=list(ids),
                        response_ids=list(completion.token_ids),
                        score=score,
                        group_id=group_id,
                        rollout_logprobs=list(completion.logprobs),
                        finish_reason=completion.finish_reason,
                        routed_experts=completion.routed_experts,
                        vision=vision,
                        reward_details=details,
                        info={
                            "prompt": row["prompt"],
                            "response": response,
                            "ground_truth": row.get("ground_truth", ""),
                            "row_id": row.get("id", str(index)),
                            "sample_index": sample_index,
                            # an engine that tracks them (an asynchronous run's vllm_server): the policy
                            # version of each token, for the experience queue
                            **({} if completion.versions is None else {POLICY_VERSIONS: list(completion.versions)}),
                        },
                        baseline_score=baseline,
                    )
                )
        reward_s = time.perf_counter() - tick
        self._metrics = _rollout_metrics(experiences, generate_s, reward_s)
        if baselines:
            self._metrics["rollout/greedy_baseline_score"] = sum(baselines) / len(baselines)
        return experiences

    def metrics(self) -> dict[str, float]:
        """About the last :meth:`run`: ``time/generate_s``, ``time/reward_s``,
        ``rollout/response_length_mean|max``, ``rollout/truncated_fraction``,
        ``rollout/generated_tokens``, ``reward/<name>`` (mean of each reward
        detail) and, with ``greedy_baseline``, ``rollout/greedy_baseline_score``
        (mean score of the greedy responses)."""
        return dict(self._metrics)

    # ------------------------------------------------------------------ evaluation

    def evaluate(
        self, rows: list[dict], params: SamplingParams | None = None, *, threshold: float = 1.0
    ) -> dict[str, float]:
        """Held-out metrics with (by default) greedy decoding, one response per row.

        Returns ``accuracy`` (fraction of responses with score ``>= threshold``;
        a correct answer scores 1 under the builtin rewards), ``mean_score``,
        ``mean_response_length`` (tokens), ``truncated_fraction`` (responses cut
        by ``max_new_tokens``) and ``num_responses``.

        Args:
            rows: held-out rows, same format as for :meth:`run`.
            params: decoding parameters; ``None`` means the training sampling
                parameters with ``n=1, greedy=True``.
            threshold: the score counted as a solved task.
        """
        rows = check_rows(rows, "single_turn")
        if not rows:
            raise ValueError("single_turn.evaluate() got no rows; give it the held-out split")
        if params is None:
            params = replace(self.sampling, n=1, greedy=True)
        prompt_ids, visions = self._tokenize(rows)
        groups = self._generate(prompt_ids, params, visions)
        responses = [[self._decode(completion) for completion in completions] for completions in groups]
        scores = [score for score, _ in self._score_all(rows, responses)]
        lengths, truncated = [], 0
        for completions in groups:
            for completion in completions:
                lengths.append(len(completion.token_ids))
                truncated += completion.finish_reason == "length"
        return held_out_metrics(scores, lengths, truncated, threshold)

    # ------------------------------------------------------------------ helpers

    def _tokenize(self, rows: list[dict]) -> tuple[list[list[int]], list]:
        """Each row's prompt ids and :class:`rltk.batch.PromptImages` (None for a row without images)."""
        encoded = self.tokenizer([row["prompt"] for row in rows], add_special_tokens=False)["input_ids"]
        visions: list = [None] * len(rows)
        for index, row in enumerate(rows):
            if row.get("images"):
                if self.processor is None:
                    raise ValueError(
                        f"single_turn: row {index} (id {row.get('id', str(index))!r}) has {len(row['images'])} "
                        f"image(s) but the policy has no processor (a text model); use a vision-language model "
                        f"(model.tiny.vision.depth > 0 or a VLM folder) or drop data.image_key")
                encoded[index], visions[index] = encode_prompt(self.processor, row["prompt"], row["images"])
        for index, (row, ids) in enumerate(zip(rows, encoded)):
            if not ids:
                raise ValueError(
                    f"single_turn: row {index} (id {row.get('id', str(index))!r}) tokenizes to no tokens "
                    f"(prompt {row['prompt']!r}); every prompt needs at least one token"
                )
            if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
                raise ValueError(
                    f"single_turn: row {index} (id {row.get('id', str(index))!r}) has a prompt of {len(ids)} "
                    f"tokens, more than max_prompt_tokens={self.max_prompt_tokens} (image tokens count). "
                    f"Filter long prompts when loading the data, or raise rollout.workflow_args.max_prompt_tokens."
                )
        return [list(ids) for ids in encoded], visions

    def _generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                  visions: list | None = None) -> list[list[Completion]]:
        if visions is not None and any(v is not None for v in visions):
            groups = self.engine.generate(prompt_ids, params, vision_inputs=visions)
        else:
            groups = self.engine.generate(prompt_ids, params)
        if len(groups) != len(prompt_ids) or any(len(g) != params.n for g in groups):
            raise RuntimeError(
                f"rollout engine {type(self.engine).__name__} broke its contract: asked for {params.n} "
                f"completions for each of {len(prompt_ids)} prompts, got group sizes {[len(g) for g in groups]}"
            )
        return groups

    def _decode(self, completion: Completion) -> str:
        return self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)

    def _score_all(self, rows: list[dict], responses: list[list[str]]) -> list[tuple[float, dict[str, float]]]:
        """Scores of ``responses[i][j]`` (the j-th response to row i), flattened row by row, in one reward call."""
        samples, wheres = [], []
        for index, (row, texts) in enumerate(zip(rows, responses)):
            where = f"row {index} (id {row.get('id', str(index))!r})"
            for text in texts:
                # extras copied per sample: a reward that edits them must not change its siblings' input
                samples.append({"prompt": row["prompt"], "response": text, "ground_truth": row.get("ground_truth", ""),
                                "extras": dict(row.get("extras") or {})})
                wheres.append(where)
        return score_samples(self.reward, samples, wheres, "single_turn")



def _rollout_metrics(experiences: list[Experience], generate_s: float, reward_s: float) -> dict[str, float]:
    lengths = [len(e.response_ids) for e in experiences]
    metrics = {
        "time/generate_s": generate_s,
        "time/reward_s": reward_s,
        "rollout/response_length_mean": sum(lengths) / len(lengths),
        "rollout/response_length_max": float(max(lengths)),
        "rollout/truncated_fraction": sum(e.finish_reason == "length" for e in experiences) / len(experiences),
        "rollout/generated_tokens": float(sum(lengths)),
    }
    return {**metrics, **reward_means(experiences)}


@rltk.hookimpl
def rltk_workflows():
    return {"single_turn": SingleTurnWorkflow}
