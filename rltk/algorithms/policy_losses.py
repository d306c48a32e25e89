"""Policy-gradient losses.

A ``policy_loss`` is called as::

    loss, metrics = fn(logprobs=..., old_logprobs=..., advantages=..., response_mask=...,
                       loss_agg=..., **configured_args)

``logprobs`` ``[B, T]`` are the current policy's log-probs of the sampled
tokens (with gradient), ``old_logprobs`` those of the policy that sampled them
(the behaviour policy), ``advantages`` ``[B, T]`` come from an advantage
estimator, ``response_mask`` is 1 on policy tokens. ``loss_agg`` is a callable
``(loss_mat, mask) -> scalar`` the caller has already bound to the configured
aggregation and the global token / sequence counts, e.g.
``functools.partial(rltk.get_component("loss_agg", "token-mean"), global_tokens=n)``.

Every loss returns a scalar and a dict of detached 0-dim tensors computed
under ``no_grad`` (convert with ``float()`` when logging), all local masked
means over the policy tokens of the call:

==================  =============================================================
``approx_kl``       ``k3`` of the behaviour vs the current policy:
                    ``mean((ratio - 1) - log ratio)``, >= 0, an estimate of
                    ``KL(pi_old || pi)``
``ratio_mean``      mean importance ratio (1 when on-policy)
``clip_frac``       fraction of tokens whose ratio was clipped (no gradient in
                    ppo_clip / gspo; a capped weight in cispo / reinforce)
``clip_frac_low``   ... at the lower bound (ppo_clip, gspo: only ``A < 0`` counts; cispo)
``clip_frac_high``  ... at the upper bound (ppo_clip, gspo: only ``A > 0`` counts; cispo)
``dual_clip_frac``  ppo_clip only: fraction bounded by the dual clip
``seq_ratio_mean``  gspo only: mean sequence ratio over non-empty responses
==================  =============================================================

The log-ratio is clamped to ``[-log_ratio_clamp, log_ratio_clamp]`` (20 by
default) before ``exp`` so a stale or diverged token cannot overflow; any such
token is far outside every clip range anyway.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

import rltk
from rltk.algorithms.aggregation import masked_mean

__all__ = ["ppo_clip", "gspo", "cispo", "reinforce"]

LossAgg = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# --------------------------------------------------------------------------
# Shared checks and metrics
# --------------------------------------------------------------------------


def _check_inputs(
    where: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg: object,
) -> None:
    shapes = {
        "logprobs": tuple(logprobs.shape),
        "old_logprobs": tuple(old_logprobs.shape),
        "advantages": tuple(advantages.shape),
        "response_mask": tuple(response_mask.shape),
    }
    if len(set(shapes.values())) != 1 or logprobs.dim() != 2:
        listed = ", ".join(f"{k} {v}" for k, v in shapes.items())
        raise ValueError(f"policy_loss '{where}': every input must be the same [B, T]; got {listed}")
    if not callable(loss_agg):
        raise TypeError(
            f"policy_loss '{where}': loss_agg must be a callable (loss_mat, mask) -> scalar, got "
            f"{type(loss_agg).__name__} {loss_agg!r}. Bind the aggregation first, e.g. "
            f"functools.partial(rltk.get_component('loss_agg', 'token-mean'), global_tokens=n)"
        )


def _check_eps(
    where: str, name: str, value: float | None, allow_none: bool = False, below_one: bool = False
) -> None:
    if value is None:
        if allow_none:
            return
        raise ValueError(f"policy_loss '{where}': {name} must be a number, got None")
    valid = math.isfinite(float(value)) and value >= 0 and (value < 1 or not below_one)
    if not valid:
        bound = "in [0, 1)" if below_one else ">= 0"
        raise ValueError(f"policy_loss '{where}': {name} must be {bound}, got {value!r}")


def _policy_tokens_only(
    response_mask: torch.Tensor, *tensors: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The mask as bool, then each tensor with 0 off the mask, at least float32.

    Log-probs of padding can be -inf or NaN; multiplying them by a zero mask
    would still send NaN gradients into the model, ``where`` sends exact zeros.
    Half-precision log-probs are upcast: a bf16 ratio is only good to ~0.4%,
    the size of the clip decisions being made.
    """
    on = response_mask > 0

    def upcast(t: torch.Tensor) -> torch.Tensor:
        return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t

    return (on, *(torch.where(on, upcast(t), 0.0) for t in tensors))


def _clamped_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, limit: float) -> torch.Tensor:
    return (logprobs - old_logprobs.detach()).clamp(-limit, limit)


@torch.no_grad()
def _ratio_metrics(log_ratio: torch.Tensor, on: torch.Tensor) -> dict[str, torch.Tensor]:
    """approx_kl (k3 of old vs new) and the mean ratio over the masked tokens."""
    log_ratio = log_ratio.detach()
    ratio = torch.exp(log_ratio)
    return {
        "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, on),
        "ratio_mean": masked_mean(ratio, on),
    }


def _fraction(condition: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    return masked_mean(condition.to(torch.float32), on).detach()


# --------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------


def ppo_clip(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg: LossAgg,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate, with asymmetric (clip-higher) and dual clipping.

    With ``rho = exp(logprobs - old_logprobs)`` per token::

        l   = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))
        l   = min(l, -c A)          where A < 0, when dual_clip_c = c is given
        loss = loss_agg(l, response_mask)

    A token whose ratio left the trust region in the direction its advantage
    pushes (``rho > 1 + eps_high`` with ``A > 0``, ``rho < 1 - eps_low`` with
    ``A < 0``) has zero gradient. ``clip_eps_high=None`` means ``eps_low``;
    a larger ``eps_high`` (DAPO uses 0.28 with 0.2) lets unlikely tokens grow,
    against entropy collapse. The dual clip bounds the loss of a
    negative-advantage token at ``c |A|`` (zero gradient beyond ``rho > c``),
    so a stale token with a huge ratio cannot dominate; ``c`` must be > 1
    (Ye et al. use 3).

    Papers: Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
    arXiv:1707.06347; Ye et al. 2020, "Mastering Complex Control in MOBA Games
    with Deep Reinforcement Learning", arXiv:1912.09729 (dual clip); Yu et al.
    2025, "DAPO", arXiv:2503.14476 (clip-higher).

    Shape: (B, T) each -> loss (), metrics {name: ()}.
    """
    _check_inputs("ppo_clip", logprobs, old_logprobs, advantages, response_mask, loss_agg)
    eps_low = clip_eps_low
    eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    _check_eps("ppo_clip", "clip_eps_low", eps_low, below_one=True)
    _check_eps("ppo_clip", "clip_eps_high", eps_high)
    if dual_clip_c is not None and not (math.isfinite(float(dual_clip_c)) and dual_clip_c > 1):
        raise ValueError(
            f"policy_loss 'ppo_clip': dual_clip_c must be > 1 (it caps a negative-advantage "
            f"token's loss at c*|A|, above the clipped surrogate; Ye et al. 2020 use 3), got "
            f"{dual_clip_c!r}. Use None to turn dual clipping off."
        )
    on, logprobs, old_logprobs, advantages = _policy_tokens_only(
        response_mask, logprobs, old_logprobs.detach(), advantages.detach()
    )
    log_ratio = _clamped_log_ratio(logprobs, old_logprobs, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss_mat = torch.maximum(unclipped, clipped)
    negative = advantages < 0
    if dual_clip_c is not None:
        loss_mat = torch.where(negative, torch.minimum(loss_mat, -dual_clip_c * advantages), loss_mat)

    with torch.no_grad():
        metrics = _ratio_metrics(log_ratio, on)
        low = negative & (ratio < 1.0 - eps_low)
        high = (advantages > 0) & (ratio > 1.0 + eps_high)
        metrics["clip_frac"] = _fraction(low | high, on)
        metrics["clip_frac_low"] = _fraction(low, on)
        metrics["clip_frac_high"] = _fraction(high, on)
        if dual_clip_c is not None:
            metrics["dual_clip_frac"] = _fraction(negative & (ratio > dual_clip_c), on)
    return loss_agg(loss_mat, response_mask), metrics


def gspo(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg: LossAgg,
    clip_eps_low: float = 3e-4,
    clip_eps_high: float = 4e-4,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: PPO-style clipping of a sequence-level, length-normalised ratio.

    For response ``i`` with ``|y_i|`` policy tokens::

        s_i    = exp( (1/|y_i|) sum_t (logprobs_it - old_logprobs_it) )     (geometric mean ratio)
        s_it   = sg[s_i] * exp(logprobs_it - sg[logprobs_it])               (GSPO-token form)
        l_it   = max(-A_it s_it, -A_it clip(s_it, 1 - eps_low, 1 + eps_high))
        loss   = loss_agg(l, response_mask)

    ``s_it`` has the value ``s_i`` and the gradient ``s_i * grad logprobs_it``,
    so with one advantage per response it is exactly the sequence-level GSPO
    objective, and per-token advantages also work. A whole response is clipped
    or not. The default clip range is the paper's (3e-4 below, 4e-4 above): a
    sequence ratio is a geometric mean and moves far less than token ratios.
    The paper averages tokens within a response, then over responses: bind
    ``loss_agg`` to ``seq-mean-token-mean`` to match it.

    Paper: Zheng et al. 2025, "Group Sequence Policy Optimization",
    arXiv:2507.18071.

    Shape: (B, T) each -> loss (), metrics {name: ()}.
    """
    _check_inputs("gspo", logprobs, old_logprobs, advantages, response_mask, loss_agg)
    _check_eps("gspo", "clip_eps_low", clip_eps_low, below_one=True)
    _check_eps("gspo", "clip_eps_high", clip_eps_high)
    on, logprobs, old_logprobs, advantages = _policy_tokens_only(
        response_mask, logprobs, old_logprobs.detach(), advantages.detach()
    )
    token_log_ratio = logprobs - old_logprobs
    lengths = on.sum(-1, keepdim=True).clamp(min=1)
    sequence_log_ratio = (token_log_ratio.sum(-1, keepdim=True) / lengths).detach()  # [B, 1]
    sequence_log_ratio = sequence_log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(sequence_log_ratio + logprobs - logprobs.detach())  # [B, T], value s_i
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss_mat = torch.maximum(unclipped, clipped)

    with torch.no_grad():
        metrics = _ratio_metrics(_clamped_log_ratio(logprobs, old_logprobs, log_ratio_clamp), on)
        metrics["seq_ratio_mean"] = masked_mean(
            torch.exp(sequence_log_ratio.squeeze(-1)), on.any(-1)
        ).detach()
        low = (advantages < 0) & (ratio < 1.0 - clip_eps_low)
        high = (advantages > 0) & (ratio > 1.0 + clip_eps_high)
        metrics["clip_frac"] = _fraction(low | high, on)
        metrics["clip_frac_low"] = _fraction(low, on)
        metrics["clip_frac_high"] = _fraction(high, on)
    return loss_agg(loss_mat, response_mask), metrics


def cispo(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg: LossAgg,
    clip_eps_low: float | None = None,
    clip_eps_high: float = 0.28,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: clip the importance weight, not the update, and keep every token's gradient.

    ::

        w_it = sg[ clip(rho_it, 1 - eps_low, 1 + eps_high) ]     rho = exp(logprobs - old_logprobs)
        l_it = -w_it * A_it * logprobs_it
        loss = loss_agg(l, response_mask)

    The gradient is ``-w A grad logprobs`` on every token, so the rare,
    low-probability "fork" tokens that PPO's clip silences after one update
    keep contributing, with a bounded weight. ``clip_eps_low=None`` imposes no
    lower bound, as the paper does; it tunes only ``eps_high`` and does not
    publish the value, so the default 0.28 (DAPO's clip-higher bound) is a
    starting point, not the paper's number. The loss value itself is not a
    surrogate of the return (it contains ``logprobs``); track the metrics.

    Paper: MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently
    with Lightning Attention", arXiv:2506.13585, section 3.1.

    Shape: (B, T) each -> loss (), metrics {name: ()}.
    """
    _check_inputs("cispo", logprobs, old_logprobs, advantages, response_mask, loss_agg)
    _check_eps("cispo", "clip_eps_low", clip_eps_low, allow_none=True, below_one=True)
    _check_eps("cispo", "clip_eps_high", clip_eps_high)
    on, logprobs, old_logprobs, advantages = _policy_tokens_only(
        response_mask, logprobs, old_logprobs.detach(), advantages.detach()
    )
    log_ratio = _clamped_log_ratio(logprobs, old_logprobs, log_ratio_clamp)
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        lower = None if clip_eps_low is None else 1.0 - clip_eps_low
        weight = ratio.clamp(min=lower, max=1.0 + clip_eps_high)
    loss_mat = -weight * advantages * logprobs

    with torch.no_grad():
        metrics = _ratio_metrics(log_ratio, on)
        high = ratio > 1.0 + clip_eps_high
        low = ratio < lower if lower is not None else torch.zeros_like(high)
        metrics["clip_frac"] = _fraction(low | high, on)
        metrics["clip_frac_low"] = _fraction(low, on)
        metrics["clip_frac_high"] = _fraction(high, on)
    return loss_agg(loss_mat, response_mask), metrics


def reinforce(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg: LossAgg,
    importance_weight: bool = False,
    max_importance_weight: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Vanilla policy gradient (REINFORCE), optionally importance-weighted.

    ::

        l_it = -A_it * logprobs_it                                   importance_weight=False
        l_it = -sg[min(rho_it, max_importance_weight)] * A_it * logprobs_it   importance_weight=True

    with ``rho = exp(logprobs - old_logprobs)``. The weight corrects for data
    sampled by an older policy (several updates per batch, or an inference
    engine whose numerics differ from the trainer's); truncating it (Espeholt
    et al. 2018) trades a little bias for bounded variance.
    ``max_importance_weight=None`` does not truncate.

    Papers: Williams 1992, "Simple Statistical Gradient-Following Algorithms
    for Connectionist Reinforcement Learning", Machine Learning 8; Espeholt et
    al. 2018, "IMPALA", arXiv:1802.01561 (truncated importance weights).

    Shape: (B, T) each -> loss (), metrics {name: ()}.
    """
    _check_inputs("reinforce", logprobs, old_logprobs, advantages, response_mask, loss_agg)
    if max_importance_weight is not None:
        if not importance_weight:
            raise ValueError(
                "policy_loss 'reinforce': max_importance_weight truncates the importance weight, "
                "which is only used with importance_weight=True; set importance_weight=True or "
                f"drop max_importance_weight (got {max_importance_weight!r})"
            )
        if not (math.isfinite(float(max_importance_weight)) and max_importance_weight > 0):
            raise ValueError(
                f"policy_loss 'reinforce': max_importance_weight must be > 0 (e.g. 2.0), got "
                f"{max_importance_weight!r}"
            )
    on, logprobs, old_logprobs, advantages = _policy_tokens_only(
        response_mask, logprobs, old_logprobs.detach(), advantages.detach()
    )
    log_ratio = _clamped_log_ratio(logprobs, old_logprobs, log_ratio_clamp)
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        truncated = (
            ratio > max_importance_weight if max_importance_weight is not None else torch.zeros_like(on)
        )
    if importance_weight:
        weight = ratio if max_importance_weight is None else ratio.clamp(max=max_importance_weight)
        loss_mat = -weight * advantages * logprobs
    else:
        loss_mat = -advantages * logprobs

    with torch.no_grad():
        metrics = _ratio_metrics(log_ratio, on)
        metrics["clip_frac"] = _fraction(truncated, on)
    return loss_agg(loss_mat, response_mask), metrics


@rltk.hookimpl
def rltk_policy_losses():
    """Register the builtin policy losses."""
    return {
        "ppo_clip": ppo_clip,
        "gspo": gspo,
        "cispo": cispo,
        "reinforce": reinforce,
    }
