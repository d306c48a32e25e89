"""Tinker's loss names, run by rltk's registered policy losses.

Tinker sums every loss over tokens (no normalisation); here the aggregation is the registered
``token-mean`` with ``global_tokens=1``, which is exactly that sum. With ``lp`` the current
log-probs of ``target_tokens``, ``q`` the sampler's log-probs (``loss_fn_inputs["logprobs"]``),
``A`` the advantages, ``w`` the weights and ``rho = exp(lp - q)``:

=====================  ==========================================  ====================================
Tinker name            Tinker's loss                               rltk component
=====================  ==========================================  ====================================
``cross_entropy``      ``-sum(w * lp)``                            ``reinforce`` with ``A = w``: the same
``importance_sampling`` ``-sum(rho * A)``                          ``reinforce``, ``importance_weight=True``:
                                                                   ``-sum(sg[rho] * A * lp)``, the same
                                                                   gradient (its value is reported)
``ppo``                ``-sum(min(rho A, clip(rho, lo, hi) A))``   ``ppo_clip`` with ``clip_eps_low = 1 - lo``,
                                                                   ``clip_eps_high = hi - 1``
any registered name    (the component's own)                       that ``policy_loss``, its arguments
                                                                   from ``loss_fn_config``
=====================  ==========================================  ====================================

``ppo`` reads ``clip_low_threshold`` (default 0.8) and ``clip_high_threshold`` (1.2) from
``loss_fn_config``, as Tinker does. Any other ``loss_fn`` naming a registered ``policy_loss``
(a plugin's, or rltk's own ``cispo``, ``gspo``, ``dro`` ...: rltk's definitions and argument
names, not Tinker's) takes the same inputs as ``importance_sampling``; its ``loss_fn_config``
entries are its keyword arguments, checked against its signature.

Papers: Williams 1992 (REINFORCE); Schulman et al. 2017, "Proximal Policy Optimization
Algorithms", arXiv:1707.06347 (the clipped surrogate).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch

import rltk

PPO_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
#: Arguments the service fills in itself, never ``loss_fn_config``.
_CALL_ARGUMENTS = {"logprobs", "old_logprobs", "advantages", "response_mask", "loss_agg", "behaviour_logprobs"}


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
    if name == "cross_entropy":
        _no_config(name, config)
        return LossPlan(name, "reinforce", {"importance_weight": False}, ())
    if name == "importance_sampling":
        _no_config(name, config)
        return LossPlan(name, "reinforce", {"importance_weight": True}, ("logprobs", "advantages"))
    if name == "ppo":
        unknown = sorted(set(config) - set(PPO_DEFAULTS))
        if unknown:
            raise LossError(f"loss_fn_config.{unknown[0]}: loss_fn 'ppo' takes {sorted(PPO_DEFAULTS)}")
        low, high = (_number(f"loss_fn_config.{k}", config.get(k, d)) for k, d in PPO_DEFAULTS.items())
        if not (0 < low <= 1 <= high):
            raise LossError(f"loss_fn_config: ppo needs 0 < clip_low_threshold <= 1 <= clip_high_threshold, got "
                            f"{low} and {high}")
        return LossPlan(name, "ppo_clip", {"clip_eps_low": 1.0 - low, "clip_eps_high": high - 1.0},
                        ("logprobs", "advantages"))
    known = registered_policy_losses()
    if name not in known:
        raise LossError(f"loss_fn: {name!r} is neither a Tinker loss this service runs (cross_entropy, "
                        f"importance_sampling, ppo) nor a registered policy_loss ({', '.join(known)})")
    fn = rltk.get_component("policy_loss", name)
    parameters = inspect.signature(fn).parameters
    for key in config:
        if key in _CALL_ARGUMENTS or key not in parameters:
            valid = sorted(set(parameters) - _CALL_ARGUMENTS)
            raise LossError(f"loss_fn_config.{key}: policy_loss {name!r} takes {valid}")
    return LossPlan(name, name, dict(config), ("logprobs", "advantages"))


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


def compute_loss(plan: LossPlan, logprobs: torch.Tensor, mask: torch.Tensor,
                 inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of ``plan`` and its metrics (Tinker's ``name:reduction`` keys). Shapes: (B, T) each."""
    if plan.tinker_name == "cross_entropy":
        advantages = inputs.get("weights", torch.ones_like(logprobs))
        old_logprobs = logprobs.detach()
    else:
        advantages, old_logprobs = inputs["advantages"], inputs["logprobs"]
    fn = rltk.get_component("policy_loss", plan.component)
    try:
        loss, metrics = fn(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, response_mask=mask,
                           loss_agg=sum_aggregation(), **plan.args)
    except (TypeError, ValueError) as exc:  # a plugin's own argument checks
        raise LossError(f"loss_fn {plan.tinker_name!r}: {exc}") from None
    reported = {"loss:sum": float(loss.detach())}
    if plan.tinker_name != "cross_entropy":
        reported.update({f"{key}:mean": float(value) for key, value in metrics.items()})
    return loss, reported
