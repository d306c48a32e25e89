"""What an RL step trains on: the step's rollouts, refilled under dynamic sampling, and expert data.

* :func:`collect_experiences` draws the step's prompts and runs the workflow
  on them. When the advantage estimator names ``baseline_scores`` it asks the
  workflow for one greedy response per prompt (ReMax's baseline). Under
  ``algorithm.dynamic_sampling`` (DAPO) it keeps only the groups whose scores
  differ and draws more prompts until the batch holds as many such groups as a
  step has prompts, or ``algorithm.dynamic_sampling_max_rounds`` rounds of
  generation have run.
* :func:`expert_experiences` reads ``buffer.expert.path`` (prompt and
  response columns) into experiences for a sample strategy that mixes them in
  (``mix_expert``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf

from rltk.batch import Experience
from rltk.config.recipe_capabilities import StepPlan
from rltk.errors import ConfigError
from rltk.training.step.ranks import any_rank

#: Scores closer than this count as equal: a group of them carries no group-relative signal.
EQUAL_SCORES_ATOL = 1e-6


@dataclass
class Rollout:
    """One step's experiences for this rank, as a rollout source gives them
    (:mod:`rltk.training.rollouts.rollout_source`)."""

    experiences: list[Experience]
    metrics: dict[str, float]  # rollout/*, staleness/* ... and time/rollout_s (the time it took or waited)
    versions: list[int] | None = None  # the policy version that sampled each; None: this step's weights


@dataclass(frozen=True)
class RolloutPlan:
    """How a step's rollouts are gathered: what the step plan asks of them, and dynamic sampling.

    Attributes:
        greedy_baseline: ask the workflow for one greedy response per prompt, whose score
            becomes every response's ``baseline_score`` (the estimator needs ``baseline_scores``).
        dynamic_sampling: keep only groups whose scores differ, refilling with new prompts.
        max_rounds: the most rounds of generation one step may run under dynamic sampling.
        reward_components: the estimator needs ``reward_components`` (gdpo): the recipe hands
            :func:`rltk.batch.collate` the reward composer's names, so the batch carries each
            reward function's own score.
    """

    greedy_baseline: bool = False
    dynamic_sampling: bool = False
    max_rounds: int = 1
    reward_components: bool = False

    @classmethod
    def from_config(cls, cfg: DictConfig, step_plan: "StepPlan | None" = None) -> "RolloutPlan":
        """The plan of a (stage) config: what its step plan (:class:`rltk.config.recipe_capabilities.StepPlan`,
        built from ``cfg`` when not given) asks of the rollout, and ``algorithm.dynamic_sampling``."""
        a = cfg.algorithm
        if step_plan is not None and not isinstance(step_plan, StepPlan):  # rltk <= 0.x: the advantage_fn itself
            warnings.warn("RolloutPlan.from_config(cfg, advantage_fn) is deprecated: pass the stage's StepPlan "
                          "(or nothing), which reads algorithm.advantage_fn", DeprecationWarning, stacklevel=2)
            step_plan = StepPlan.build(OmegaConf.merge(cfg, {"algorithm": {"advantage_fn": _name_of(step_plan)}}))
        step_plan = step_plan if step_plan is not None else StepPlan.build(cfg)
        return cls(
            greedy_baseline=step_plan.greedy_baseline,
            reward_components=step_plan.reward_components,
            dynamic_sampling=bool(a.dynamic_sampling),
            max_rounds=int(a.dynamic_sampling_max_rounds) if a.dynamic_sampling else 1,
        )


def _name_of(advantage_fn) -> str:
    """The registered name of ``advantage_fn`` (the deprecated form of :meth:`RolloutPlan.from_config`)."""
    from rltk.registry import get_registry

    for name, entry in get_registry().entries["advantage_fn"].items():
        if entry.obj is advantage_fn:
            return name
    raise ValueError(f"{advantage_fn!r} is not a registered advantage_fn: register it to plan a rollout for it")


def scores_differ(group: list[Experience], atol: float = EQUAL_SCORES_ATOL) -> bool:
    """True if the group's scores are not all equal (within ``atol``): a group-relative advantage is then
    non-zero somewhere. A group of one never differs."""
    scores = [e.score for e in group]
    return max(scores) - min(scores) > atol


def _groups(experiences: list[Experience]) -> list[list[Experience]]:
    """Experiences by ``group_id``, groups in order of first appearance."""
    groups: dict[int, list[Experience]] = {}
    for e in experiences:
        groups.setdefault(e.group_id, []).append(e)
    return list(groups.values())


def _rank_rows(sampler, strategy) -> list[dict]:
    rows = sampler.next_batch()
    return rows if strategy is None else rows[strategy.data_rank :: strategy.data_world_size]


def collect_experiences(workflow, sampler, plan: RolloutPlan, strategy=None) -> tuple[list[Experience], dict]:
    """The experiences of one RL step and the metrics of how they were gathered.

    Every rank draws the same global batch of prompts from ``sampler`` and
    runs the workflow on its share (``rows[rank::world]``).

    Under dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM
    Reinforcement Learning System at Scale", arXiv:2503.14476, Sec. 3.2) a
    group whose scores are all equal (all solved, all failed) has zero
    group-relative advantage, so it is dropped, and further rounds draw the
    next prompts from ``sampler`` until the rank holds as many informative
    groups as it had prompts in the first round; surplus groups of the last
    round are discarded, so the batch size stays that of a step. After
    ``plan.max_rounds`` rounds the step trains on what it has (possibly
    nothing: the recipes then skip it). Ranks run the same number of rounds,
    a rank that is already full only drawing the prompts, so every rank's
    sampler stays at the same position (checkpoints store one).

    Metrics (under dynamic sampling, summed over ranks):
    ``dynamic_sampling/rounds``, ``dynamic_sampling/cap_reached`` (1 when the
    step stopped at ``max_rounds`` short of its target),
    ``dynamic_sampling/groups`` (informative groups trained on),
    ``dynamic_sampling/groups_target``, ``dynamic_sampling/groups_dropped``
    (equal-score groups), ``dynamic_sampling/groups_surplus`` and
    ``dynamic_sampling/generated_tokens`` (response tokens of every round, the
    cost of the refill). The workflow's own metrics describe its last round.

    Always, over every experience the workflow produced this step (every
    round, every rank), *before* dynamic sampling or the sample strategy
    choose what is trained on: ``rollout/reward`` (mean score),
    ``rollout/accuracy`` (fraction with score >= 1), ``rollout/samples`` and
    ``rollout/groups``. :func:`rltk.training.step.batch_metrics.rollout_metrics` gives the
    same numbers of the batch trained on (``reward``, ``accuracy``,
    ``batch/samples``, ``batch/groups``).
    """
    run_args = {"greedy_baseline": True} if plan.greedy_baseline else {}
    rows = _rank_rows(sampler, strategy)
    if not plan.dynamic_sampling:
        experiences = workflow.run(rows, **run_args)
        return experiences, _produced_metrics(_produced_counts(experiences), strategy)
    target = len(rows)
    kept: list[list[Experience]] = []
    dropped = surplus = rounds = generated = 0
    produced = torch.zeros(4, dtype=torch.float64)
    while True:
        rounds += 1
        if len(kept) < target:
            experiences = workflow.run(rows, **run_args)
            generated += sum(len(e.response_ids) for e in experiences)
            produced += _produced_counts(experiences)
            for group in _groups(experiences):
                if not scores_differ(group):
                    dropped += 1
                elif len(kept) < target:
                    kept.append(group)
                else:
                    surplus += 1
        if rounds >= plan.max_rounds or not any_rank(strategy, len(kept) < target):
            break
        rows = _rank_rows(sampler, strategy)
    counts = torch.tensor([len(kept), target, dropped, surplus, float(len(kept) < target), generated],
                          dtype=torch.float64)
    counts = torch.cat([counts, produced])  # one collective for both
    if strategy is not None and strategy.data_world_size > 1:
        counts = strategy.all_reduce_sum(counts)
    groups, wanted, dropped_all, surplus_all, short, tokens = counts[:6].tolist()
    metrics = {
        **_produced_metrics(counts[6:], None),
        "dynamic_sampling/rounds": float(rounds),
        "dynamic_sampling/cap_reached": float(short > 0),
        "dynamic_sampling/groups": groups,
        "dynamic_sampling/groups_target": wanted,
        "dynamic_sampling/groups_dropped": dropped_all,
        "dynamic_sampling/groups_surplus": surplus_all,
        "dynamic_sampling/generated_tokens": tokens,
    }
    return [e for group in kept for e in group], metrics


def produced_metrics(experiences: list[Experience]) -> dict[str, float]:
    """``rollout/reward``, ``rollout/accuracy``, ``rollout/samples``, ``rollout/groups`` of ``experiences``
    (an asynchronous step's, sampled by a producer process)."""
    return _produced_metrics(_produced_counts(experiences), None)


def _produced_counts(experiences: list[Experience]) -> torch.Tensor:
    """``[score sum, scores >= 1, samples, groups]`` of one rank's experiences (float64, to sum over ranks)."""
    scores = [float(e.score) for e in experiences]
    return torch.tensor([sum(scores), sum(s >= 1 for s in scores), len(scores),
                         len({e.group_id for e in experiences})], dtype=torch.float64)


def _produced_metrics(counts: torch.Tensor, strategy) -> dict[str, float]:
    """The ``rollout/`` means and counts of :func:`_produced_counts`, summed over ranks first with a ``strategy``."""
    if strategy is not None and strategy.data_world_size > 1:
        counts = strategy.all_reduce_sum(counts)
    score_sum, correct, samples, groups = counts.tolist()
    return {"rollout/reward": score_sum / max(samples, 1), "rollout/accuracy": correct / max(samples, 1),
            "rollout/samples": samples, "rollout/groups": groups}


def expert_experiences(cfg: DictConfig, tokenizer, reward) -> list[Experience]:
    """Experiences from ``buffer.expert.path``: one per row, its prompt and the expert's response.

    Prompts are formatted exactly as training prompts (``data.prompt_template``,
    ``data.system_prompt``, chat template, ``data.max_prompt_tokens``), so an
    expert response to a training prompt has the same prompt tokens as the
    policy's responses to it (``mix_expert`` then puts it in their group). The
    response gets the tokenizer's eos token, as a finished answer. Its score is
    ``buffer.expert.score`` when set, else the run's reward of the response
    against the row's ``buffer.expert.answer_key`` column. Each gets a group of
    its own with a negative id, which no workflow uses. Empty when no path is set.

    Problems with the file (a missing column, an empty file) are config errors
    naming the ``buffer.expert.*`` key.
    """
    from rltk.data.loading import format_prompts, load_rows
    from rltk.workflows.base import normalize_reward_output

    e, d = cfg.buffer.expert, cfg.data
    if not e.path:
        return []
    try:
        rows = load_rows(e.path, split=e.split, prompt_key=e.prompt_key, answer_key=e.answer_key,
                         config_prefix="buffer.expert")
        # The answer column is the ground truth, not an extra: one column may serve as both.
        same_column = e.response_key == e.answer_key
        missing = None if same_column else next((r for r in rows if e.response_key not in r["extras"]), None)
        if missing is not None:
            raise ConfigError(
                f"buffer.expert.response_key='{e.response_key}' is not a column of '{e.path}' (row "
                f"'{missing['id']}' has {sorted(missing['extras'])} besides the prompt and answer)"
            )
        rows = format_prompts(rows, tokenizer, system_prompt=d.system_prompt, use_chat_template=d.use_chat_template,
                              prompt_template=d.prompt_template, max_prompt_tokens=d.max_prompt_tokens,
                              on_too_long=d.on_too_long, config_prefix="data")
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"buffer.expert: {exc}") from exc
    experiences = []
    for index, row in enumerate(rows):
        response = row["ground_truth"] if same_column else str(row["extras"][e.response_key])
        if e.score is not None:
            score, details = float(e.score), {}
        else:
            where = f"expert row '{row['id']}' of '{e.path}'"
            score, details = normalize_reward_output(
                reward(prompt=row["prompt"], response=response, ground_truth=row["ground_truth"],
                       extras=dict(row["extras"])), where)
        experiences.append(Experience(
            prompt_ids=list(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]),
            response_ids=list(tokenizer(response, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id],
            score=score,
            group_id=-(index + 1),
            reward_details=details,
            info={"prompt": row["prompt"], "response": response, "ground_truth": row["ground_truth"],
                  "row_id": row["id"], "expert": True},
        ))
    return experiences
