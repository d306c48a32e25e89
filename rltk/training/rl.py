"""The policy-gradient update shared by the RL recipes (:func:`policy_update`), and when it may take the
old log-probs from its own forward (:func:`old_logprobs_from_update`).

Pure mechanics (micro-batching, global normalisers, loss assembly); every
algorithmic choice arrives as a component from the registry:
:class:`~rltk.training.loss_components.LossComponents` (policy loss,
aggregation, KL, entropy) and :class:`~rltk.training.estimator.Estimator`
(the advantage function, its signature read once). The no-gradient passes
before the update are :mod:`rltk.training.forward`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import torch

from rltk.algorithms.aggregation import loss_agg_normalisers, masked_mean
from rltk.algorithms.mismatch import correction_active
from rltk.batch import slice_batch
from rltk.training.estimator import Estimator
from rltk.training.forward import ForwardSettings
from rltk.training.loss_components import LossComponents
from rltk.training.ranks import check_mini_batches
from rltk.algorithms.mismatch import weighted_loss_agg
from rltk.training.rollout_correction import WEIGHTS_KEY, apply_rollout_correction


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
    separate no-grad pass of the policy before it.

    With one epoch over one mini-batch the only optimizer step comes after the one training forward, so
    the policy that forward evaluates is the policy that sampled the batch: ``pi_old = pi_theta.detach()``
    and the PPO ratio is exactly 1 (as in the on-policy case of Schulman et al. 2017, arXiv:1707.06347).
    The pass before the update is then a forward whose result is already known. It is still needed when

    * ``ppo_epochs > 1`` or ``mini_batches > 1``: later mini-batches train a policy that has moved;
    * ``use_rollout_logprobs``: the old log-probs are the engine's, not this policy's;
    * a rollout-correction mode or ``log_metrics`` is on: both compare old with rollout log-probs before
      the update (the weights and the narrowed mask are fixed before the first forward);
    * the estimator names ``old_logprobs`` or ``sum_pi_squared``: advantages come before the update;
    * a KL penalty is folded into the rewards (``kl_in == "reward"`` with ``kl_coef > 0``): it needs
      ``old_logprobs`` before the advantages.

    One difference remains where the policy is not deterministic in training mode (dropout): the
    training forward's log-probs are then those of the dropped-out network, which the recompute (in
    eval mode) is not. rltk's models train without dropout.
    """
    estimator = advantage_fn if isinstance(advantage_fn, Estimator) else Estimator.of(advantage_fn)
    if ppo_epochs != 1 or mini_batches != 1 or use_rollout_logprobs:
        return False
    if correction_active(loss.rollout_correction) or loss.log_mismatch_metrics:
        return False
    if not estimator.readable:  # no signature to read: keep the pass, the estimator may want the field
        return False
    if estimator.names("old_logprobs") or estimator.names("sum_pi_squared"):
        return False
    return not (kl_coef > 0 and loss.kl_in == "reward")


def _mean_metrics(acc: dict[str, float], new: dict[str, Any], weight: float) -> None:
    for k, v in new.items():
        v = float(v.detach().item() if isinstance(v, torch.Tensor) else v)
        acc[k] = acc.get(k, 0.0) + v * weight


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

    With ``loss.rollout_correction`` on, each token's policy-loss term is
    weighted by its importance weight between the trainer's old policy and the
    rollout engine's, and dropped tokens leave the response mask (and every
    normaliser) first: see :mod:`rltk.training.rollout_correction`.

    A policy loss that takes ``behaviour_logprobs`` (``decoupled_ppo``) gets the rollout engine's
    log-probs there (:func:`behaviour_logprobs`), the clip staying against ``old_logprobs``.

    ``settings`` (:class:`rltk.training.forward.ForwardSettings`) cut the
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
            f"(rltk.training.forward.old_logprobs_pass)"
        )
    given_old = batch.get("old_logprobs")
    decoupled = takes_behaviour_logprobs(loss.policy_loss)
    # rollout/trainer mismatch: weights and a narrowed response mask, fixed for all epochs
    batch, correction_metrics = apply_rollout_correction(
        batch, loss.rollout_correction, log_metrics=loss.log_mismatch_metrics, strategy=strategy)
    B = batch["input_ids"].shape[0]
    T = batch["response_mask"].shape[1]
    check_mini_batches(strategy, B, mini_batches)
    metrics: dict[str, float] = {}
    n_updates = 0
    # on-policy: each real micro-batch's detached training-forward log-probs, with its rows' indices in
    # the mini-batch (a token budget groups rows by length, so micro-batches are not runs of `order`)
    taken: list[tuple[torch.Tensor, torch.Tensor]] = []
    for _ in range(ppo_epochs):
        order = torch.randperm(B, generator=generator)
        for rows in order.tensor_split(mini_batches):
            mini = slice_batch(batch, rows)
            local = loss_agg_normalisers(mini["response_mask"])
            counts = torch.tensor([float(local["global_tokens"]), float(local["global_seqs"])], dtype=torch.float64)
            global_tokens, global_seqs = strategy.all_reduce_sum(counts).tolist()
            agg = functools.partial(
                loss.loss_agg, global_tokens=global_tokens, global_seqs=global_seqs, **loss.loss_agg_args
            )
            shares: dict[str, float] = {}
            # Every rank runs as many micro-batches as the busiest (sharded engines gather parameters
            # in each forward; DDP all-reduces in the last backward); padding ones have zero weight.
            for micro in settings.micro_batches(strategy, mini, fallback=batch):
                is_last, padding = micro.is_last, micro.padding
                mb = {k: v.to(strategy.device) for k, v in micro.data.items()}
                weight = mb["response_mask"].sum().item() / max(global_tokens, 1.0)
                with strategy.accumulate(is_last):
                    with strategy.autocast():
                        logprobs, entropy = settings.logprobs(strategy.model, mb, T, with_entropy=True)
                        # on-policy, pi_old is the policy this forward evaluates (no step has run yet)
                        old_logprobs = logprobs.detach() if on_policy else mb["old_logprobs"]
                        if on_policy and not padding:
                            taken.append((micro.rows, old_logprobs.float()))
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
                        mask = mb["response_mask"]
                        mean_entropy = masked_mean(entropy.detach(), mask)
                        parts = {"pg_loss": pg_loss.detach(), "entropy": mean_entropy}
                        if kl_coef > 0 and loss.kl_in == "loss":
                            kl_old = {"old_logprobs": old_logprobs} if loss.kl_takes_old else {}
                            kl = loss.kl_penalty(logprobs, mb["ref_logprobs"], **kl_old, **loss.kl_penalty_args)
                            kl_term = agg(kl, mb["response_mask"])
                            total = total + kl_coef * kl_term
                            parts["kl_loss"] = kl_term.detach()
                    # backward outside autocast (torch's advice) but inside accumulate,
                    # whose no-sync must cover it
                    strategy.backward(total * 0.0 if padding else total)
                if padding:
                    continue
                # pg_loss and kl_loss are this micro-batch's share of the global mini-batch sum
                # already; per-micro ratios (clip fraction, approx KL) are weighted by its share
                # of the global tokens. Summed over micro-batches and ranks, both are global.
                _mean_metrics(shares, {k: v for k, v in parts.items() if k != "entropy"}, 1.0)
                _mean_metrics(shares, {"entropy": parts["entropy"]}, weight)
                _mean_metrics(shares, pg_metrics, weight)
            step_info = strategy.step()
            if strategy.world_size > 1:
                names = sorted(shares)
                summed = strategy.all_reduce_sum(torch.tensor([shares[k] for k in names], dtype=torch.float64))
                shares = dict(zip(names, summed.tolist()))
            _mean_metrics(metrics, {**shares, **step_info}, 1.0)
            n_updates += 1
    if on_policy:
        given_old = torch.empty(B, T, dtype=torch.float32, device=batch["response_mask"].device)
        for rows_in_mini, values in taken:  # a rank with no rows of its own ran padding passes only
            given_old[order[rows_in_mini]] = values.to(given_old.device)  # one mini-batch: row i is order[i]
    return PolicyUpdate({**{k: v / n_updates for k, v in metrics.items()}, **correction_metrics}, given_old)
