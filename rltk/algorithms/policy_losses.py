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
                    ppo_clip / gspo / geo_mean / dppo_*, plus the covariance-chosen
                    tokens of clip_cov; a capped weight in cispo / reinforce; the
                    penalised tokens of kl_cov; 0 for sapo, gpg, dro)
``clip_frac_low``   ... at the lower bound (only ``A < 0`` counts, except in cispo)
``clip_frac_high``  ... at the upper bound (only ``A > 0`` counts, except in cispo)
``dual_clip_frac``  ppo_clip only: fraction bounded by the dual clip (or by ``clip_delta``)
``seq_ratio_mean``  gspo, geo_mean: mean sequence ratio over non-empty responses
``soft_gate_mean``  sapo: mean gradient weight of the soft gate (1 on-policy)
``cov_clip_frac``   clip_cov: fraction chosen by the covariance rule
``truncated_frac``  dppo_*: kept tokens whose importance weight was truncated
``behaviour_*``     decoupled_ppo / decoupled_loss: the behaviour-policy weight
                    ``pi_prox / pi_behav`` (``_weight_mean`` over kept tokens,
                    ``_kl`` its k3, ``_dropped_frac``, ``_truncated_frac``)
==================  =============================================================

A loss may also take ``behaviour_logprobs`` ``[B, T]`` (the log-probs the
rollout engine sampled with, per token): the decoupled objective
(:func:`decoupled_loss`) does; the caller fills it in, never a config.

The log-ratio is clamped to ``[-log_ratio_clamp, log_ratio_clamp]`` (20 by
default) before ``exp`` so a stale or diverged token cannot overflow; any such
token is far outside every clip range anyway.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, NamedTuple

import torch

import rltk
from rltk.algorithms.aggregation import masked_mean
from rltk.algorithms.mismatch import (
    METRIC_LOG_RATIO_CLAMP, check_rollout_correction, rollout_correction, weighted_loss_agg,
)

__all__ = [
    "ppo_clip", "gspo", "cispo", "reinforce",
    "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dppo_tv", "dppo_kl", "dro", "opmd",
    "decoupled_loss", "decoupled_ppo",
]

LossAgg = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: The builtin losses by config name, filled by ``@register_policy_loss(name)`` on each definition and
#: returned by this module's ``rltk_policy_losses`` hook (the entry point ``policy_losses``).
POLICY_LOSSES = rltk.ComponentTable("policy_loss")
register_policy_loss = POLICY_LOSSES.register


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


class _PolicyTokens(NamedTuple):
    on: torch.Tensor  # bool [B, T]: the policy's tokens
    logprobs: torch.Tensor  # [B, T], 0 off the mask, at least float32
    old_logprobs: torch.Tensor  # detached, likewise
    advantages: torch.Tensor  # detached, likewise
    log_ratio: torch.Tensor  # log(pi / pi_old), clamped to +-log_ratio_clamp


def _policy_tokens(where: str, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                   response_mask: torch.Tensor, loss_agg: object, log_ratio_clamp: float) -> _PolicyTokens:
    """The preamble every policy loss shares: check the ``[B, T]`` inputs and ``loss_agg``, keep the
    policy's tokens only (:func:`_policy_tokens_only`), detach the old log-probs and advantages, and
    take the clamped log-ratio (losses that do not use it in the loss still log its metrics)."""
    _check_inputs(where, logprobs, old_logprobs, advantages, response_mask, loss_agg)
    on, logprobs, old_logprobs, advantages = _policy_tokens_only(
        response_mask, logprobs, old_logprobs.detach(), advantages.detach()
    )
    return _PolicyTokens(on, logprobs, old_logprobs, advantages, _clamped_log_ratio(logprobs, old_logprobs,
                                                                                   log_ratio_clamp))


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


def _clip_fractions(on: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
                    also: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``clip_frac`` (tokens clipped at either bound, or marked in ``also``), ``clip_frac_low`` and
    ``clip_frac_high``, over the policy tokens ``on``."""
    clipped = low | high if also is None else low | high | also
    return {"clip_frac": _fraction(clipped, on), "clip_frac_low": _fraction(low, on),
            "clip_frac_high": _fraction(high, on)}


def _clip_range(where: str, clip_eps_low: float, clip_eps_high: float | None, *,
                below_one: bool) -> tuple[float, float]:
    """``(eps_low, eps_high)`` of a two-sided clip, ``clip_eps_high=None`` meaning ``clip_eps_low``; both
    checked (``eps_low < 1`` too where ``below_one``: a ratio bound ``1 - eps_low`` must stay positive)."""
    eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    _check_eps(where, "clip_eps_low", clip_eps_low, below_one=below_one)
    _check_eps(where, "clip_eps_high", eps_high)
    return clip_eps_low, eps_high


def _ppo_terms(advantages: torch.Tensor, ratio: torch.Tensor, eps_low: float, eps_high: float,
               unclipped_ratio: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's two surrogate terms per token, ``(-A rho', -A clip(rho, 1 - eps_low, 1 + eps_high))``; the loss
    is their maximum. ``rho' = rho`` unless ``unclipped_ratio`` is given (two-sided clipping bounds it)."""
    unclipped = -advantages * (ratio if unclipped_ratio is None else unclipped_ratio)
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return unclipped, clipped


@torch.no_grad()
def _ppo_clip_fractions(on: torch.Tensor, advantages: torch.Tensor, ratio: torch.Tensor, eps_low: float,
                        eps_high: float, also: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """:func:`_clip_fractions` of PPO's clip: the tokens whose gradient it removed, ``rho < 1 - eps_low``
    with ``A < 0`` and ``rho > 1 + eps_high`` with ``A > 0``."""
    low = (advantages < 0) & (ratio < 1.0 - eps_low)
    high = (advantages > 0) & (ratio > 1.0 + eps_high)
    return _clip_fractions(on, low, high, also)


def _zero_fraction(on: torch.Tensor) -> torch.Tensor:
    """A fraction metric that is 0 by construction (``clip_frac`` of a loss without a clip)."""
    return torch.zeros((), device=on.device)


def _loss_and_metrics(loss_agg: LossAgg, loss_mat: torch.Tensor, response_mask: torch.Tensor, on: torch.Tensor,
                      log_ratio: torch.Tensor, metrics: Mapping[str, torch.Tensor]
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """What every loss returns: ``loss_agg(loss_mat, response_mask)`` and the metrics, :func:`_ratio_metrics`
    first, then the loss's own (computed by the caller, detached)."""
    return loss_agg(loss_mat, response_mask), {**_ratio_metrics(log_ratio, on), **metrics}


# --------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------


@register_policy_loss("ppo_clip")
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
    clip_delta: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate, with asymmetric (clip-higher), dual and two-sided clipping.

    With ``rho = exp(logprobs - old_logprobs)`` per token::

        l   = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))
        l   = min(l, -c A)          where A < 0, when dual_clip_c = c is given
        loss = loss_agg(l, response_mask)

    Two-sided clipping (``clip_delta = delta``) replaces ``rho`` by
    ``min(rho, delta)`` in the unclipped term, ``l = max(-A min(rho, delta),
    -A clip(rho, ...))``, so a negative-advantage token's ratio is bounded on
    both sides: its loss stops growing, and its gradient is 0, beyond
    ``rho > delta``. ``delta`` must exceed ``1 + eps_high`` (positive-advantage
    tokens are then unaffected; INTELLECT-2 and TRL's ``delta`` recommend it);
    with that, it gives the same loss and gradient as ``dual_clip_c = delta``,
    and only one of the two may be set.

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
    2025, "DAPO", arXiv:2503.14476 (clip-higher); Prime Intellect 2025,
    "INTELLECT-2: A Reasoning Model Trained Through Globally Decentralized
    Reinforcement Learning", arXiv:2505.07291 (two-sided clipping).

    Shape: (B, T) each -> loss (), metrics {name: ()}.
    """
    on, logprobs, old_logprobs, advantages, log_ratio = _policy_tokens(
        "ppo_clip", logprobs, old_logprobs, advantages, response_mask, loss_agg, log_ratio_clamp)
    eps_low, eps_high = _clip_range("ppo_clip", clip_eps_low, clip_eps_high, below_one=True)
    if dual_clip_c is not None and not (math.isfinite(float(dual_clip_c)) and dual_clip_c > 1):
        raise ValueError(
            f"policy_loss 'ppo_clip': dual_clip_c must be > 1 (it caps a negative-advantage "
            f"token's loss at c*|A|, above the clipped surrogate; Ye et al. 2020 use 3), got "
            f"{dual_clip_c!r}. Use None to turn dual clipping off."
        )
    if clip_delta is not None:
        if dual_clip_c is not None:
            raise ValueError(
                f"policy_loss 'ppo_clip': set clip_delta (two-sided clipping) or dual_clip_c, not "
                f"both; with clip_delta > 1 + clip_eps_high they bound negative-advantage tokens "
                f"identically (got clip_delta={clip_delta!r}, dual_clip_c={dual_clip_c!r})"
            )
        if not (math.isfinite(float(clip_delta)) and clip_delta > 1.0 + eps_high):
            raise ValueError(
                f"policy_loss 'ppo_clip': clip_delta must be > 1 + clip_eps_high = {1.0 + eps_high!r} "
                f"(a smaller bound would also cap positive-advantage tokens inside the trust region; "
                f"INTELLECT-2 uses 4), got {clip_delta!r}. Use None to turn two-sided clipping off."
            )
    ratio = torch.exp(log_ratio)
    bounded = None if clip_delta is None else ratio.clamp(max=clip_delta)
    loss_mat = torch.maximum(*_ppo_terms(advantages, ratio, eps_low, eps_high, unclipped_ratio=bounded))
    negative = advantages < 0
    if dual_clip_c is not None:
        loss_mat = torch.where(negative, torch.minimum(loss_mat, -dual_clip_c * advantages), loss_mat)

    metrics = _ppo_clip_fractions(on, advantages, ratio, eps_low, eps_high)
    # clip_delta bounds the same tokens dual_clip_c would (only one of them is set)
    loss_bound = clip_delta if dual_clip_c is None else dual_clip_c
    if loss_bound is not None:
        metrics["dual_clip_frac"] = _fraction(negative & (ratio > loss_bound), on)
    return _loss_and_metrics(loss_agg, loss_mat, response_mask, on, log_ratio, metrics)


@register_policy_loss("gspo")
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
    on, logprobs, old_logprobs, advantages, log_ratio = _policy_tokens(
        "gspo", logprobs, old_logprobs, advantages, response_mask, loss_agg, log_ratio_clamp)
    _check_eps("gspo", "clip_eps_low", clip_eps_low, below_one=True)
    _check_eps("gspo", "clip_eps_high", clip_eps_high)
    token_log_ratio = logprobs - old_logprobs
    lengths = on.sum(-1, keepdim=True).clamp(min=1)
    sequence_log_ratio = (token_log_ratio.sum(-1, keepdim=True) / lengths).detach()  # [B, 1]
    sequence_log_ratio = sequence_log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(sequence_log_ratio + logprobs - logprobs.detach())  # [B, T], value s_i
    loss_mat = torch.maximum(*_ppo_terms(advantages, ratio, clip_eps_low, clip_eps_high))

    seq_ratio_mean = masked_mean(torch.exp(sequence_log_ratio.squeeze(-1)), on.any(-1)).detach()
    metrics = {"seq_ratio_mean": seq_ratio_mean,
               **_ppo_clip_fractions(on, advantages, ratio, clip_eps_low, clip_eps_high)}
    return _loss_and_metrics(loss_agg, loss_mat, response_mask, on, log_ratio, metrics)


@register_policy_loss("cispo")
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
    on, logprobs, old_logprobs, advantages, log_ratio = _policy_tokens(
        "cispo", logprobs, old_logprobs, advantages, response_mask, loss_agg, log_ratio_clamp)
    _check_eps("cispo", "clip_eps_low", clip_eps_low, allow_none=True, below_one=True)
    _check_eps("cispo", "clip_eps_high", clip_eps_high)
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        lower = None if clip_eps_low is None else 1.0 - clip_eps_low
        weight = ratio.clamp(min=lower, max=1.0 + clip_eps_high)
    loss_mat = -weight * advantages * logprobs

    high = ratio > 1.0 + clip_eps_high
    low = ratio < lower if lower is not None else torch.zeros_like(high)
    return _loss_and_metrics(loss_agg, loss_mat, response_mask, on, log_ratio, _clip_fractions(on, low, high))


@register_policy_loss("reinforce")
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
    on, logprobs, old_logprobs, advantages, log_ratio = _policy_tokens(
        "reinforce", logprobs, old_logprobs, advantages, response_mask, loss_agg, log_ratio_clamp)
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
    return _loss_and_metrics(loss_agg, loss_mat, response_mask, on, log_ratio,
                             {"clip_frac": _fraction(truncated, on)})


# --------------------------------------------------------------------------
# Losses peers ship (verl's names)
# --------------------------------------------------------------------------


def _check_fraction(where: str, name: str, value: float, example: str) -> None:
    if value is None or not (math.isfinite(float(value)) and 0 < value <= 1):
        raise ValueError(
            f"policy_loss '{where}': {name} must be a fraction of the tokens in (0, 1] ({example}), got {value!r}"
        )


def _check_positive(where: str, name: str, value: float, example: str) -> None:
    if value is None or not (math.isfinite(float(value)) and value > 0):
        raise ValueError(f"policy_loss '{where}': {name} must be a number > 0 ({example}), got {value!r}")


@register_policy_loss("sapo")
def sapo(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg: LossAgg,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO: a smooth sigmoid gate on the ratio instead of a hard clip, l = -(4/tau) sigmoid(tau (rho - 1)) A.

    ::

        f(rho; tau) = (4 / tau) * sigmoid(tau * (rho - 1))        rho = exp(logprobs - old_logprobs)
        l_it        = -f(rho_it; tau_it) * A_it                   tau_it = tau_pos if A_it > 0 else tau_neg
        loss        = loss_agg(l, response_mask)

    The gradient is ``-A * w * rho * grad logprobs`` with the soft weight
    ``w = f'(rho) = 4 sigmoid (1 - sigmoid)``: exactly the policy gradient at
    ``rho = 1`` (``w = 1``), decaying smoothly, never to a hard zero, as the
    ratio leaves the trust region; a larger ``tau`` decays faster. The
    negative side uses the larger temperature by default (the paper's 1.05
    vs 1.0), damping updates on negative-advantage tokens, which the paper
    finds less stable. A token with ``A = 0`` uses ``tau_neg`` (and has no
    loss).

    Deliberate difference from verl: verl's ``sapo`` always aggregates with
    seq-mean-token-mean, ignoring the configured mode; here the bound
    ``loss_agg`` is used like for every loss (the ``sapo`` preset chooses
    ``seq-mean-token-mean``, the paper's sequence-level average).

    Metrics: no token is clipped, so ``clip_frac`` is 0; ``soft_gate_mean``
    is the mean gradient weight ``w`` (1 on-policy, lower as ratios drift).

    Paper: "Soft Adaptive Policy Optimization" (SAPO), 2025, arXiv:2511.20347.

    Shape: (B, T) each -> loss (), metrics {name: ()}.
    """
    on, logprobs, old_logprobs, advantages, log_ratio = _policy_tokens(
        "sapo", logprobs, old_logprobs, advantages, response_mask, loss_agg, log_ratio_clamp)
    _check_positive("sapo", "tau_pos", tau_pos, "the paper uses 1.0")
    _check_positive("sapo", "tau_neg", tau_neg, "the paper uses 1.05")
    ratio = torch.exp(log_ratio)
    # full_like keeps the advantages' dtype; where() on two Python floats would give float32
    tau = torch.full_like(advantages, float(tau_neg)).masked_fill_(advantages > 0, float(tau_pos))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss_mat = -(4.0 / tau) * gate * advantages

    with torch.no_grad():
        soft_gate_mean = masked_mean(4.0 * gate * (1.0 - gate), on)
    return _loss_and_metrics(loss_agg, loss_mat, response_mask, on, log_ratio,
                             {"clip_frac": _zero_fraction(on), "soft_gate_mean": soft_gate_mean})


@register_policy_loss("gpg")
def gpg(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg: LossAgg,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG's loss: the plain policy gradient l = -A logprobs, no ratio, no clip, no KL.

    ::

        l_it = -A_it * logprobs_it
        loss = loss_agg(l, response_mask)

    GPG optimises the original objective directly; its corrections live in
    the advantage (the ``gpg`` advantage_fn: group baseline and the
    ``B / (B - M)`` rescaling for groups without signal). The loss equals
    ``reinforce`` without importance weighting; the name is verl's. Being
    on-policy by construction, it ignores ``old_logprobs`` except for the
    metrics (``clip_frac`` is 0).

    Paper: Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning
    Baseline for Model Reasoning", arXiv:2504.02546.

    Shape: (B, T) each -> loss (), metrics {name: ()}.
    """
    on, logprobs, old_logprobs, advantages, log_ratio = _policy_tokens(
        "gpg", logprobs, old_logprobs, advantages, response_mask, loss_agg, log_ratio_clamp)
    loss_mat = -advantages * logprobs
    return _loss_and_metrics(loss_agg, loss_mat, response_mask, on, log_ratio, {"clip_frac": _zero_fraction(on)})


def _centred_covariance(advantages: torch.Tensor, logprobs: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """Per-token ``(A - mean A) (logp - mean logp)``, means over the policy tokens of the call; detached."""
    a = advantages.detach()
    lp = logprobs.detach()
    return (a - masked_mean(a, on)) * (lp - masked_mean(lp, on))


@register_policy_loss("clip_cov")
def clip_cov(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg: LossAgg,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    seed: int | None = None,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov: PPO clip, with l = 0 on a random clip_cov_ratio of the tokens whose cov(A, logp) is in (lb, ub).

    With ``rho``, ``eps`` as in ``ppo_clip`` and ``n`` the policy tokens of the call::

        c_it = (A_it - mean(A)) * (logprobs_it - mean(logprobs))          (means over the n tokens)
        C    = tokens with clip_cov_lb < c < clip_cov_ub that PPO's clip left alone
        I    = max(1, floor(clip_cov_ratio * n)) tokens drawn uniformly from C (all of C if smaller)
        l_it = 0 for t in I, else max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))
        loss = loss_agg(l, response_mask)

    Tokens whose log-prob moves with their advantage (large positive
    covariance) drive the collapse of policy entropy; detaching a small random
    fraction of them (0.02% by default) keeps entropy from collapsing while
    the rest of the batch trains as PPO.

    The draw uses torch's global random generator (which the recipe seeds), or
    a private one seeded with ``seed`` for a reproducible choice; it is the
    only random component in rltk's losses. As in verl, the means and the
    count ``n`` are those of the call's tokens (a micro-batch), so the choice
    depends on the micro-batch split. Like verl, a chosen token contributes 0
    to the loss value as well as to the gradient.

    Metrics: ``clip_frac_low`` / ``clip_frac_high`` as ``ppo_clip``;
    ``cov_clip_frac`` the fraction chosen by the covariance rule (verl's
    ``pg_clipfrac``); ``clip_frac`` tokens without gradient for either reason.

    Paper: Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning
    for Reasoning Language Models", arXiv:2505.22617, section 4.

    Shape: (B, T) each -> loss (), metrics {name: ()}.
    """
    on, logprobs, old_logprobs, advantages, log_ratio = _policy_tokens(
        "clip_cov", logprobs, old_logprobs, advantages, response_mask, loss_agg, log_ratio_clamp)
    eps_low, eps_high = _clip_range("clip_cov", clip_eps_low, clip_eps_high, below_one=True)
    _check_fraction("clip_cov", "clip_cov_ratio", clip_cov_ratio, "the paper uses 2e-4")
    if not clip_cov_lb < clip_cov_ub:
        raise ValueError(
            f"policy_loss 'clip_cov': clip_cov_lb must be < clip_cov_ub (the covariance window tokens are "
            f"drawn from; the paper uses 1 and 5), got clip_cov_lb={clip_cov_lb!r}, clip_cov_ub={clip_cov_ub!r}"
        )
    ratio = torch.exp(log_ratio)
    unclipped, clipped = _ppo_terms(advantages, ratio, eps_low, eps_high)

    with torch.no_grad():
        ppo_clipped = on & (clipped > unclipped)
        covariance = _centred_covariance(advantages, logprobs, on)
        candidates = on & ~ppo_clipped & (covariance > clip_cov_lb) & (covariance < clip_cov_ub)
        n_pick = max(int(clip_cov_ratio * int(on.sum())), 1)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=logprobs.device).manual_seed(int(seed))
        # A uniform random subset of the candidates: the n_pick smallest of i.i.d. uniform keys.
        keys = torch.rand(candidates.shape, generator=generator, device=logprobs.device)
        keys = torch.where(candidates, keys, 2.0).reshape(-1)
        n_pick = min(n_pick, int(candidates.sum()))
        chosen = torch.zeros_like(keys, dtype=torch.bool)
        chosen[torch.topk(keys, n_pick, largest=False).indices] = True
        chosen = chosen.reshape(candidates.shape)
    loss_mat = torch.where(chosen, 0.0, torch.maximum(unclipped, clipped))

    metrics = _ppo_clip_fractions(on, advantages, ratio, eps_low, eps_high, also=chosen)
    metrics["cov_clip_frac"] = _fraction(chosen, on)
    return _loss_and_metrics(loss_agg, loss_mat, response_mask, on, log_ratio, metrics)


@register_policy_loss("kl_cov")
def kl_cov(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg: LossAgg,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 0.1,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov: l = -A rho, plus ppo_kl_coef |log rho| on the kl_cov_ratio of tokens with the largest cov(A, logp).

    With ``n`` the policy tokens of the call::

        c_it = (A_it - mean(A)) * (logprobs_it - mean(logprobs))      (means over the n tokens)
        I    = the k = max(1, floor(kl_cov_ratio * n)) tokens of largest c
        l_it = -A_it rho_it + ppo_kl_coef * |log rho_it|    for t in I
        l_it = -A_it rho_it                                 otherwise
        loss = loss_agg(l, response_mask)

    No ratio clipping at all: the penalty on the few tokens that drive
    entropy collapse is the only trust region. Ties in ``c`` are broken
    arbitrarily (as ``torch.topk`` does). As in verl, the means and ``n`` are
    the call's own (a micro-batch), and the defaults are verl's
    (``kl_cov_ratio`` 2e-4, ``ppo_kl_coef`` 0.1).

    Metrics: ``clip_frac`` is the fraction of tokens penalised.

    Paper: Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning
    for Reasoning Language Models", arXiv:2505.22617, section 4.

    Shape: (B, T) each -> loss (), metrics {name: ()}.
    """
    on, logprobs, old_logprobs, advantages, log_ratio = _policy_tokens(
        "kl_cov", logprobs, old_logprobs, advantages, response_mask, loss_agg, log_ratio_clamp)
    _check_fraction("kl_cov", "kl_cov_ratio", kl_cov_ratio, "the paper uses 2e-4 to 2e-3")
    _check_eps("kl_cov", "ppo_kl_coef", ppo_kl_coef)
    ratio = torch.exp(log_ratio)

    with torch.no_grad():
        n_tokens = int(on.sum())
        chosen = torch.zeros(on.numel(), dtype=torch.bool, device=on.device)
        if n_tokens:
            k = max(int(kl_cov_ratio * n_tokens), 1)
            covariance = torch.where(on, _centred_covariance(advantages, logprobs, on), -math.inf)
            chosen[torch.topk(covariance.reshape(-1), k).indices] = True
        chosen = chosen.reshape(on.shape)
    loss_mat = -advantages * ratio + torch.where(chosen, ppo_kl_coef * log_ratio.abs(), 0.0)
    return _loss_and_metrics(loss_agg, loss_mat, response_mask, on, log_ratio, {"clip_frac": _fraction(chosen, on)})


@register_policy_loss("geo_mean")
def geo_mean(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg: LossAgg,
    clip_eps_low: float = 0.4,
    clip_eps_high: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO: l_i = -mean_t(A) exp(mean_t clip(log rho)), a response's clipped geometric-mean ratio times its advantage.

    With ``d_it = logprobs_it - old_logprobs_it`` and ``sgn = sign(A_it)``::

        d'_it = sgn * min(sgn * d_it, sgn * clip(d_it, -eps_low, eps_high))     (pessimistic, per token)
        s_i   = exp( (1/|y_i|) sum_t d'_it )                                    (geometric mean ratio)
        A_i   = (1/|y_i|) sum_t A_it
        l_i   = -A_i * s_i            on every policy token of response i
        loss  = loss_agg(l, response_mask)

    A geometric mean is far less sensitive to one outlier token ratio than
    GRPO's arithmetic mean, so the clip range can be wider: the defaults are
    the paper's ``(e^-0.4, e^0.4)`` (``eps`` are bounds on the log-ratio, not
    on the ratio). The gradient of response ``i`` is
    ``-A_i s_i / |y_i| * grad logprobs_it`` on each token whose log-ratio was
    not clipped. A token with ``A = 0`` contributes ``d' = 0``.

    The paper averages over responses: bind ``loss_agg`` to
    ``seq-mean-token-mean`` (the ``gmpo`` preset does) and the loss is exactly
    ``(1/G) sum_i l_i``. Deliberate differences from verl's ``geo_mean``:
    verl ignores the aggregation and takes ``mean_i l_i`` over the rows of the
    micro-batch, empty rows included, which under gradient accumulation
    weighs micro-batches unequally; and verl counts a token as clipped when
    its log-ratio lies outside the range even when the pessimistic ``min``
    kept the unclipped value, while ``clip_frac_low`` / ``clip_frac_high``
    here count only tokens whose gradient the clip removed (``A < 0`` below,
    ``A > 0`` above), like ``ppo_clip``.

    Paper: Zhao et al. 2025, "Geometric-Mean Policy Optimization",
    arXiv:2507.20673.

    Shape: (B, T) each -> loss (), metrics {name: ()}.
    """
    on, logprobs, old_logprobs, advantages, clamped_log_ratio = _policy_tokens(
        "geo_mean", logprobs, old_logprobs, advantages, response_mask, loss_agg, log_ratio_clamp)
    eps_low, eps_high = _clip_range("geo_mean", clip_eps_low, clip_eps_high, below_one=False)
    log_ratio = logprobs - old_logprobs
    bounded = log_ratio.clamp(-eps_low, eps_high)
    positive, negative = advantages > 0, advantages < 0
    pessimistic = torch.where(
        positive, torch.minimum(log_ratio, bounded), torch.where(negative, torch.maximum(log_ratio, bounded), 0.0)
    )
    lengths = on.sum(-1).clamp(min=1)
    sequence_log_ratio = (pessimistic.sum(-1) / lengths).clamp(-log_ratio_clamp, log_ratio_clamp)  # [B]
    sequence_advantage = advantages.sum(-1) / lengths  # [B]
    per_sequence = -sequence_advantage * torch.exp(sequence_log_ratio)
    loss_mat = torch.where(on, per_sequence[:, None], 0.0)  # [B, T]

    with torch.no_grad():
        metrics = {"seq_ratio_mean": masked_mean(torch.exp(sequence_log_ratio), on.any(-1)),
                   **_clip_fractions(on, negative & (log_ratio < -eps_low), positive & (log_ratio > eps_high))}
    # the metrics' log-ratio is the clamped one, as in every loss (the local log_ratio is not clamped)
    return _loss_and_metrics(loss_agg, loss_mat, response_mask, on, clamped_log_ratio, metrics)


def _dppo(
    where: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg: LossAgg,
    clip_eps_low: float,
    clip_eps_high: float | None,
    max_importance_weight: float | None,
    log_ratio_clamp: float,
    binary_kl: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The shared body of dppo_tv and dppo_kl: only the divergence test differs."""
    on, logprobs, old_logprobs, advantages, log_ratio = _policy_tokens(
        where, logprobs, old_logprobs, advantages, response_mask, loss_agg, log_ratio_clamp)
    delta_low, delta_high = _clip_range(where, clip_eps_low, clip_eps_high, below_one=False)
    if max_importance_weight is not None:
        _check_positive(where, "max_importance_weight", max_importance_weight, "the paper uses a large one, e.g. 20")
    positive = advantages > 0
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        weight = ratio if max_importance_weight is None else ratio.clamp(max=max_importance_weight)
        p, p_old = torch.exp(logprobs), torch.exp(old_logprobs)
        if binary_kl:
            # KL(Bernoulli(p_old) || Bernoulli(p)) of "this token or not"; expm1 keeps 1 - p exact
            # near p = 1, and a zero (1 - p_old) term is 0, not 0 * inf.
            q, q_old = -torch.expm1(logprobs), -torch.expm1(old_logprobs)
            rest = torch.where(q_old > 0, q_old * (torch.log(q_old) - torch.log(q)), 0.0)
            divergence = p_old * (old_logprobs - logprobs) + rest
            keep_up = (divergence <= delta_high) | (p <= p_old)
            keep_down = (divergence <= delta_low) | (p >= p_old)
        else:
            keep_up = p - p_old <= delta_high
            keep_down = p - p_old >= -delta_low
        keep = torch.where(positive, keep_up, keep_down)
    loss_mat = torch.where(keep, -advantages * weight * logprobs, 0.0)

    metrics = _clip_fractions(on, (advantages < 0) & ~keep, positive & ~keep)
    metrics["truncated_frac"] = _fraction(keep & (ratio > max_importance_weight), on) if (
        max_importance_weight is not None) else _zero_fraction(on)
    return _loss_and_metrics(loss_agg, loss_mat, response_mask, on, log_ratio, metrics)


@register_policy_loss("dppo_tv")
def dppo_tv(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg: LossAgg,
    clip_eps_low: float = 0.15,
    clip_eps_high: float | None = None,
    max_importance_weight: float | None = 20.0,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV: l = -sg[min(rho, C)] A logp, 0 where p - p_old left (-delta, delta) in A's direction.

    With ``p = exp(logprobs)``, ``p_old = exp(old_logprobs)``, ``rho = p / p_old``::

        keep_it = (p - p_old <= delta_high)   if A_it > 0
                  (p - p_old >= -delta_low)   otherwise
        w_it    = sg[ min(rho_it, max_importance_weight) ]
        l_it    = -keep_it * w_it * A_it * logprobs_it
        loss    = loss_agg(l, response_mask)

    ``delta`` are ``clip_eps_low`` / ``clip_eps_high`` (``None``: the same
    as low), bounds on ``|p - p_old|``, the total-variation distance of the
    binary "this token or not" distribution. A ratio bound over-restricts
    rare tokens (a 1e-4 probability doubling is a tiny move) and
    under-restricts likely ones; a probability bound does neither. Tokens
    that left the region in the direction of their advantage get no
    gradient; the others get the truncated-importance-weighted policy
    gradient (``max_importance_weight=None``: no truncation). Defaults are the
    paper's (delta 0.15; truncation 20). verl reads the truncation from
    ``clip_ratio_c``, whose config default 3.0 overrides the 20 in its code.

    Metrics: ``clip_frac_low`` / ``clip_frac_high`` the tokens masked with
    ``A < 0`` / ``A > 0`` (tokens with ``A = 0`` have no gradient either way
    and are not counted, unlike verl's ``pg_clipfrac``); ``truncated_frac``
    kept tokens whose weight was truncated.

    Paper: Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement
    Learning", arXiv:2602.04879.

    Shape: (B, T) each -> loss (), metrics {name: ()}.
    """
    return _dppo("dppo_tv", logprobs, old_logprobs, advantages, response_mask, loss_agg,
                 clip_eps_low, clip_eps_high, max_importance_weight, log_ratio_clamp, binary_kl=False)


@register_policy_loss("dppo_kl")
def dppo_kl(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg: LossAgg,
    clip_eps_low: float = 0.05,
    clip_eps_high: float | None = None,
    max_importance_weight: float | None = 20.0,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL: l = -sg[min(rho, C)] A logp, 0 where the binary KL(p_old || p) > delta in A's direction.

    ::

        D_it    = p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p))
        keep_it = (D_it <= delta_high) or (p <= p_old)    if A_it > 0
                  (D_it <= delta_low)  or (p >= p_old)    otherwise
        l_it    = -keep_it * sg[min(rho_it, max_importance_weight)] * A_it * logprobs_it
        loss    = loss_agg(l, response_mask)

    As ``dppo_tv`` with the binary KL as the divergence: a token is masked
    only when it moved in its advantage's direction by more than ``delta``
    (``clip_eps_low`` / ``clip_eps_high``; default 0.05 as in the paper's
    runs). ``1 - p`` is computed as ``-expm1(logprobs)``, exact near
    ``p = 1``; verl adds 1e-8 inside the logarithm instead, which differs
    only for probabilities within ~1e-8 of 1.

    Metrics as ``dppo_tv``.

    Paper: Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement
    Learning", arXiv:2602.04879.

    Shape: (B, T) each -> loss (), metrics {name: ()}.
    """
    return _dppo("dppo_kl", logprobs, old_logprobs, advantages, response_mask, loss_agg,
                 clip_eps_low, clip_eps_high, max_importance_weight, log_ratio_clamp, binary_kl=True)


@register_policy_loss("dro")
def dro(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg: LossAgg,
    beta: float,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DRO: the policy gradient with a quadratic log-ratio penalty, l = -(A logp - beta/2 (logp - logp_old)^2).

    ::

        l_it = -( A_it * logprobs_it - (beta / 2) * (logprobs_it - old_logprobs_it)^2 )
        loss = loss_agg(l, response_mask)

    This is the policy part of Direct Reward Optimisation's squared loss
    ``1/2 (r - V - beta log(pi / pi_anchor))^2``: its gradient divided by
    ``beta`` is ``-(r - V) grad log pi + beta log(pi / pi_anchor) grad log pi``,
    with ``A = r - V`` from the advantage estimator and the behaviour policy
    as the anchor. The penalty pulls the policy back towards the data's
    policy, softly instead of by clipping, so DRO tolerates off-policy data.
    ``beta`` has no default (as in verl): its scale is tied to the
    advantages', e.g. 0.05 with group-normalised ones.

    Metrics: ``clip_frac`` is 0 (nothing is clipped).

    Paper: Richemond et al. 2024, "Offline Regularised Reinforcement Learning
    for Large Language Models Alignment", arXiv:2405.19107.

    Shape: (B, T) each -> loss (), metrics {name: ()}.
    """
    on, logprobs, old_logprobs, advantages, log_ratio = _policy_tokens(
        "dro", logprobs, old_logprobs, advantages, response_mask, loss_agg, log_ratio_clamp)
    _check_positive("dro", "beta", beta, "e.g. 0.05 with group-normalised advantages")
    loss_mat = -(advantages * logprobs - 0.5 * beta * log_ratio.square())
    return _loss_and_metrics(loss_agg, loss_mat, response_mask, on, log_ratio, {"clip_frac": _zero_fraction(on)})


@register_policy_loss("opmd")
def opmd(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg: LossAgg,
    tau: float = 1.0,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """OPMD's policy loss: the plain policy gradient scaled by ``1 / (1 + tau)``, l = -A logp / (1 + tau).

    ::

        l_it = -A_it * logprobs_it / (1 + tau)
        loss = loss_agg(l, response_mask)

    Online policy mirror descent takes each step towards the KL-regularised
    optimum ``pi_{k+1} ~ pi_k exp(r / tau)``; with the group baseline of the
    ``opmd`` advantage (the mean, or ``tau * log mean exp(r / tau)``, the
    optimum's own normaliser) and the policy the samples came from as
    ``pi_k``, the gradient of the squared surrogate at ``pi_theta = pi_k``
    is the policy gradient above, divided by ``1 + tau`` for the regulariser
    on the current policy. No ratio and no clip: the algorithm is meant to
    tolerate stale samples through the regulariser (``old_logprobs`` only
    feed the metrics; ``clip_frac`` is 0). Follows Trinity-RFT's ``opmd``
    policy loss (a token mean of ``-A logp`` over ``1 + tau``, tau 1 by
    default); here the bound ``loss_agg`` aggregates, ``token-mean`` in the
    ``opmd`` preset.

    Papers: Trinity-RFT technical report, Pan et al. 2025, arXiv:2505.17826
    (Appendix A, OPMD) and arXiv:2509.24203 (Sec. 2.2); after Kimi k1.5,
    arXiv:2501.12599 (Sec. 2.3.2, the online mirror descent surrogate).

    Shape: (B, T) each -> loss (), metrics {name: ()}.
    """
    on, logprobs, old_logprobs, advantages, log_ratio = _policy_tokens(
        "opmd", logprobs, old_logprobs, advantages, response_mask, loss_agg, log_ratio_clamp)
    if tau is None or not (math.isfinite(float(tau)) and tau >= 0):
        raise ValueError(f"policy_loss 'opmd': tau must be a number >= 0 (Trinity-RFT uses 1.0), got {tau!r}")
    loss_mat = -advantages * logprobs / (1.0 + tau)
    return _loss_and_metrics(loss_agg, loss_mat, response_mask, on, log_ratio, {"clip_frac": _zero_fraction(on)})


# --------------------------------------------------------------------------
# The decoupled objective: any loss, behaviour policy != proximal policy
# --------------------------------------------------------------------------

#: The behaviour correction the decoupled objective uses when none is given: the plain, untruncated
#: importance weight pi_prox / pi_behav per token (AReaL with ``behav_imp_weight_cap`` unset).
PLAIN_BEHAVIOUR_WEIGHT = {"tis": "token", "tis_cap": None}


def decoupled_loss(
    policy_loss: Callable,
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg: LossAgg,
    behaviour_correction: Mapping | None = None,
    **loss_args,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Any policy loss in its decoupled form: the clip (or trust region) against the proximal policy,
    importance weights against the behaviour policy.

    Three policies: ``pi`` (``logprobs``, with gradient), the proximal policy
    ``pi_prox`` (``old_logprobs``: the trainer's recompute with the weights
    before this update's mini-batches) and the behaviour policy ``pi_behav``
    (``behaviour_logprobs``: what the rollout engine sampled with, possibly
    several policy versions old, per token). With ``l_t(pi, pi_prox)`` the
    per-token term of ``policy_loss``::

        w_t  = sg[ pi_prox(y_t) / pi_behav(y_t) ]       corrected by behaviour_correction
        loss = loss_agg(w * l(pi, pi_prox), response_mask without dropped tokens)

    For ``ppo_clip`` this is AReaL's decoupled PPO objective (see
    :func:`decoupled_ppo`). Where ``pi_behav = pi_prox`` every weight is 1 and
    the loss, its gradient and its metrics are exactly ``policy_loss``'s.

    ``behaviour_correction`` holds the settings of
    :func:`rltk.algorithms.mismatch.rollout_correction` (``tis``, ``mis``,
    ``rejection`` and their thresholds), the same TIS / MIS / rejection modes
    that ``algorithm.rollout_correction`` applies in the loop, computed by the
    same function; ``None`` means the plain weight ``{"tis": "token",
    "tis_cap": None}``. AReaL's ``behav_imp_weight_cap = c`` (tokens whose
    weight exceeds ``c`` get weight 0) is ``{"mis": "token", "mis_low": 0,
    "mis_high": c}``. The loop applies the correction once: either here (the
    decoupled loss) or at batch level, never both.

    Dropped tokens (MIS, rejection) leave the mask ``policy_loss`` sees, so its
    metrics and a response's own length under ``seq-mean-token-mean`` cover
    the kept tokens only, as the batch-level correction does. The global
    normalisers bound into ``loss_agg`` are the caller's: count kept tokens to
    average over kept data (rltk's batch-level choice), or sampled tokens to
    match AReaL (which divides by every sampled token).

    Responses without behaviour log-probs (expert data) should carry
    ``behaviour_logprobs = old_logprobs`` there: weight 1, nothing dropped.

    Papers: Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement
    Learning System for Language Reasoning", arXiv:2505.24298 (decoupled PPO
    objective); Hilton, Cobbe, Schulman 2021, "Batch size-invariance for
    policy optimization", arXiv:2110.00641 (the proximal policy).

    Shape: (B, T) each -> loss (), metrics {name: ()}.
    """
    if tuple(behaviour_logprobs.shape) != tuple(old_logprobs.shape):
        raise ValueError(
            f"decoupled policy loss: behaviour_logprobs {tuple(behaviour_logprobs.shape)} must match "
            f"old_logprobs {tuple(old_logprobs.shape)} (the proximal policy's [B, T])"
        )
    settings = dict(PLAIN_BEHAVIOUR_WEIGHT if behaviour_correction is None else behaviour_correction)
    try:
        check_rollout_correction(settings, where="behaviour_correction")
    except ValueError as err:
        raise ValueError(f"decoupled policy loss: {err}") from None
    mask = response_mask > 0
    correction = rollout_correction(old_logprobs, behaviour_logprobs, mask, **settings)
    kept = response_mask * (~correction.dropped).to(response_mask.dtype)
    loss, metrics = policy_loss(
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, response_mask=kept,
        loss_agg=weighted_loss_agg(loss_agg, correction.weights), **loss_args,
    )
    with torch.no_grad():
        on, kept_on = mask, mask & ~correction.dropped
        dtype = correction.weights.dtype
        log_w = torch.where(on, old_logprobs.detach().to(dtype) - behaviour_logprobs.detach().to(dtype), 0.0)
        log_w = log_w.clamp(-METRIC_LOG_RATIO_CLAMP, METRIC_LOG_RATIO_CLAMP)
        metrics = dict(metrics)
        metrics["behaviour_weight_mean"] = masked_mean(correction.weights, kept_on).detach()
        metrics["behaviour_kl"] = masked_mean(torch.expm1(log_w) - log_w, on).detach()
        metrics["behaviour_dropped_frac"] = _fraction(correction.dropped, on)
        metrics["behaviour_truncated_frac"] = _fraction(correction.truncated, on)
    return loss, metrics


@register_policy_loss("decoupled_ppo")
def decoupled_ppo(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg: LossAgg,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    clip_delta: float | None = None,
    behaviour_correction: Mapping | None = None,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO: l = -sg[pi_prox / pi_behav] min(r A, clip(r) A), r = pi / pi_prox.

    The objective asynchronous RL trains with: rollouts sampled by a stale
    behaviour policy ``pi_behav`` (``behaviour_logprobs``, per token; a
    rollout interrupted by a weight update carries each token's own
    version's log-prob), a proximal policy ``pi_prox`` (``old_logprobs``, the
    trainer's recompute before this update) as the trust-region centre::

        r_t  = exp(logprobs_t - old_logprobs_t)                 (current / proximal)
        w_t  = sg[ exp(old_logprobs_t - behaviour_logprobs_t) ] (proximal / behaviour)
        l_t  = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))
        loss = loss_agg(l, response_mask)

    Clipping against ``pi_behav`` instead (standard PPO on stale data) would
    make the trust region depend on how stale the data is: after a few
    versions most ratios sit outside it and the update stalls. Against
    ``pi_prox`` the step size stays that of on-policy PPO, and ``w`` makes
    the gradient an importance-sampled estimate under ``pi_behav``'s data.

    The clip options (clip-higher, ``dual_clip_c``, ``clip_delta``) are
    :func:`ppo_clip`'s; ``behaviour_correction`` chooses how ``w`` is
    truncated or masked (TIS / MIS / rejection, see :func:`decoupled_loss`;
    default untruncated). AReaL's ``behav_imp_weight_cap = c`` is
    ``behaviour_correction={"mis": "token", "mis_low": 0, "mis_high": c}``.
    With ``behaviour_logprobs == old_logprobs`` it is :func:`ppo_clip`.

    Metrics: :func:`ppo_clip`'s plus ``behaviour_*`` (module docstring).

    Paper: Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement
    Learning System for Language Reasoning", arXiv:2505.24298, section 5.2;
    Hilton, Cobbe, Schulman 2021, arXiv:2110.00641.

    Shape: (B, T) each -> loss (), metrics {name: ()}.
    """
    return decoupled_loss(
        ppo_clip, logprobs=logprobs, old_logprobs=old_logprobs, behaviour_logprobs=behaviour_logprobs,
        advantages=advantages, response_mask=response_mask, loss_agg=loss_agg,
        behaviour_correction=behaviour_correction, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high,
        dual_clip_c=dual_clip_c, clip_delta=clip_delta, log_ratio_clamp=log_ratio_clamp,
    )


@rltk.hookimpl
def rltk_policy_losses():
    """Register the builtin policy losses (each marked ``@register_policy_loss`` where it is defined)."""
    return POLICY_LOSSES
