"""Per-token KL estimators, KL coefficient controllers and the KL reward penalty.

A ``kl_penalty_fn`` is ``fn(logprobs, ref_logprobs) -> [B, T]``: a per-token
estimate of ``KL(pi || pi_ref)`` from the log-probabilities both policies give
to the tokens sampled from ``pi``. With ``r = ref_logprobs - logprobs``
(so ``pi_ref / pi = exp(r)``), the estimators of Schulman (2020) are::

    k1  = -r = logprobs - ref_logprobs        unbiased, high variance, can be < 0
    k2  = r^2 / 2                             biased, low variance, >= 0
    k3  = exp(r) - r - 1                      unbiased, low variance, >= 0   ("low_var_kl")
    abs = |r|

``k3_unbiased`` (DeepSeek-V3.2) weights k3 by ``pi / pi_old`` so that value
and gradient stay unbiased for tokens sampled by an older policy.

The ``+`` variants (``k1+``, ``k3+``, ``low_var_kl+``, ``abs+``) are
straight-through: their value is the named estimator, their gradient is
``k2``'s, ``d/d logprobs = logprobs - ref_logprobs``. As a loss term, ``k2``'s
gradient is the one whose on-policy expectation is, token by token, the
gradient of the reverse KL; ``k3``'s is not (its expectation is the gradient
of the forward KL ``KL(pi_ref || pi)``), so ``k3+`` keeps
k3's low-variance value for logging and the coefficient controller while the
update follows the right gradient.

KL enters training in one of two ways:

* as a penalty in the reward (PPO, REINFORCE++): ``token_rewards -= coef * kl``
  with :func:`apply_kl_penalty`, the KL detached;
* as a loss term (GRPO): ``loss += coef * loss_agg(kl, response_mask)``, with
  gradients flowing into ``logprobs`` (never into ``ref_logprobs``: the
  reference model is frozen, the estimators detach it). The aggregation
  ignores padding, but its gradient still passes through the estimator there:
  log-probs on padding must be finite (zero them with the mask if in doubt).

References: J. Schulman, "Approximating KL Divergence", 2020,
http://joschu.net/blog/kl-approx.html; Shao et al. 2024, "DeepSeekMath",
arXiv:2402.03300 (k3 as the GRPO loss term); Tang & Munos 2025, "On a Few
Pitfalls in KL Divergence Gradient Estimation for RL" (which estimator's
gradient is the KL gradient); Ziegler et al. 2019, "Fine-Tuning Language
Models from Human Preferences", arXiv:1909.08593 (adaptive coefficient).
"""

from __future__ import annotations

import math

import torch

import rltk

__all__ = [
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_k3_unbiased",
    "kl_abs",
    "kl_k1_straight_through",
    "kl_k3_straight_through",
    "kl_abs_straight_through",
    "FixedKLController",
    "AdaptiveKLController",
    "apply_kl_penalty",
]

# exp() of a log-ratio beyond this overflows float32 long before it is useful;
# a policy this far from the reference is already diverged.
_LOG_RATIO_LIMIT = 20.0

#: The builtin KL estimators by config name, filled by ``@register_kl_penalty_fn(name)`` on each definition and
#: returned by this module's ``rltk_kl_penalty_fns`` hook (the entry point ``kl``).
KL_PENALTY_FNS = rltk.ComponentTable("kl_penalty_fn")
register_kl_penalty_fn = KL_PENALTY_FNS.register


def _check_pair(where: str, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> None:
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"{where}: logprobs has shape {tuple(logprobs.shape)} but ref_logprobs has "
            f"{tuple(ref_logprobs.shape)}; both must be [B, T] log-probs of the same tokens"
        )


@register_kl_penalty_fn("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log pi_ref: the plain log-ratio (unbiased, high variance, can be negative).

    Schulman 2020, "Approximating KL Divergence".

    Shape: (B, T), (B, T) -> (B, T).
    """
    _check_pair("kl k1", logprobs, ref_logprobs)
    return logprobs - ref_logprobs.detach()


@register_kl_penalty_fn("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = (log pi - log pi_ref)^2 / 2: biased, low variance, non-negative.

    Its gradient ``log pi - log pi_ref`` is the on-policy gradient of the
    reverse KL, which is why the straight-through ``+`` estimators borrow it.
    Schulman 2020, "Approximating KL Divergence".

    Shape: (B, T), (B, T) -> (B, T).
    """
    _check_pair("kl k2", logprobs, ref_logprobs)
    return 0.5 * (logprobs - ref_logprobs.detach()).square()


@register_kl_penalty_fn("k3", "low_var_kl")
def kl_k3(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *, max_value: float | None = 10.0
) -> torch.Tensor:
    """k3 = exp(r) - r - 1 with r = log pi_ref - log pi: unbiased, low variance, >= 0.

    Also registered as ``low_var_kl`` (GRPO's KL term). For stability ``r`` is
    clamped to [-20, 20] before ``exp`` and the result to ``[0, max_value]``
    (default 10, as in verl; ``None`` disables the upper bound). k3 reaches 10
    at ``r ~ +2.61`` (the reference is 13.6x likelier than the policy) or
    ``r ~ -11.0``; beyond that the value is capped and its gradient is zero.
    Computed as ``expm1(r) - r``, exact near ``r = 0``.

    Schulman 2020, "Approximating KL Divergence"; Shao et al. 2024,
    arXiv:2402.03300.

    Shape: (B, T), (B, T) -> (B, T).
    """
    _check_pair("kl k3", logprobs, ref_logprobs)
    if max_value is not None and not max_value > 0:
        raise ValueError(f"kl k3: max_value must be > 0 or None (no cap), got {max_value}")
    log_ratio = (ref_logprobs.detach() - logprobs).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    kl = torch.expm1(log_ratio) - log_ratio
    return kl.clamp(min=0.0, max=max_value)


@register_kl_penalty_fn("k3_unbiased")
def kl_k3_unbiased(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    *,
    old_logprobs: torch.Tensor | None = None,
    max_value: float | None = 10.0,
) -> torch.Tensor:
    """DeepSeek-V3.2's unbiased KL: k3 weighted by the current/old ratio, (pi / pi_old) * k3.

    ::

        kl_t = (pi_t / pi_old_t) * (exp(r_t) - r_t - 1),     r = log pi_ref - log pi

    with the gradient flowing through both factors. Tokens are sampled from
    ``pi_old`` (the behaviour policy of the batch). Since
    ``E_{pi_old}[(pi / pi_old) k3] = E_pi[k3] = KL(pi || pi_ref)`` for every
    ``pi``, the estimate is unbiased and so is its gradient, the gradient of
    the reverse KL. Plain ``k3`` has neither property once the policy has
    moved away from ``pi_old`` (later PPO epochs and mini-batches), and even
    on-policy its gradient is the forward KL's. ``old_logprobs=None`` means
    the tokens were sampled from the current policy: the ratio is
    ``exp(logp - sg[logp])``, value 1, and the gradient is still the unbiased
    on-policy one, ``k3 * grad log pi + grad k3``. The k3 factor is clamped as
    in :func:`kl_k3` (``max_value``; a capped token has no gradient through
    it), the log-ratio to [-20, 20] before ``exp``.

    As a loss term it needs the batch's ``old_logprobs`` for every update
    after the first on a batch; as a reward penalty (computed at rollout,
    where current = old) ``None`` is exact.

    Paper: DeepSeek-AI 2025, "DeepSeek-V3.2", arXiv:2512.02556 (its unbiased
    KL estimate); Schulman 2020, "Approximating KL Divergence" (k3).

    Shape: (B, T), (B, T), optional (B, T) -> (B, T).
    """
    _check_pair("kl k3_unbiased", logprobs, ref_logprobs)
    behaviour = logprobs.detach() if old_logprobs is None else old_logprobs.detach()
    if behaviour.shape != logprobs.shape:
        raise ValueError(
            f"kl k3_unbiased: old_logprobs has shape {tuple(behaviour.shape)} but logprobs has "
            f"{tuple(logprobs.shape)}; both must be [B, T] log-probs of the same tokens"
        )
    ratio = torch.exp((logprobs - behaviour).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))
    return ratio * kl_k3(logprobs, ref_logprobs, max_value=max_value)


@register_kl_penalty_fn("abs")
def kl_abs(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """abs = |log pi - log pi_ref|.

    Shape: (B, T), (B, T) -> (B, T).
    """
    _check_pair("kl abs", logprobs, ref_logprobs)
    return (logprobs - ref_logprobs.detach()).abs()


def _with_k2_gradient(
    value: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor
) -> torch.Tensor:
    """``value`` forward, ``k2``'s gradient backward: ``value.detach() + k2 - k2.detach()``."""
    k2 = kl_k2(logprobs, ref_logprobs)
    return value.detach() + (k2 - k2.detach())


@register_kl_penalty_fn("k1+")
def kl_k1_straight_through(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1+: the value of k1 with the gradient of k2 (straight-through).

    Shape: (B, T), (B, T) -> (B, T).
    """
    return _with_k2_gradient(kl_k1(logprobs, ref_logprobs), logprobs, ref_logprobs)


@register_kl_penalty_fn("k3+", "low_var_kl+")
def kl_k3_straight_through(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *, max_value: float | None = 10.0
) -> torch.Tensor:
    """k3+: the value of k3 (clamped as in :func:`kl_k3`) with the gradient of k2.

    The unbiased-gradient fix of the k3 loss term: k3's own gradient is the
    on-policy gradient of the forward KL, not of ``KL(pi || pi_ref)``. The
    gradient is ``log pi - log pi_ref`` everywhere, including where the value
    is capped.

    Shape: (B, T), (B, T) -> (B, T).
    """
    return _with_k2_gradient(kl_k3(logprobs, ref_logprobs, max_value=max_value), logprobs, ref_logprobs)


@register_kl_penalty_fn("abs+")
def kl_abs_straight_through(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """abs+: the value of abs with the gradient of k2 (straight-through).

    Shape: (B, T), (B, T) -> (B, T).
    """
    return _with_k2_gradient(kl_abs(logprobs, ref_logprobs), logprobs, ref_logprobs)


# --------------------------------------------------------------------------
# Coefficient controllers
# --------------------------------------------------------------------------


class FixedKLController:
    """A constant KL coefficient: ``value`` never changes.

    Same interface as :class:`AdaptiveKLController`, so recipes treat both alike.
    """

    def __init__(self, coef: float):
        coef = float(coef)
        if not (math.isfinite(coef) and coef >= 0):
            raise ValueError(f"FixedKLController: coef must be a finite number >= 0, got {coef}")
        self.value = coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt; accepts the same arguments as the adaptive controller."""

    def __repr__(self) -> str:
        return f"FixedKLController(coef={self.value})"


class AdaptiveKLController:
    """Adapt the KL coefficient so the measured KL tracks a target (Ziegler et al. 2019).

    After each batch::

        e     = clip(current_kl / target_kl - 1, -0.2, 0.2)
        beta <- beta * (1 + e * n_steps / horizon)

    so ``beta`` grows when the policy drifts further than ``target_kl`` from the
    reference and shrinks when it stays closer; ``horizon`` (in the same unit as
    ``n_steps``, e.g. samples) sets how fast, and the clip bounds one update to
    ``+-20% * n_steps / horizon``.

    Paper: Ziegler et al. 2019, "Fine-Tuning Language Models from Human
    Preferences", arXiv:1909.08593, section 2.2.
    """

    def __init__(self, init_coef: float, target_kl: float, horizon: float):
        init_coef, target_kl, horizon = float(init_coef), float(target_kl), float(horizon)
        if not (math.isfinite(init_coef) and init_coef >= 0):
            raise ValueError(f"AdaptiveKLController: init_coef must be a finite number >= 0, got {init_coef}")
        if not (math.isfinite(target_kl) and target_kl > 0):
            raise ValueError(
                f"AdaptiveKLController: target_kl must be > 0 (the KL to hold, in the unit the "
                f"recipe measures and passes to update()), got {target_kl}"
            )
        if not (math.isfinite(horizon) and horizon > 0):
            raise ValueError(
                f"AdaptiveKLController: horizon must be > 0 (e.g. 10000 samples), got {horizon}"
            )
        self.value = init_coef
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``value`` towards the coefficient that holds ``current_kl`` at ``target_kl``.

        ``current_kl`` is the KL measured on the batch just trained on (a
        float; a tensor is converted), ``n_steps`` how many samples (or steps,
        in the unit of ``horizon``) it covered.
        """
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            raise ValueError(
                f"AdaptiveKLController.update: current_kl is {current_kl}; a non-finite KL would "
                f"poison the coefficient for the rest of the run (look for -inf log-probs)"
            )
        if n_steps < 0:
            raise ValueError(f"AdaptiveKLController.update: n_steps must be >= 0, got {n_steps}")
        proportional_error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def __repr__(self) -> str:
        return (
            f"AdaptiveKLController(value={self.value}, target_kl={self.target_kl}, "
            f"horizon={self.horizon})"
        )


def apply_kl_penalty(
    token_rewards: torch.Tensor, kl: torch.Tensor, coef: float, response_mask: torch.Tensor
) -> torch.Tensor:
    """Fold a KL penalty into the per-token rewards (the KL-in-reward mode).

    ``token_rewards - coef * kl`` on policy tokens, ``token_rewards`` unchanged
    elsewhere. The KL is detached: rewards are targets, not part of the graph.
    Masked positions never see the (possibly garbage) KL of padding.

    Ziegler et al. 2019, arXiv:1909.08593; Ouyang et al. 2022 (InstructGPT),
    arXiv:2203.02155.

    Shape: (B, T), (B, T), scalar, (B, T) -> (B, T).
    """
    if token_rewards.shape != kl.shape or kl.shape != response_mask.shape:
        raise ValueError(
            f"apply_kl_penalty: token_rewards {tuple(token_rewards.shape)}, kl {tuple(kl.shape)} "
            f"and response_mask {tuple(response_mask.shape)} must all be the same [B, T]"
        )
    penalty = torch.where(response_mask > 0, coef * kl.detach(), 0.0)
    return token_rewards - penalty


@rltk.hookimpl
def rltk_kl_penalty_fns():
    """Register the builtin KL estimators (each marked ``@register_kl_penalty_fn`` where it is defined)."""
    return KL_PENALTY_FNS
