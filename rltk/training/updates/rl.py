"""The policy-gradient update shared by the RL recipes (:func:`policy_update`), and when it may take the
old log-probs from its own forward (:func:`old_logprobs_from_update`).

Pure mechanics: the assembly of one micro-batch's loss, run by the update loop every
update shares (:func:`rltk.training.updates.update_loop.optimizer_epochs`: epochs, mini-batches,
micro-batches, global normalisers). Every algorithmic choice arrives as a component from the registry:
:class:`~rltk.training.step.loss_components.LossComponents` (policy loss,
aggregation, KL, entropy) and :class:`~rltk.training.step.estimator.Estimator`
(the advantage function, its signature read once). The no-gradient passes
before the update are :mod:`rltk.training.step.forward`.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from rltk.algorithms.aggregation import masked_mean
from rltk.algorithms.mismatch import weighted_loss_agg
from rltk.config.recipe_capabilities import update_may_take_old_logprobs
from rltk.models.moe import RouterTrace, load_balancing_loss
from rltk.training.step.estimator import Estimator
from rltk.training.step.forward import ForwardSettings
from rltk.training.step.loss_components import LossComponents
from rltk.training.step.micro_batches import MicroBatch
from rltk.training.step.rollout_correction import WEIGHTS_KEY, apply_rollout_correction
from rltk.training.updates.update_loop import MicroLoss, MiniBatch, optimizer_epochs, shares


#: The policy-loss argument of the behaviour policy's log-probs per token (:func:`behaviour_logprobs`).
BEHAVIOUR_KEY = "behaviour_logprobs"


def takes_behaviour_logprobs(policy_loss: Callable) -> bool:
    """Whether ``policy_loss`` needs the behaviour policy's log-probs (a decoupled loss: ``decoupled_ppo``)."""
    import inspect

    try:
        p = inspect.signature(policy_loss).parameters.get(BEHAVIOUR_KEY)
    except (TypeError, ValueError):
        return False
    return p is not None and p.default is inspect.Parameter.empty


def behaviour_logprobs(batch: dict[str, torch.Tensor], old_logprobs: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: the log-probs the rollout engine sampled each token with, where it recorded them, and
    ``old_logprobs`` (weight 1) elsewhere (expert data, an engine without log-probs).

    In an asynchronous run the sampling policy is several versions behind the trainer's proximal policy
    ``old_logprobs``: their ratio is the decoupled loss's importance weight (Fu et al. 2025, arXiv:2505.24298).
    """
    has = batch["has_rollout_logprobs"].to(torch.bool).view(-1, 1)
    return torch.where(has, batch["rollout_logprobs"].to(old_logprobs.dtype), old_logprobs)


def old_logprobs_from_update(loss: LossComponents, advantage_fn: "Callable | Estimator", *, ppo_epochs: int,
                             mini_batches: int, use_rollout_logprobs: bool, kl_coef: float) -> bool:
    """Whether the update may take ``old_logprobs`` from its own training forward (detached) instead of a
    separate no-grad pass of the policy before it: the step plan's rule
    (:func:`rltk.config.recipe_capabilities.update_may_take_old_logprobs`, where the cases are listed), asked
    with components already built. A loop reads ``parts.on_policy``, its step plan's answer."""
    estimator = advantage_fn if isinstance(advantage_fn, Estimator) else Estimator.of(advantage_fn)
    names = frozenset(estimator.params) if estimator.readable else None
    correction = {**loss.rollout_correction, "log_metrics": loss.log_mismatch_metrics}
    return update_may_take_old_logprobs(names, ppo_epochs=ppo_epochs, mini_batches=mini_batches,
                                        use_rollout_logprobs=use_rollout_logprobs, rollout_correction=correction,
                                        kl_coef=kl_coef, kl_in=loss.kl_in)


class PolicyUpdate(NamedTuple):
    """What :func:`policy_update` returns: its metrics, and the old log-probs it trained against."""

    metrics: dict[str, float]
    #: ``[B, T]``: the batch's own ``old_logprobs``, or on-policy the update's training-forward ones (detached)
    old_logprobs: torch.Tensor


def policy_update(
    strategy,
    batch: dict[str, torch.Tensor],
    loss: LossComponents,
    settings: ForwardSettings,
    *,
    kl_coef: float,
    mini_batches: int,
    ppo_epochs: int,
    generator: torch.Generator | None = None,
) -> PolicyUpdate:
    """PPO-style epochs over mini-batches of a rollout batch; one optimizer step per mini-batch.

    Each micro-batch's loss is aggregated with the mini-batch's *global* token
    and sequence counts (summed over micro-batches and ranks), so the summed
    gradient equals that of one large batch whatever the micro-batch size and
    process count. The total loss of a micro-batch is

        L = policy_loss + kl_coef * agg(KL(pi || pi_ref))   (when kl_in == "loss")
            - entropy_coef * agg(H(pi))
            + router_aux_loss_coef * aux   (an MoE policy's load-balancing loss, rltk.models.moe)

    With ``loss.rollout_correction`` on, each token's policy-loss term is
    weighted by its importance weight between the trainer's old policy and the
    rollout engine's, and dropped tokens leave the response mask (and every
    normaliser) first: see :mod:`rltk.training.step.rollout_correction`.

    A policy loss that takes ``behaviour_logprobs`` (``decoupled_ppo``) gets the rollout engine's
    log-probs there (:func:`behaviour_logprobs`), the clip staying against ``old_logprobs``.

    ``settings`` (:class:`rltk.training.step.forward.ForwardSettings`) cut the
    micro-batches (rows, or a token budget, packed or not; the global
    normalisers keep the loss and gradient those of the whole mini-batch) and
    run the forward as the no-gradient passes before it ran theirs.

    A ``batch`` without ``old_logprobs`` is trained on-policy (see
    :func:`old_logprobs_from_update`): each micro-batch takes its own
    training-forward log-probs, detached, as the old ones, and they come back
    as :attr:`PolicyUpdate.old_logprobs` (for the KL metric). That needs
    ``ppo_epochs == mini_batches == 1``. Nothing is written into ``batch``.
    """
    on_policy = "old_logprobs" not in batch
    if on_policy and (ppo_epochs != 1 or mini_batches != 1):
        raise ValueError(
            f"a batch without old_logprobs is trained on-policy, which needs trainer.ppo_epochs=1 and "
            f"trainer.mini_batches=1 (got {ppo_epochs} and {mini_batches}): fill old_logprobs first "
            f"(rltk.training.step.forward.old_logprobs_pass)"
        )
    given_old = batch.get("old_logprobs")
    # rollout/trainer mismatch: weights and a narrowed response mask, fixed for all epochs
    batch, correction_metrics = apply_rollout_correction(
        batch, loss.rollout_correction, log_metrics=loss.log_mismatch_metrics, strategy=strategy)
    B, T = batch["response_mask"].shape
    # on-policy: each real micro-batch's detached training-forward log-probs, with its rows' indices in
    # the batch (a token budget groups rows by length, so micro-batches are not runs of the mini-batch)
    taken: list[tuple[torch.Tensor, torch.Tensor]] = []
    micro_loss = functools.partial(_micro_policy_loss, strategy=strategy, loss=loss, settings=settings,
                                   kl_coef=kl_coef, width=T, decoupled=takes_behaviour_logprobs(loss.policy_loss),
                                   taken=taken if on_policy else None)
    metrics = optimizer_epochs(strategy, batch, micro_loss, settings, epochs=ppo_epochs, mini_batches=mini_batches,
                               generator=generator)
    if on_policy:
        given_old = torch.empty(B, T, dtype=torch.float32, device=batch["response_mask"].device)
        for rows, values in taken:  # a rank with no rows of its own ran padding passes only
            given_old[rows] = values.to(given_old.device)
    return PolicyUpdate({**metrics, **correction_metrics}, given_old)


def _micro_policy_loss(mb: dict[str, torch.Tensor], micro: MicroBatch, *, mini: MiniBatch, strategy,
                       loss: LossComponents, settings: ForwardSettings, kl_coef: float, width: int, decoupled: bool,
                       taken: list | None) -> MicroLoss:
    """One micro-batch's share of :func:`policy_update`'s loss (its docstring has the formula), and its
    shares of the metrics. ``taken`` (on-policy only) collects the training forward's detached log-probs."""
    agg = mini.loss_agg(loss.loss_agg, **loss.loss_agg_args)
    trace = RouterTrace() if loss.router_aux_loss_coef else None  # the routers' logits, for the aux loss
    logprobs, entropy = settings.logprobs(strategy.model, mb, width, with_entropy=True, router_trace=trace,
                                         strategy=strategy)
    # on-policy, pi_old is the policy this forward evaluates (no step has run yet)
    on_policy = taken is not None
    old_logprobs = logprobs.detach() if on_policy else mb["old_logprobs"]
    if on_policy and not micro.padding:
        taken.append((mini.rows[micro.rows], old_logprobs.float()))
    pg_agg = agg if WEIGHTS_KEY not in mb else weighted_loss_agg(agg, mb[WEIGHTS_KEY])
    # a decoupled loss (decoupled_ppo) weighs by pi_prox / pi_behav: the sampler's log-probs
    behaviour = ({BEHAVIOUR_KEY: behaviour_logprobs(mb, old_logprobs)} if decoupled else {})
    pg_loss, pg_metrics = loss.policy_loss(
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=mb["advantages"],
        response_mask=mb["response_mask"], loss_agg=pg_agg, **behaviour, **loss.policy_loss_args,
    )
    total = pg_loss
    entropy_term = agg(entropy, mb["response_mask"])
    if loss.entropy_coef:
        total = total - loss.entropy_coef * entropy_term
    mean_entropy = masked_mean(entropy.detach(), mb["response_mask"])
    summed = {"pg_loss": pg_loss.detach()}
    if kl_coef > 0 and loss.kl_in == "loss":
        kl_old = {"old_logprobs": old_logprobs} if loss.kl_takes_old else {}
        kl = loss.kl_penalty(logprobs, mb["ref_logprobs"], **kl_old, **loss.kl_penalty_args)
        kl_term = agg(kl, mb["response_mask"])
        total = total + kl_coef * kl_term
        summed["kl_loss"] = kl_term.detach()
    weight = mini.token_share(mb["response_mask"])
    per_token = {"entropy": mean_entropy}
    if trace is not None:
        # a mean over this micro-batch's tokens, weighted by its share of the mini-batch's response tokens
        aux = load_balancing_loss(trace.stacked("logits"), trace.stacked("used"), trace.valid)
        total = total + loss.router_aux_loss_coef * weight * aux
        per_token["router_aux_loss"] = aux.detach()

    def read_shares() -> dict[str, float]:
        # pg_loss and kl_loss are this micro-batch's share of the global mini-batch sum already;
        # per-micro ratios (clip fraction, approx KL) are weighted by its share of the global tokens
        return {**shares(summed), **shares(per_token, weight), **shares(pg_metrics, weight)}

    return MicroLoss(total, read_shares)
