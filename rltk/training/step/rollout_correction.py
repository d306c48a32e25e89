"""Applying the rollout/trainer mismatch correction to a rollout batch before the policy update.

The math is :mod:`rltk.algorithms.mismatch`; this module decides how the
update uses it, for every policy loss and every aggregation:

* The importance weight multiplies each token's policy-loss term: the loss's
  ``loss_agg`` callable is wrapped so that it aggregates ``weight * loss_mat``
  (:func:`rltk.algorithms.mismatch.weighted_loss_agg`). Policy losses need no change, and the KL and
  entropy terms are not weighted (they regularise the current policy, they
  do not estimate a gradient under the behaviour policy).
* Dropped tokens (MIS outside its band, rejected responses) leave the
  response mask of the update. They then count in no loss normaliser: the
  global token and sequence counts, and a response's own length under
  ``seq-mean-token-mean``, cover only the kept tokens, so the update is the
  mean over the kept data, as if the dropped tokens had never been sampled.
  The alternative, dividing by the sampled count, would shrink every step's
  gradient by the fraction dropped and make the step size depend on how
  badly the engine matched. Dropped tokens also leave the KL and entropy
  terms and the policy loss's own metrics.
* Advantages are computed before, on the whole batch: a rejected response
  is still a real sample of its prompt, so its reward still informs the
  group baseline of the others.
* Responses without rollout log-probs (expert data mixed in by a sample
  strategy: ``has_rollout_logprobs`` is False) are neither weighted nor
  dropped nor measured: there is no behaviour probability to compare with.
* The weights and drops are computed once per rollout batch: ``pi_old`` and
  ``pi_rollout`` do not change over ``ppo_epochs`` and mini-batches. The
  critic of the ``ppo`` recipe is trained on every response as before; the
  correction concerns the policy gradient only.

Metrics, prefixed ``mismatch/``, are over every rank's tokens (see
:func:`rltk.algorithms.mismatch.mismatch_metrics`).
"""

from __future__ import annotations

from typing import Mapping

import torch

from rltk.algorithms.mismatch import (
    MAX_SUFFIX, MIN_SUFFIX, correction_active, mismatch_metrics, mismatch_statistics, rollout_correction,
)

WEIGHTS_KEY = "rollout_is_weights"  # batch field the update reads the per-token weights from


def correctable_mask(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``response_mask`` restricted to responses that carry rollout log-probs.

    Shape: returns (B, T) float.
    """
    mask = batch["response_mask"].float()
    known = batch.get("has_rollout_logprobs")
    return mask if known is None else mask * known.to(mask.device, torch.float32).unsqueeze(-1)


def _reduce(strategy, stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """Sum, max or min each statistic over ranks, by its name."""
    if strategy is None or strategy.data_world_size == 1:
        return {k: float(v) for k, v in stats.items()}
    names = sorted(stats)
    sums = [n for n in names if not n.endswith((MAX_SUFFIX, MIN_SUFFIX))]
    extremes = [n for n in names if n.endswith((MAX_SUFFIX, MIN_SUFFIX))]
    out = {}
    if sums:
        summed = strategy.all_reduce_sum(torch.stack([stats[n] for n in sums]).double().cpu()).tolist()
        out.update(zip(sums, summed))
    if extremes:
        # min(x) = -max(-x); +-inf (a rank with no tokens) is the identity of both
        signed = torch.stack([stats[n] if n.endswith(MAX_SUFFIX) else -stats[n] for n in extremes]).double().cpu()
        maxed = strategy.all_reduce_max(signed).tolist()
        out.update({n: v if n.endswith(MAX_SUFFIX) else -v for n, v in zip(extremes, maxed)})
    return out


def apply_rollout_correction(
    batch: dict[str, torch.Tensor], settings: Mapping, *, log_metrics: bool = False, strategy=None,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The batch the update should train on, and the ``mismatch/*`` metrics of this step.

    ``settings`` are :func:`~rltk.algorithms.mismatch.rollout_correction`'s
    keyword arguments (``algorithm.rollout_correction`` without
    ``log_metrics``). With every mode off the batch is returned as is, with
    metrics when ``log_metrics`` is set and none otherwise. With a mode on,
    a shallow copy is returned whose ``response_mask`` has the dropped tokens
    removed and whose ``rollout_is_weights`` field holds the per-token
    weights; ``batch`` itself is not changed.

    Needs ``old_logprobs`` (the trainer's recompute) and ``rollout_logprobs``.
    With a ``strategy`` the metrics cover every rank; every rank must call this.
    """
    active = correction_active(settings)
    if not active and not log_metrics:
        return batch, {}
    missing = [k for k in ("old_logprobs", "rollout_logprobs") if k not in batch]
    if missing:
        raise ValueError(
            f"algorithm.rollout_correction needs batch field(s) {missing} (the trainer's recomputed old "
            f"log-probs and the engine's log-probs); available: {sorted(batch)}"
        )
    mask = correctable_mask(batch)
    old, rollout = batch["old_logprobs"], batch["rollout_logprobs"].to(batch["old_logprobs"].device)
    correction = rollout_correction(old, rollout, mask, **settings) if active else None
    metrics = mismatch_metrics(_reduce(strategy, mismatch_statistics(old, rollout, mask, correction)))
    metrics = {f"mismatch/{k}": v for k, v in metrics.items()}
    if correction is None:
        return batch, metrics
    corrected = dict(batch)
    kept = batch["response_mask"] * (~correction.dropped).to(batch["response_mask"].dtype)
    corrected["response_mask"] = kept
    corrected[WEIGHTS_KEY] = correction.weights.float()
    return corrected, metrics

