"""The policy update's components, each chosen by name in the config: policy loss, aggregation, KL estimator,
entropy bonus, rollout correction, an MoE policy's load-balancing loss (:class:`LossComponents`)."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Callable

from rltk.training.scaffold.setup import args_of


@dataclass
class LossComponents:
    """The registry components and arguments one policy update needs."""

    policy_loss: Callable
    loss_agg: Callable
    policy_loss_args: dict = field(default_factory=dict)
    loss_agg_args: dict = field(default_factory=dict)
    kl_penalty: Callable | None = None
    kl_penalty_args: dict = field(default_factory=dict)
    kl_in: str = "loss"
    entropy_coef: float = 0.0
    # algorithm.rollout_correction: modes and thresholds (rltk.algorithms.mismatch), and whether to
    # log the mismatch metrics with every mode off
    rollout_correction: dict = field(default_factory=dict)
    log_mismatch_metrics: bool = False
    # algorithm.router_aux_loss_coef: weight of an MoE policy's load-balancing loss (rltk.models.moe); 0: off
    router_aux_loss_coef: float = 0.0

    @property
    def kl_takes_old(self) -> bool:
        """Whether the KL estimator names ``old_logprobs`` (its signature read once per estimator).

        k3_unbiased weights each token by pi / pi_old; without ``old_logprobs`` it assumes the batch was
        sampled by the current policy, wrong after the first mini-batch step.
        """
        return self.kl_penalty is not None and _names_old_logprobs(self.kl_penalty)

    @classmethod
    def from_config(cls, cfg) -> "LossComponents":
        """The ``algorithm.*`` choices of a config, looked up in the registry."""
        from omegaconf import OmegaConf

        from rltk import get_component

        a = cfg.algorithm
        correction = OmegaConf.to_container(a.rollout_correction)
        loss_agg = get_component("loss_agg", a.loss_agg)
        return cls(
            policy_loss=get_component("policy_loss", a.policy_loss),
            policy_loss_args=args_of(cfg, "algorithm.policy_loss"),
            loss_agg=loss_agg,
            loss_agg_args=loss_agg_args(loss_agg, args_of(cfg, "algorithm.loss_agg"), cfg.rollout.max_new_tokens),
            kl_penalty=get_component("kl_penalty_fn", a.kl_penalty_fn),
            kl_penalty_args=args_of(cfg, "algorithm.kl_penalty_fn"),
            kl_in=a.kl_in,
            entropy_coef=a.entropy_coef,
            log_mismatch_metrics=bool(correction.pop("log_metrics")),
            rollout_correction=correction,
            router_aux_loss_coef=float(a.get("router_aux_loss_coef", 0.0)),
        )


@functools.cache
def _names_old_logprobs(kl_penalty: Callable) -> bool:
    return "old_logprobs" in inspect.signature(kl_penalty).parameters


def loss_agg_args(loss_agg: Callable, args: dict, max_new_tokens: int) -> dict:
    """The configured ``algorithm.loss_agg_args``, with ``norm_constant`` set to the generation budget
    (``rollout.max_new_tokens``) for an aggregation that takes one and was given none.

    Dr. GRPO (Liu et al. 2025, arXiv:2503.20783) divides token sums by a constant, the maximum
    response length: the budget is the same for every micro-batch and step, while the width of a
    batch depends on the longest response sampled in it.
    """
    if "norm_constant" in inspect.signature(loss_agg).parameters and args.get("norm_constant") is None:
        return {**args, "norm_constant": float(max_new_tokens)}
    return args
