"""What every RL step logs about the batch it trained on (:func:`rollout_metrics`)."""

from __future__ import annotations

import torch


def rollout_metrics(batch: dict[str, torch.Tensor], workflow, sample_strategy, elapsed: float,
                    strategy=None) -> dict[str, float]:
    """What every RL step logs about its batch: reward, accuracy, lengths, throughput, plus the
    workflow's, reward functions' and sample strategy's own counters.

    Two sets of responses, named apart: ``batch`` is what the trainer read, *after* the sample
    strategy (filtered, mixed with expert data ...), and gives ``reward`` (mean score),
    ``accuracy`` (fraction with score >= 1), ``response_length``, ``tokens_per_s``,
    ``batch/samples`` and ``batch/groups``; the ``rollout/*`` and ``reward/*`` counters of the
    workflow (and ``rollout/reward``, ``rollout/accuracy``, ``rollout/samples``,
    ``rollout/groups`` of :func:`rltk.training.rollouts.collect.collect_experiences`) describe everything
    it produced, *before* the sample strategy.

    With a ``strategy`` the numbers cover every rank: reward, accuracy and length are means over
    all responses, ``tokens_per_s`` and the ``batch/`` counts are totals, and the components'
    counters are averaged over ranks.
    """
    scores = batch["scores"].double().cpu()
    local = torch.stack([
        scores.sum(), (scores >= 1).double().sum(), batch["response_lengths"].double().sum().cpu(),
        torch.tensor(float(scores.numel()), dtype=torch.float64),
        batch["attention_mask"].double().sum().cpu(),
        torch.tensor(float(batch["group_ids"].unique().numel()), dtype=torch.float64),
    ])
    score_sum, correct, length_sum, n, tokens, groups = (
        local if strategy is None else strategy.all_reduce_sum(local)).tolist()
    counters = {
        **workflow.metrics(),
        **{f"reward_fn/{k}": v for k, v in workflow.reward.stats().items()},
        **sample_strategy.metrics(),
    }
    if strategy is not None and strategy.data_world_size > 1:
        every_rank = strategy.all_gather_object(counters)
        counters = {k: sum(float(c.get(k, 0.0)) for c in every_rank) / len(every_rank)
                    for k in sorted(set().union(*every_rank))}
    return {
        "reward": score_sum / max(n, 1),
        "accuracy": correct / max(n, 1),
        "response_length": length_sum / max(n, 1),
        "tokens_per_s": tokens / elapsed,
        "batch/samples": n,
        "batch/groups": groups,
        "time/step_s": elapsed,
        **counters,
    }
