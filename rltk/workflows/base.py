"""The workflow contract: dataset rows in, experiences out.

A workflow owns everything between a batch of task rows and the experiences
the trainer learns from: prompting the rollout engine, talking to an
environment (multi turn), scoring with the reward, and building masks and
group ids. Workflows are registered under the kind ``workflow`` and built by
a recipe as ``cls(engine=..., tokenizer=..., reward=..., sampling=..., **args)``.

Rows are plain dicts::

    {"prompt": str,         # text ready to tokenize (chat template already applied)
     "ground_truth": str,   # what the reward compares against ("" if none)
     "extras": dict,        # anything else the reward needs (numbers, target, ...)
     "id": str}             # stable row id, for logs and debugging

The reward is a callable ``reward(prompt=..., response=..., ground_truth=...,
extras=...)`` returning ``(score, details)`` (what
:class:`rltk.rewards.compose.RewardComposer` returns), a float, or a dict of
named scores (its ``"score"`` entry, else the sum, is the score). A reward
that also has ``score_batch(samples)`` (the composer does) is called once per
step with all samples through :func:`score_samples`, which is how it runs its
in-process rewards in one pass and times out its worker calls in parallel.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from typing import Any

from rltk.batch import Experience
from rltk.rollout.base import SamplingParams


class Workflow(abc.ABC):
    """Turns task rows into experiences; subclass it and register under ``rltk_workflows``.

    Contract:

    * :meth:`run` returns one :class:`~rltk.batch.Experience` per response, the
      responses to one row sharing a ``group_id`` that no other row (in this or
      any earlier call) uses.
    * Experiences carry the rollout log-probs and finish reason from the engine
      and the reward's named details, so the trainer and the logs can use them.
    * A workflow that can give every experience a ``baseline_score`` (the
      score of one greedy response to its prompt, ReMax's baseline) accepts
      ``run(rows, greedy_baseline=True)``; config validation refuses an
      estimator that needs ``baseline_scores`` with a workflow whose ``run``
      takes no ``greedy_baseline``.
    * :meth:`evaluate` scores held-out rows without producing experiences.
    * :meth:`metrics` describes the last :meth:`run` for the logger.
    """

    @abc.abstractmethod
    def run(self, rows: list[dict]) -> list[Experience]:
        """Produce experiences for ``rows``, grouped per row."""

    def evaluate(self, rows: list[dict], params: Any = None) -> dict[str, float]:
        """Held-out metrics for ``rows``; workflows that cannot evaluate say so."""
        raise NotImplementedError(f"{type(self).__name__} does not implement evaluate()")

    def metrics(self) -> dict[str, float]:
        """Numbers about the last :meth:`run` (timings, lengths, reward parts)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What must outlive a checkpoint for a resumed run to continue as if never interrupted (JSON-able).

        Counters that span calls belong here, e.g. the next group id that keeps
        ids unique across calls. The default has none.
        """
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`. The default accepts only the empty state it saves."""
        if state:
            raise ValueError(f"{type(self).__name__}.load_state_dict: this workflow keeps no state, got keys "
                             f"{sorted(state)}; a workflow that saves state must override load_state_dict")

    def close(self) -> None:
        """Release what the workflow holds beside its engine (threads, an endpoint); a no-op by default."""


class GroupNumbering:
    """Mixin for workflows that number groups: ids unique across calls and across a resume.

    Take ids with :meth:`new_group_id`. :meth:`state_dict` is ``{"next_group_id": int}``:
    experiences a sample strategy keeps across steps (``staleness``) are grouped by id, and a
    counter restarted at 0 gave new groups the ids of kept ones, which were then trained as one
    group. Put it before :class:`Workflow` in the bases; ``workflow_name`` names the workflow in
    errors.
    """

    workflow_name = "workflow"
    _next_group_id = 0

    def new_group_id(self) -> int:
        """The next unused group id."""
        group_id = self._next_group_id
        self._next_group_id += 1
        return group_id

    def state_dict(self) -> dict[str, Any]:
        """``{"next_group_id": int}``: the group id the next row gets, so a resumed run numbers on."""
        return {"next_group_id": self._next_group_id}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue numbering groups from a :meth:`state_dict`; a bad entry is a ``ValueError`` naming it."""
        where = f"{self.workflow_name}.load_state_dict"
        if not isinstance(state, Mapping) or set(state) != {"next_group_id"}:
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"{where}: expected {{'next_group_id': int}} as state_dict() returns, got {got}")
        value = state["next_group_id"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where}: state['next_group_id'] = {value!r} must be an integer >= 0")
        self._next_group_id = value


def held_out_metrics(scores: list[float], lengths: list[int], truncated: int, threshold: float) -> dict[str, float]:
    """What every workflow's :meth:`~Workflow.evaluate` reports of its held-out responses: ``accuracy`` (the
    fraction scoring ``>= threshold``), ``mean_score``, ``mean_response_length`` (of ``lengths``, tokens),
    ``truncated_fraction`` (``truncated`` of them hit a length limit) and ``num_responses``."""
    count = len(scores)
    return {
        "accuracy": sum(s >= threshold for s in scores) / count,
        "mean_score": sum(scores) / count,
        "mean_response_length": sum(lengths) / count,
        "truncated_fraction": truncated / count,
        "num_responses": float(count),
    }


def check_workflow_parts(workflow: str, sampling: Any, reward: Any) -> None:
    """The parts a recipe builds every workflow with (``cls(engine=..., tokenizer=..., reward=..., sampling=...)``)
    are what the workflow needs: ``sampling`` a :class:`rltk.rollout.base.SamplingParams`, ``reward`` callable;
    otherwise a ``TypeError`` naming the workflow."""
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"{workflow}: sampling must be a rltk.rollout.base.SamplingParams, "
                        f"got {type(sampling).__name__}")
    if not callable(reward):
        raise TypeError(f"{workflow}: reward must be callable, got {type(reward).__name__}")


def reward_means(experiences: list[Experience]) -> dict[str, float]:
    """``{"reward/<name>": mean}`` of each reward function's score over the experiences that have it."""
    names = sorted({name for e in experiences for name in e.reward_details})
    means = {}
    for name in names:
        values = [e.reward_details[name] for e in experiences if name in e.reward_details]
        means[f"reward/{name}"] = sum(values) / len(values)
    return means


def score_samples(reward: Any, samples: list[dict], wheres: list[str], workflow: str) -> list[tuple[float, dict]]:
    """``(score, details)`` for every sample, scoring them all in one call when the reward can.

    Each sample is ``{"prompt", "response", "ground_truth", "extras"}``;
    ``wheres[i]`` names sample ``i`` in errors (e.g. ``"row 3 (id 'q7')"``).
    A reward with a ``score_batch(samples)`` method gets one call for the
    whole list (one call per step: a workflow should collect its step's
    samples first); any other callable is called once per sample. An
    exception from a per-sample call is re-raised naming the sample and
    ``workflow``; results go through :func:`normalize_reward_output`.
    """
    batch = getattr(reward, "score_batch", None)
    if callable(batch):
        results = batch(samples)
        if len(results) != len(samples):
            raise RuntimeError(
                f"{workflow}: the reward's score_batch returned {len(results)} results for {len(samples)} samples"
            )
        return [normalize_reward_output(result, where) for result, where in zip(results, wheres)]
    out = []
    for sample, where in zip(samples, wheres):
        try:
            result = reward(**sample)
        except Exception as exc:
            raise RuntimeError(
                f"{workflow}: the reward raised on {where}: {type(exc).__name__}: {exc}. "
                f"Use a reward composer with a fallback to keep training through such failures."
            ) from exc
        out.append(normalize_reward_output(result, where))
    return out


def normalize_reward_output(result: Any, where: str) -> tuple[float, dict[str, float]]:
    """``(score, details)`` from whatever a reward callable returned.

    Accepts ``(score, details)``, a plain number, or a dict of named scores
    (its ``"score"`` entry, else the sum of its values, is the score). A
    non-finite or non-numeric score is an error naming ``where`` (the row).
    """
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping):
        score, details = result
    elif isinstance(result, Mapping):
        details = result
        score = result["score"] if "score" in result else sum(result.values())
    else:
        score, details = result, {}
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        raise ValueError(
            f"the reward returned a score of {score!r} for {where}; it must be a finite number "
            f"(return a float, (float, dict) or a dict of named floats)"
        )
    return float(score), {str(k): float(v) for k, v in details.items()}


def check_rows(rows: Any, workflow: str, *, prompt_required: bool = True) -> list[dict]:
    """Check that ``rows`` is a list of dicts with a string ``"prompt"`` and dict ``"extras"``, naming the bad row.

    ``prompt_required=False`` (workflows that open an episode from a row's ``messages`` as well:
    ``multi_turn``, ``agentic``) checks only that each row is a dict with dict ``extras``.
    """
    if isinstance(rows, Mapping) or not isinstance(rows, (list, tuple)):
        raise TypeError(f"{workflow}.run() takes a list of row dicts, got {type(rows).__name__}")
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TypeError(f"{workflow}: row {index} must be a dict, got {type(row).__name__}")
        if not prompt_required:
            pass
        elif "prompt" not in row:
            raise KeyError(
                f"{workflow}: row {index} (id {row.get('id', '?')!r}) has no 'prompt' key; "
                f"its keys are {sorted(row)}. Map your dataset's prompt column to 'prompt' "
                f"(data.prompt_key)."
            )
        elif not isinstance(row["prompt"], str):
            raise TypeError(
                f"{workflow}: row {index} (id {row.get('id', '?')!r}) 'prompt' must be text, "
                f"got {type(row['prompt']).__name__}"
            )
        extras = row.get("extras", {})
        if extras is not None and not isinstance(extras, Mapping):
            raise TypeError(
                f"{workflow}: row {index} (id {row.get('id', '?')!r}) 'extras' must be a dict, "
                f"got {type(extras).__name__}"
            )
    return list(rows)

