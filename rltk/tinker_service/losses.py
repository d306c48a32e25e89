"""Tinker's loss names, run by rltk's registered policy losses, reporting Tinker's values.

Tinker sums every loss over tokens (no normalisation); here the aggregation is the registered
``token-mean`` with ``global_tokens=1``, which is exactly that sum. With ``lp`` the current
log-probs of ``target_tokens``, ``q`` the sampler's log-probs (``loss_fn_inputs["logprobs"]``),
``A`` the advantages, ``w`` the weights, ``rho = exp(lp - q)`` and ``sg`` a stop-gradient, the
reported ``loss:sum`` is Tinker's documented loss and the gradient is the component's:

=======================  ==============================================  ====================================
Tinker name              Tinker's loss (the value reported)              rltk component (the gradient)
=======================  ==============================================  ====================================
``cross_entropy``        ``-sum(w * lp)``                                ``reinforce`` with ``A = w``
``importance_sampling``  ``-sum(rho * A)``                               ``reinforce``, ``importance_weight``:
                                                                         ``-sum(sg[rho] A lp)``, the same
                                                                         gradient, another value
``ppo``                  ``-sum(min(rho A, clip(rho, lo, hi) A))``       ``ppo_clip``, ``eps_low = 1 - lo``,
                                                                         ``eps_high = hi - 1``
``cispo``                ``-sum(sg[clip(rho, lo, hi)] * lp * A)``        ``cispo``, the same mapping
``dro``                  ``-sum(lp A - beta / 2 * (lp - q)^2)``          ``dro`` (``beta`` has no default)
any registered name      (the component's own)                           that ``policy_loss``, its arguments
                                                                         from ``loss_fn_config``
=======================  ==============================================  ====================================

``ppo`` and ``cispo`` read ``clip_low_threshold`` (default 0.8) and ``clip_high_threshold`` (1.2)
from ``loss_fn_config``, as Tinker names them; ``dro`` reads ``beta``. Any other ``loss_fn`` naming
a registered ``policy_loss`` (a plugin's, or rltk's own ``sapo``, ``gspo`` ...: rltk's definitions
and argument names, not Tinker's) takes the same inputs as ``importance_sampling``; its
``loss_fn_config`` entries are its keyword arguments, checked against its signature.
``stable_reinforce`` is refused: Tinker computes it from stability information its own samplers
record, which Tinker does not document (:data:`UNSUPPORTED_TINKER_LOSSES`).

Metrics (``approx_kl:mean``, ``ratio_mean:mean``, ``clip_frac:mean`` ...) are the component's, over
the positions that carry a sample: a non-zero weight (when ``weights`` is given) or a non-zero
advantage. Prompt positions, where a client writes advantage 0 and sampler log-prob 0, move
neither the loss of these estimators nor their gradient, and are not counted.

Papers: Williams 1992 (REINFORCE); Schulman et al. 2017, "Proximal Policy Optimization
Algorithms", arXiv:1707.06347 (the clipped surrogate); MiniMax 2025, arXiv:2506.13585 (CISPO);
Richemond et al. 2024, arXiv:2405.19107 (DRO).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch

import rltk

CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
#: Tinker's names this service refuses, and why (the docs list them too).
UNSUPPORTED_TINKER_LOSSES = {
    "stable_reinforce": "Tinker computes it from stability information its own samplers record "
                        "(record_stability_info, provenance spans), which Tinker does not document; use "
                        "importance_sampling, ppo, cispo or dro (tinker-cookbook: "
                        "AsyncConfig(loss_fn='importance_sampling'))",
}
#: Arguments the service fills in itself, never ``loss_fn_config``.
_CALL_ARGUMENTS = {"logprobs", "old_logprobs", "advantages", "response_mask", "loss_agg", "behaviour_logprobs"}
_RL_INPUTS = ("logprobs", "advantages")


class LossError(ValueError):
    """A loss name or configuration the service refuses; the message names the field."""


@dataclass(frozen=True)
class LossPlan:
    """A Tinker loss resolved to a registered component and its arguments."""

    tinker_name: str
    component: str
    args: dict[str, Any]
    needs: tuple[str, ...]  # loss_fn_inputs required besides target_tokens


def registered_policy_losses() -> list[str]:
    from rltk.registry import list_components

    return sorted(entry.name for entry in list_components("policy_loss"))


def plan_loss(name: str, config: dict[str, float | str]) -> LossPlan:
    """The component, arguments and required inputs of ``loss_fn=name`` with ``loss_fn_config=config``."""
    if name in UNSUPPORTED_TINKER_LOSSES:
        raise LossError(f"loss_fn: {name!r} is a Tinker loss this service does not run: "
                        f"{UNSUPPORTED_TINKER_LOSSES[name]}")
    if name == "cross_entropy":
        _no_config(name, config)
        return LossPlan(name, "reinforce", {"importance_weight": False}, ())
    if name == "importance_sampling":
        _no_config(name, config)
        return LossPlan(name, "reinforce", {"importance_weight": True}, _RL_INPUTS)
    if name in ("ppo", "cispo"):
        low, high = _clip_thresholds(name, config)
        return LossPlan(name, "ppo_clip" if name == "ppo" else "cispo",
                        {"clip_eps_low": 1.0 - low, "clip_eps_high": high - 1.0}, _RL_INPUTS)
    if name == "dro":
        unknown = sorted(set(config) - {"beta"})
        if unknown or "beta" not in config:
            raise LossError(f"loss_fn_config.{unknown[0] if unknown else 'beta'}: loss_fn 'dro' takes beta "
                            "(required, > 0, e.g. 0.05)")
        return LossPlan(name, "dro", {"beta": _number("loss_fn_config.beta", config["beta"])}, _RL_INPUTS)
    known = registered_policy_losses()
    if name not in known:
        raise LossError(f"loss_fn: {name!r} is neither a Tinker loss this service runs (cross_entropy, "
                        f"importance_sampling, ppo, cispo, dro) nor a registered policy_loss ({', '.join(known)})")
    fn = rltk.get_component("policy_loss", name)
    parameters = inspect.signature(fn).parameters
    for key in config:
        if key in _CALL_ARGUMENTS or key not in parameters:
            valid = sorted(set(parameters) - _CALL_ARGUMENTS)
            raise LossError(f"loss_fn_config.{key}: policy_loss {name!r} takes {valid}")
    return LossPlan(name, name, dict(config), _RL_INPUTS)


def _clip_thresholds(name: str, config: dict) -> tuple[float, float]:
    unknown = sorted(set(config) - set(CLIP_DEFAULTS))
    if unknown:
        raise LossError(f"loss_fn_config.{unknown[0]}: loss_fn {name!r} takes {sorted(CLIP_DEFAULTS)}")
    low, high = (_number(f"loss_fn_config.{k}", config.get(k, d)) for k, d in CLIP_DEFAULTS.items())
    if not (0 < low <= 1 <= high):
        raise LossError(f"loss_fn_config: {name} needs 0 < clip_low_threshold <= 1 <= clip_high_threshold, got "
                        f"{low} and {high}")
    return low, high


def _no_config(name: str, config: dict) -> None:
    if config:
        raise LossError(f"loss_fn_config.{next(iter(config))}: loss_fn {name!r} takes no configuration")


def _number(where: str, value: Any) -> float:
    if isinstance(value, str):
        raise LossError(f"{where}: must be a number, got {value!r}")
    return float(value)


def sum_aggregation():
    """Tinker's sum over tokens: the registered ``token-mean`` over a global count of one."""
    return functools.partial(rltk.get_component("loss_agg", "token-mean"), global_tokens=1)


def _importance_sampling_value(logprobs, old_logprobs, advantages, mask) -> torch.Tensor:
    """Tinker's ``importance_sampling`` loss, ``-sum(rho * A)``."""
    return -(torch.exp(logprobs - old_logprobs) * advantages * mask).sum()


#: Tinker names whose documented value differs from their component's (the gradient is the same).
_TINKER_VALUES = {"importance_sampling": _importance_sampling_value}


def compute_loss(plan: LossPlan, logprobs: torch.Tensor, mask: torch.Tensor,
                 inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of ``plan`` and its metrics (Tinker's ``name:reduction`` keys). Shapes: (B, T) each.

    ``mask`` marks the datums' positions; the loss sums over all of them (as Tinker does), the metrics
    count only those that carry a sample (see the module docstring)."""
    if plan.tinker_name == "cross_entropy":
        advantages = inputs.get("weights", torch.ones_like(logprobs))
        old_logprobs = logprobs.detach()
    else:
        advantages, old_logprobs = inputs["advantages"], inputs["logprobs"]
    fn = rltk.get_component("policy_loss", plan.component)

    def run(response_mask):
        return fn(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, response_mask=response_mask,
                  loss_agg=sum_aggregation(), **plan.args)

    try:
        loss, metrics = run(mask)
        sampled = mask * (inputs["weights"] != 0 if "weights" in inputs else advantages != 0)
        if plan.tinker_name != "cross_entropy" and not torch.equal(sampled, mask):
            with torch.no_grad():
                metrics = run(sampled)[1]
    except (TypeError, ValueError) as exc:  # a plugin's own argument checks
        raise LossError(f"loss_fn {plan.tinker_name!r}: {exc}") from None
    tinker_value = _TINKER_VALUES.get(plan.tinker_name)
    if tinker_value is not None:  # Tinker's value, the component's gradient
        loss = loss + (tinker_value(logprobs.detach(), old_logprobs, advantages, mask) - loss.detach())
    reported = {"loss:sum": float(loss.detach())}
    if plan.tinker_name != "cross_entropy":
        reported.update({f"{key}:mean": float(value) for key, value in metrics.items()})
    return loss, reported
