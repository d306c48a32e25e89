"""Sample strategies: which experiences in the buffer the trainer reads next.

Each strategy is a class registered under the kind ``sample_strategy``; a
recipe builds it with its configured arguments and calls, once per step::

    buffer.put(workflow.run(rows), step)
    experiences = strategy.sample(buffer, step)   # removes what it returns
    metrics.update(strategy.metrics())            # "buffer/..." numbers of that call

A group (the responses to one prompt, one ``group_id``) is never split: group
advantages need all of its members in one batch.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any

import rltk
from rltk.buffer.buffer import POLICY, BufferItem, ExperienceBuffer

if TYPE_CHECKING:  # the experiences are only passed on here: no torch to import
    from rltk.batch import Experience


class SampleStrategy(abc.ABC):
    """Chooses and removes the experiences the trainer learns from at a step."""

    def __init__(self):
        self._metrics: dict[str, float] = {}

    @abc.abstractmethod
    def sample(self, buffer: ExperienceBuffer, step: int) -> list[Experience]:
        """Remove and return the experiences to train on at training step ``step``."""

    def metrics(self) -> dict[str, float]:
        """``buffer/...`` numbers describing the last :meth:`sample` call."""
        return dict(self._metrics)

    @classmethod
    def buffer_sources(cls, **args: Any) -> set[str]:
        """The buffer sources this strategy reads when built with ``args`` (its configured arguments).

        Config validation compares them with the sources a recipe fills, so a
        strategy that waits for data no recipe puts in fails before any model
        loads. The default is the recipe's own rollouts, source ``"policy"``.
        """
        return {POLICY}


def group_items(items: list[BufferItem]) -> list[list[BufferItem]]:
    """Items grouped by ``group_id``, groups in order of first appearance, members in order."""
    groups: dict[int, list[BufferItem]] = {}
    for item in items:
        groups.setdefault(item.experience.group_id, []).append(item)
    return list(groups.values())


def _fill_with_groups(groups: list[list[BufferItem]], budget: int) -> list[list[BufferItem]]:
    """Leading whole groups totalling at most ``budget`` items.

    A first group larger than the whole budget is still taken, so a non-empty
    buffer never yields an empty batch only because groups are large.
    """
    chosen, total = [], 0
    for group in groups:
        if total + len(group) > budget and (chosen or budget == 0):
            break
        chosen.append(group)
        total += len(group)
    return chosen


def _check_int(strategy: str, name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        valid = f"an integer >= {minimum}" + (" or null" if allow_none else "")
        raise ValueError(
            f"sample strategy '{strategy}': {name} (buffer.sample_strategy_args.{name}) must be {valid}, "
            f"got {value!r}"
        )


class OnPolicy(SampleStrategy):
    """The latest experiences put in, each exactly once; everything older is dropped.

    Takes every item of the newest step in the buffer (all ``put`` calls made
    at that step, e.g. several rollout rounds of DAPO's dynamic sampling) and
    empties the buffer. Sampling from an empty buffer is an error: in an
    on-policy loop it means the step's rollout never reached the buffer.

    Metrics: ``buffer/sampled``, ``buffer/dropped_stale`` (older items thrown
    away) and ``buffer/staleness`` (``step`` minus the step sampled).
    """

    name = "on_policy"

    def _take_latest(self, buffer: ExperienceBuffer, step: int) -> list[BufferItem]:
        latest = buffer.latest_step()
        if latest is None:
            raise ValueError(
                f"sample strategy '{self.name}': the buffer is empty at step {step}; put the step's "
                f"experiences in (buffer.put(experiences, step)) before sampling"
            )
        items = buffer.take(lambda item: item.step == latest)
        stale = buffer.clear()
        self._metrics = {
            "buffer/sampled": float(len(items)),
            "buffer/dropped_stale": float(stale),
            "buffer/staleness": float(step - latest),
        }
        return items

    def sample(self, buffer: ExperienceBuffer, step: int) -> list[Experience]:
        """Every experience of the newest step, in the order they were put in."""
        return [item.experience for item in self._take_latest(buffer, step)]


class FilterEqualGroups(OnPolicy):
    """On-policy, minus the groups whose scores are all equal (DAPO's dynamic sampling).

    A group whose responses all score the same (all solved, all failed, or a
    group of one) has zero group-relative advantage everywhere, so it adds no
    policy gradient but still dilutes token-mean losses (Yu et al. 2025,
    "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
    arXiv:2503.14476, Sec. 3.2).

    Args:
        min_groups: if fewer groups than this have differing scores, equal
            groups are kept too (the earliest first) until ``min_groups`` are
            returned, so a step always has something to train on.
        atol: scores within ``atol`` of each other count as equal.

    Metrics: those of ``on_policy`` plus ``buffer/groups``,
    ``buffer/groups_equal``, ``buffer/groups_dropped`` and
    ``buffer/groups_kept_equal`` (equal groups kept to reach ``min_groups``).
    """

    name = "filter_equal_groups"

    def __init__(self, min_groups: int = 1, atol: float = 1e-6):
        super().__init__()
        _check_int(self.name, "min_groups", min_groups, 0)
        if isinstance(atol, bool) or not isinstance(atol, (int, float)) or atol < 0:
            raise ValueError(
                f"sample strategy '{self.name}': atol (buffer.sample_strategy_args.atol) must be a number >= 0, "
                f"got {atol!r}"
            )
        self.min_groups = min_groups
        self.atol = float(atol)

    def sample(self, buffer: ExperienceBuffer, step: int) -> list[Experience]:
        """The newest step's groups with differing scores (topped up to ``min_groups``)."""
        groups = group_items(self._take_latest(buffer, step))
        equal = [self._all_equal(g) for g in groups]
        keep = [not e for e in equal]
        shortfall = self.min_groups - sum(keep)
        kept_equal = 0
        for index, is_equal in enumerate(equal):
            if shortfall <= 0:
                break
            if is_equal:
                keep[index] = True
                kept_equal += 1
                shortfall -= 1
        chosen = [item.experience for group, k in zip(groups, keep) if k for item in group]
        self._metrics.update(
            {
                "buffer/sampled": float(len(chosen)),
                "buffer/groups": float(len(groups)),
                "buffer/groups_equal": float(sum(equal)),
                "buffer/groups_dropped": float(len(groups) - sum(keep)),
                "buffer/groups_kept_equal": float(kept_equal),
            }
        )
        return chosen

    def _all_equal(self, group: list[BufferItem]) -> bool:
        scores = [item.experience.score for item in group]
        return max(scores) - min(scores) <= self.atol


class Staleness(SampleStrategy):
    """Off-policy with bounded staleness: oldest experiences first, none older than ``max_staleness``.

    Experiences produced at step ``s`` may be trained on at steps
    ``s .. s + max_staleness`` (asynchronous RL, where rollouts run ahead of
    the trainer, as in AReaL: Fu et al. 2025, "AReaL: A Large-Scale
    Asynchronous Reinforcement Learning System for Language Reasoning",
    arXiv:2505.24298); older ones are dropped. Each call removes and returns the
    oldest whole groups, at most ``batch_size`` experiences (a first group
    larger than that is returned whole), or everything eligible when
    ``batch_size`` is null. Returns an empty list when nothing is eligible.

    Args:
        max_staleness: how many steps old an experience may be (``0``: only
            the current step's).
        batch_size: experiences per call, or ``None`` for all eligible.

    Metrics: ``buffer/sampled``, ``buffer/dropped_stale``,
    ``buffer/staleness_mean``, ``buffer/staleness_max``, ``buffer/remaining``.
    """

    name = "staleness"

    def __init__(self, max_staleness: int = 1, batch_size: int | None = None):
        super().__init__()
        _check_int(self.name, "max_staleness", max_staleness, 0)
        _check_int(self.name, "batch_size", batch_size, 1, allow_none=True)
        self.max_staleness = max_staleness
        self.batch_size = batch_size

    def sample(self, buffer: ExperienceBuffer, step: int) -> list[Experience]:
        """The oldest eligible whole groups, up to ``batch_size`` experiences."""
        dropped = buffer.drop_older_than(step - self.max_staleness)
        groups = group_items(buffer.items())
        if self.batch_size is not None:
            groups = _fill_with_groups(groups, self.batch_size)
        chosen_ids = {id(item) for group in groups for item in group}
        items = buffer.take(lambda item: id(item) in chosen_ids)
        ages = [step - item.step for item in items]
        self._metrics = {
            "buffer/sampled": float(len(items)),
            "buffer/dropped_stale": float(dropped),
            "buffer/staleness_mean": sum(ages) / len(ages) if ages else 0.0,
            "buffer/staleness_max": float(max(ages)) if ages else 0.0,
            "buffer/remaining": float(len(buffer)),
        }
        return [item.experience for item in items]


class MixExpert(SampleStrategy):
    """On-policy experiences plus a fixed fraction of expert experiences from a second source.

    The policy part is exactly ``on_policy`` over the items of source
    ``"policy"``. Expert experiences (demonstrations, a stronger model's
    solutions) are put in under ``expert_source``, e.g.
    ``buffer.put(expert_experiences, step=0, source="expert")``; whole expert
    groups are added, oldest first, until they make up ``expert_fraction`` of
    the batch: ``round(f * P / (1 - f))`` of them for ``P`` policy
    experiences. This is the off-policy guidance of LUFFY (Yan et al. 2025,
    "Learning to Reason under Off-Policy Guidance", arXiv:2504.14945). Expert
    experiences usually carry no ``rollout_logprobs``; give them group ids no
    policy group uses (the recipes load ``buffer.expert.path`` with negative ids).

    An expert experience whose prompt tokens equal those of a policy group of
    the step is preferred, and is returned in that group (its ``group_id`` set
    to the policy group's, and its ``baseline_score`` too): group-relative advantages then rate the
    demonstration against the policy's own tries, as in LUFFY. Others stand in
    groups of their own, where a group-relative estimator gives them advantage
    0 (a group of one); estimators with another baseline (``remax``,
    ``reinforce_plus_plus``) still learn from them.

    Args:
        expert_fraction: target share of expert experiences, in ``[0, 1)``.
        expert_source: the buffer source holding expert experiences.
        recycle_expert: put used expert experiences back at the end of the
            queue, so a fixed set of demonstrations cycles forever; otherwise
            each is used once and the expert share drops when they run out.

    Metrics: ``buffer/sampled``, ``buffer/policy``, ``buffer/expert``,
    ``buffer/expert_fraction``, ``buffer/expert_shortfall`` (expert
    experiences wanted but not available), ``buffer/expert_joined`` (expert
    experiences put in a policy group of the same prompt) and
    ``buffer/dropped_stale``.
    """

    name = "mix_expert"

    def __init__(self, expert_fraction: float = 0.25, expert_source: str = "expert", recycle_expert: bool = True):
        super().__init__()
        if isinstance(expert_fraction, bool) or not isinstance(expert_fraction, (int, float)) or not (
            0.0 <= expert_fraction < 1.0
        ):
            raise ValueError(
                f"sample strategy '{self.name}': expert_fraction (buffer.sample_strategy_args.expert_fraction) "
                f"must be a number in [0, 1), got {expert_fraction!r}"
            )
        if not isinstance(expert_source, str) or not expert_source or expert_source == POLICY:
            raise ValueError(
                f"sample strategy '{self.name}': expert_source (buffer.sample_strategy_args.expert_source) must "
                f"name a buffer source other than "
                f"'{POLICY}', got {expert_source!r}"
            )
        self.expert_fraction = float(expert_fraction)
        self.expert_source = expert_source
        self.recycle_expert = bool(recycle_expert)
        self._seen_expert = False

    @classmethod
    def buffer_sources(cls, expert_fraction: float = 0.25, expert_source: str = "expert", **args: Any) -> set[str]:
        """``policy`` and, when ``expert_fraction`` > 0, ``expert_source``."""
        return {POLICY, expert_source} if expert_fraction else {POLICY}

    def sample(self, buffer: ExperienceBuffer, step: int) -> list[Experience]:
        """The newest policy experiences followed by the expert share."""
        latest = buffer.latest_step(POLICY)
        if latest is None:
            raise ValueError(
                f"sample strategy '{self.name}': no policy experiences in the buffer at step {step}; "
                f"put the step's rollouts in with buffer.put(experiences, step)"
            )
        available = buffer.items(self.expert_source)
        self._seen_expert = self._seen_expert or bool(available)
        if self.expert_fraction > 0 and not self._seen_expert:
            raise ValueError(
                f"sample strategy '{self.name}': expert_fraction={self.expert_fraction} but the buffer holds "
                f"no experiences of source '{self.expert_source}'; put them in with "
                f"buffer.put(expert_experiences, step, source='{self.expert_source}')"
            )
        policy = buffer.take(lambda item: item.source == POLICY and item.step == latest)
        stale = buffer.drop(lambda item: item.source == POLICY)
        wanted = round(self.expert_fraction * len(policy) / (1.0 - self.expert_fraction))
        # Demonstrations for this step's prompts come first and join that prompt's group, so a
        # group-relative estimator compares the expert with the policy's own tries (LUFFY's mixed
        # groups); the rest of the share is filled oldest first, each in a group of its own.
        prompt_group = {tuple(item.experience.prompt_ids): item.experience for item in policy}
        expert_groups = group_items(available)
        matching = [g for g in expert_groups if tuple(g[0].experience.prompt_ids) in prompt_group]
        others = [g for g in expert_groups if tuple(g[0].experience.prompt_ids) not in prompt_group]
        groups = _fill_with_groups(matching + others, wanted) if wanted > 0 else []
        chosen_ids = {id(item) for group in groups for item in group}
        expert = buffer.take(lambda item: id(item) in chosen_ids)
        if self.recycle_expert:
            for item in expert:
                buffer.put([item.experience], item.step, source=item.source)
        joined = 0
        experiences = []
        for item in expert:
            member = prompt_group.get(tuple(item.experience.prompt_ids))
            if member is None:
                experiences.append(item.experience)
            else:  # it takes the group's id and its baseline (ReMax's greedy score of the same prompt)
                joined += 1
                experiences.append(dataclasses.replace(item.experience, group_id=member.group_id,
                                                       baseline_score=member.baseline_score))

        total = len(policy) + len(expert)
        self._metrics = {
            "buffer/sampled": float(total),
            "buffer/policy": float(len(policy)),
            "buffer/expert": float(len(expert)),
            "buffer/expert_fraction": len(expert) / total if total else 0.0,
            "buffer/expert_shortfall": float(max(wanted - len(expert), 0)),
            "buffer/expert_joined": float(joined),
            "buffer/dropped_stale": float(stale),
        }
        return [item.experience for item in policy] + experiences


@rltk.hookimpl
def rltk_sample_strategies():
    return {
        "on_policy": OnPolicy,
        "filter_equal_groups": FilterEqualGroups,
        "staleness": Staleness,
        "mix_expert": MixExpert,
    }
