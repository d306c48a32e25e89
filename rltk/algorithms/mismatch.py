"""Rollout/trainer mismatch correction: importance weights and masks between two policies.

The rollout engine samples with ``pi_rollout`` (vLLM kernels, bf16, a policy a
few updates old ...) while the trainer's update is anchored at ``pi_old``, the
same weights evaluated by the training forward. The two differ, so the batch is
off-policy for the update even at ``ppo_epochs=1``. With the per-token ratio

    rho_t = pi_old(y_t) / pi_rollout(y_t) = exp(old_logprobs_t - rollout_logprobs_t)

an unbiased update weighs every token's policy-loss term by ``rho_t``; the
modes below trade that for bounded variance. ``rho`` is measured against the
old policy, never the current one, so it is a constant of the batch (no
gradient) and the policy loss's own ratio ``pi / pi_old`` keeps doing its job
(the "decoupled" objective of Hilton et al. 2021).

Modes (each off with ``None``; ``tis`` and ``mis`` both set a weight, so at most
one of them; ``rejection`` combines with either)::

    tis="token"        w_t = min(rho_t, C)                             (truncated IS, TIS)
    tis="sequence"     w_t = min(prod_s rho_s, C)       for every t of the response
                       (tis_cap=None: no truncation, plain importance sampling, w_t = rho_t or prod_s rho_s)
    mis="token"        w_t = rho_t  if low <= rho_t <= high, token dropped otherwise
    mis="sequence"     w_t = R      if low <= R <= high with R = prod_s rho_s, response dropped otherwise
    rejection="geometric"  response dropped unless low <= exp(mean_s log rho_s) <= high
    rejection="sequence"   response dropped unless low <= prod_s rho_s <= high
    rejection="token"      response dropped unless low <= rho_s <= high for every token s

Bands are closed: a ratio exactly at a threshold is kept (and a TIS weight
exactly at ``C`` is not counted as truncated). Comparisons happen in log space
in the working dtype (``float32``, or ``float64`` for ``float64`` inputs), with
the thresholds' logs rounded to that dtype, so a log-ratio equal to
``log(threshold)`` in that dtype is exactly at the threshold. ``low = 0`` means
no lower bound.

A dropped token is removed from the update: its weight is 0 and the caller
takes it out of the response mask, so it counts in no loss normaliser either
(see :mod:`rltk.training.step.rollout_correction`).

The same weights are the behaviour-policy correction of the decoupled PPO
objective (:func:`rltk.algorithms.policy_losses.decoupled_loss`): with
asynchronous rollouts ``pi_rollout`` is a policy several versions old (per
token, where a rollout spans a weight update) and ``pi_old`` is the proximal
policy, the trainer's recompute before the update. One function serves both:
the loop's batch-level correction and the decoupled loss call
:func:`rollout_correction` and weigh the loss through :func:`weighted_loss_agg`.

Papers: Yao, Liu et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training" (https://fengyao.notion.site/off-policy-rl; truncated
importance sampling, TIS); Liu, Li et al. 2025, "When Speed Kills Stability:
Demystifying RL Collapse from the Training-Inference Mismatch"
(https://richardli.xyz/rl-collapse; token/sequence masked importance sampling,
MIS, and geometric-mean rejection); Ling Team 2025, "Every Step Evolves:
Scaling Reinforcement Learning for Trillion-Scale Thinking Model",
arXiv:2510.18855 (IcePop: masking tokens whose ratio leaves a two-sided band);
Hilton, Cobbe, Schulman 2021, "Batch size-invariance for policy optimization",
arXiv:2110.00641 (decoupled behaviour and proximal policies).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, NamedTuple

import torch

# The settings and their check need no torch (rltk validate reads them): their own module, named here too.
from rltk.algorithms.correction_settings import (  # noqa: F401
    DEFAULTS, MIS_LEVELS, REJECTION_LEVELS, TIS_LEVELS, check_rollout_correction, correction_active,
)

__all__ = [
    "TIS_LEVELS",
    "MIS_LEVELS",
    "REJECTION_LEVELS",
    "check_rollout_correction",
    "correction_active",
    "Correction",
    "rollout_correction",
    "mismatch_statistics",
    "mismatch_metrics",
    "weighted_loss_agg",
]

# Log-ratios are clamped to +-this before exp() in metrics, so a token the trainer gives
# probability ~0 cannot overflow the KL and ratio statistics (e^20 ~ 4.9e8 says enough).
METRIC_LOG_RATIO_CLAMP = 20.0


def _working(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor):
    """The mask as bool and ``log rho`` (0 off the mask) in float32 or wider."""
    if old_logprobs.shape != rollout_logprobs.shape or old_logprobs.shape != response_mask.shape \
            or old_logprobs.dim() != 2:
        raise ValueError(
            f"rollout correction: old_logprobs {tuple(old_logprobs.shape)}, rollout_logprobs "
            f"{tuple(rollout_logprobs.shape)} and response_mask {tuple(response_mask.shape)} must be the same [B, T]"
        )
    dtype = torch.promote_types(torch.promote_types(old_logprobs.dtype, rollout_logprobs.dtype), torch.float32)
    on = response_mask > 0
    # where, not multiply: padding log-probs may be -inf, and -inf * 0 is NaN
    log_ratio = torch.where(on, old_logprobs.detach().to(dtype) - rollout_logprobs.detach().to(dtype), 0.0)
    return on, log_ratio


def _log_bound(value: float, dtype: torch.dtype) -> torch.Tensor:
    """``log(value)`` rounded to ``dtype`` (``-inf`` for 0): thresholds compared in the inputs' precision."""
    return torch.tensor(math.log(value) if value > 0 else -math.inf, dtype=torch.float64).to(dtype)


def _inside(log_value: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return (log_value >= _log_bound(low, log_value.dtype)) & (log_value <= _log_bound(high, log_value.dtype))


class Correction(NamedTuple):
    """What :func:`rollout_correction` decided, per token and per response.

    ``weights`` ``[B, T]``: multiply each token's policy-loss term (1 off the
    mask and with no weighting mode, 0 on dropped tokens). ``dropped``
    ``[B, T]`` bool: mask tokens that MIS or rejection remove from the update.
    ``truncated`` ``[B, T]`` bool: mask tokens whose TIS weight was capped.
    ``rejected`` ``[B]`` bool: responses removed whole by ``rejection``.
    """

    weights: torch.Tensor
    dropped: torch.Tensor
    truncated: torch.Tensor
    rejected: torch.Tensor


@torch.no_grad()
def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    tis: str | None = None,
    tis_cap: float | None = 2.0,
    mis: str | None = None,
    mis_low: float = 0.5,
    mis_high: float = 2.0,
    rejection: str | None = None,
    rejection_low: float = 0.5,
    rejection_high: float = 2.0,
) -> Correction:
    """Importance weights and the tokens to drop, for the modes in the module docstring.

    Args:
        old_logprobs: the trainer's log-probs of the sampled tokens under the
            policy that is updated (``pi_old``), ``[B, T]``.
        rollout_logprobs: the engine's log-probs of the same tokens
            (``pi_rollout``), ``[B, T]``.
        response_mask: 1 on the tokens to correct (policy tokens of responses
            whose rollout log-probs are known); every other token gets weight 1
            and is never dropped.

    Returns a :class:`Correction` (all detached). With every mode off the
    weights are 1 and nothing is dropped.

    Shape: (B, T) each -> Correction((B, T), (B, T), (B, T), (B,)).
    """
    check_rollout_correction(
        dict(tis=tis, tis_cap=tis_cap, mis=mis, mis_low=mis_low, mis_high=mis_high,
             rejection=rejection, rejection_low=rejection_low, rejection_high=rejection_high)
    )
    on, log_ratio = _working(old_logprobs, rollout_logprobs, response_mask)
    dtype = log_ratio.dtype
    has_tokens = on.any(-1)                                         # [B]
    seq_log_ratio = log_ratio.sum(-1, keepdim=True)                 # [B, 1]  log prod_t rho_t
    weights = torch.ones_like(log_ratio)
    kept = torch.ones_like(on)
    truncated = torch.zeros_like(on)
    rejected = torch.zeros_like(has_tokens)

    if tis is not None and tis_cap is None:
        level = log_ratio if tis == "token" else seq_log_ratio.expand_as(log_ratio)
        # untruncated; the clamp only keeps a response's log-ratio sum finite under exp (e^20 ~ 4.9e8)
        weights = torch.exp(level.clamp(max=METRIC_LOG_RATIO_CLAMP))
    elif tis is not None:
        level = log_ratio if tis == "token" else seq_log_ratio.expand_as(log_ratio)
        cap = _log_bound(tis_cap, dtype)
        truncated = (level > cap) & on
        # exp of the clamped log: a response's log-ratio sum can be far beyond what exp() holds
        capped = torch.tensor(float(tis_cap), dtype=dtype)
        weights = torch.where(truncated, capped, torch.exp(torch.minimum(level, cap)))
    if mis is not None:
        level = log_ratio if mis == "token" else seq_log_ratio.expand_as(log_ratio)
        weights = torch.exp(torch.minimum(level, _log_bound(mis_high, dtype)))  # exact inside the band
        kept = kept & _inside(level, mis_low, mis_high)
    if rejection is not None:
        if rejection == "token":
            accepted = (_inside(log_ratio, rejection_low, rejection_high) | ~on).all(-1)
        else:
            level = seq_log_ratio.squeeze(-1)
            if rejection == "geometric":
                level = level / on.sum(-1).clamp(min=1)
            accepted = _inside(level, rejection_low, rejection_high)
        rejected = has_tokens & ~accepted
        kept = kept & ~rejected.unsqueeze(-1)

    dropped = on & ~kept
    weights = torch.where(on, torch.where(dropped, 0.0, weights), 1.0)
    return Correction(weights, dropped, truncated & ~dropped, rejected)


# Statistics whose name ends like this are reduced over ranks with max (min is -max of -x);
# every other one is a sum.
MAX_SUFFIX, MIN_SUFFIX = "_max", "_min"


@torch.no_grad()
def mismatch_statistics(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    correction: Correction | None = None,
) -> dict[str, torch.Tensor]:
    """Sums, counts and extremes of the mismatch on one shard of a batch, to reduce over ranks.

    Names ending in ``_max`` / ``_min`` reduce with max / min, all others by
    summing; :func:`mismatch_metrics` turns the reduced totals into metrics.
    ``correction`` is what :func:`rollout_correction` decided on the same
    tensors (``None``: nothing weighted or dropped, metrics only). An empty
    mask gives zero sums and ``-inf`` / ``+inf`` extremes (the identities of
    max and min).

    Shape: (B, T) each -> {name: () float64}.
    """
    on, log_ratio = _working(old_logprobs, rollout_logprobs, response_mask)
    if correction is None:
        correction = Correction(torch.ones_like(log_ratio), torch.zeros_like(on), torch.zeros_like(on),
                                torch.zeros_like(on[:, 0]))
    log_ratio = log_ratio.double().clamp(-METRIC_LOG_RATIO_CLAMP, METRIC_LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    lengths = on.sum(-1)
    rows = lengths > 0
    geometric = torch.exp(log_ratio.sum(-1) / lengths.clamp(min=1))  # [B]
    kept = on & ~correction.dropped

    def total(x, mask):
        return torch.where(mask, x, 0.0).sum()

    def extreme(x, mask, largest):
        values = torch.where(mask, x, -math.inf if largest else math.inf)
        return values.max() if largest else values.min()

    def count(mask):
        return mask.sum().double()

    return {
        "tokens": count(on),
        "sequences": count(rows),
        "kept_tokens": count(kept),
        "dropped_tokens": count(on & correction.dropped),
        "truncated_tokens": count(on & correction.truncated),
        "rejected_sequences": count(rows & correction.rejected),
        "kl_k1_sum": total(-log_ratio, on),
        "kl_k3_sum": total(torch.expm1(log_ratio) - log_ratio, on),
        "ratio_sum": total(ratio, on),
        "ratio_max": extreme(ratio, on, True),
        "ratio_min": extreme(ratio, on, False),
        "seq_ratio_sum": total(geometric, rows),
        "seq_ratio_max": extreme(geometric, rows, True),
        "seq_ratio_min": extreme(geometric, rows, False),
        "weight_sum": total(correction.weights.double(), kept),
    }


def mismatch_metrics(totals: Mapping[str, float]) -> dict[str, float]:
    """The logged mismatch metrics from (rank-reduced) :func:`mismatch_statistics` totals.

    With ``rho = pi_old / pi_rollout`` on the tokens the rollout sampled
    (so expectations are under ``pi_rollout``)::

        kl                 mean(rho - 1 - log rho)   k3 estimate of KL(pi_rollout || pi_old), >= 0
        kl_k1              mean(-log rho)            unbiased k1 estimate of the same KL
        ratio_mean/min/max of rho over tokens
        seq_ratio_mean/min/max of exp(mean_t log rho) over responses (geometric mean)
        weight_mean        mean importance weight over the kept tokens
        truncated_frac     tokens whose ratio exceeded the TIS cap / tokens
        dropped_frac       tokens removed by MIS or rejection / tokens
        rejected_frac      responses removed by rejection / responses

    Log-ratios are clamped to +-20 first. With no token to measure, means
    and fractions are 0 and ratio statistics 1 (nothing measured, nothing
    corrected).
    """
    tokens, seqs = float(totals["tokens"]), float(totals["sequences"])

    def mean(name, count, empty=0.0):
        return float(totals[name]) / count if count else empty

    def bound(name):
        return float(totals[name]) if tokens else 1.0

    kept = float(totals["kept_tokens"])
    return {
        "kl": mean("kl_k3_sum", tokens),
        "kl_k1": mean("kl_k1_sum", tokens),
        "ratio_mean": mean("ratio_sum", tokens, 1.0),
        "ratio_min": bound("ratio_min"),
        "ratio_max": bound("ratio_max"),
        "seq_ratio_mean": mean("seq_ratio_sum", seqs, 1.0),
        "seq_ratio_min": bound("seq_ratio_min"),
        "seq_ratio_max": bound("seq_ratio_max"),
        "weight_mean": float(totals["weight_sum"]) / kept if kept else 1.0,
        "truncated_frac": mean("truncated_tokens", tokens),
        "dropped_frac": mean("dropped_tokens", tokens),
        "rejected_frac": mean("rejected_sequences", seqs),
    }


def weighted_loss_agg(loss_agg: Callable, weights: torch.Tensor) -> Callable:
    """``loss_agg`` aggregating ``weights * loss_mat`` instead of ``loss_mat``.

    What a policy loss hands its ``loss_agg`` is its per-token loss matrix, so
    this weighs every token's policy-loss term by its (detached) importance
    weight, whichever loss and aggregation are configured: the one way the
    corrections of this module reach a loss.
    """
    weights = weights.detach()

    def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if loss_mat.shape != weights.shape:
            raise ValueError(
                f"rollout correction weighs the per-token loss matrix a policy loss passes to loss_agg, but got "
                f"loss_mat {tuple(loss_mat.shape)} for weights {tuple(weights.shape)}; a policy loss must call "
                f"loss_agg(loss_mat [B, T], response_mask) (see rltk.algorithms.policy_losses)"
            )
        return loss_agg(loss_mat * weights.to(loss_mat.dtype), mask)

    return aggregate
