"""The advantage pass and the policy-gradient update shared by the RL recipes.

Pure mechanics (micro-batching, global normalisers, loss assembly); every
algorithmic choice arrives as a component from the registry:
:class:`LossComponents` (policy loss, aggregation, KL, entropy) and
:class:`Estimator` (the advantage function, its signature read once). The
no-gradient passes before the update are :mod:`rltk.training.forward`.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from rltk.algorithms.aggregation import loss_agg_normalisers, masked_mean
from rltk.algorithms.mismatch import correction_active
from rltk.batch import ROW_SUMS, refresh_row_sums, slice_batch
from rltk.training.forward import ForwardSettings
from rltk.training.rollout_correction import WEIGHTS_KEY, apply_rollout_correction, weighted_loss_agg


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
        from rltk.training.setup import args_of

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


def build_kl_controller(cfg):
    """``algorithm.kl_controller``: a fixed coefficient or the adaptive target-KL rule."""
    from rltk.algorithms.kl import AdaptiveKLController, FixedKLController

    a = cfg.algorithm
    if a.kl_controller == "adaptive":
        return AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon)
    return FixedKLController(a.kl_coef)


def check_mini_batches(strategy, local_rows: int, mini_batches: int) -> None:
    """Refuse a rollout batch that cannot fill ``trainer.mini_batches`` mini-batches.

    Each rank cuts its rows into ``mini_batches`` parts whose sizes differ by
    at most one (a sample strategy can leave any number of rows), and
    mini-batch ``m`` is part ``m`` of every rank. A rank with fewer rows than
    ``mini_batches`` leaves some parts empty (it then runs zero-weight passes
    in them); every mini-batch holds a row as long as the largest rank has
    ``mini_batches`` rows. The test is on a global number, so every rank
    raises or none does.
    """
    largest = lockstep_count(strategy, local_rows)
    if largest < mini_batches:
        raise ValueError(
            f"the largest rank's rollout batch has {largest} sequences, fewer than trainer.mini_batches="
            f"{mini_batches}; lower trainer.mini_batches or sample more (trainer.prompts_per_step, rollout.n)"
        )


def lockstep_count(strategy, local_count: int) -> int:
    """The largest ``local_count`` over ranks (``local_count`` without a strategy).

    Sharded engines gather parameters inside every forward, a collective: a
    rank that ran fewer forwards than another would leave it waiting forever.
    """
    if strategy is None or strategy.world_size == 1:
        return local_count
    return int(strategy.all_reduce_max(torch.tensor([local_count], dtype=torch.int64)).item())


def lockstep_micro_batches(strategy, rows: dict[str, torch.Tensor], micro_batch_size: int, *,
                           fallback: dict[str, torch.Tensor] | None = None):
    """Yield ``(micro_batch, is_last, padding)`` over ``rows``, the same number of times on every rank.

    A rank with fewer micro-batches than the busiest one (see
    :func:`lockstep_count`) then yields its first micro-batch again with
    ``padding=True``: run it (forward, and backward with the loss times 0) and
    discard the result. A rank with no rows repeats the first micro-batch of
    ``fallback`` instead (the whole rollout batch around an empty mini-batch).
    """
    n_rows = rows["input_ids"].shape[0]
    starts = list(range(0, n_rows, micro_batch_size))
    total = lockstep_count(strategy, len(starts))
    source = rows if n_rows or fallback is None else fallback
    for i in range(total):
        padding = i >= len(starts)
        start = 0 if padding else starts[i]
        yield slice_batch(source, slice(start, start + micro_batch_size)), i == total - 1, padding


def global_masked_mean(values: torch.Tensor, mask: torch.Tensor, strategy=None) -> float:
    """``sum(values * mask) / sum(mask)`` over every rank's tokens (0 when there are none)."""
    local = torch.stack([(values.detach().double() * mask).sum(), mask.double().sum()]).cpu()
    total, count = (local if strategy is None else strategy.all_reduce_sum(local)).tolist()
    return total / count if count else 0.0


def any_rank(strategy, flag: bool) -> bool:
    """True on every rank if ``flag`` is True on at least one."""
    if strategy is None or strategy.world_size == 1:
        return flag
    return bool(strategy.all_reduce_sum(torch.tensor([float(flag)])).item() > 0)


def needs_sum_pi_squared(advantage_fn: Callable) -> bool:
    """Whether the estimator names ``sum_pi_squared`` (the optimal token baseline): only then does the
    old-log-prob pass compute it."""
    return Estimator.of(advantage_fn).names("sum_pi_squared")


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator, its configured arguments, and the parameters of its signature, read once.

    The estimator declares the batch fields it needs by naming them (see
    :mod:`rltk.algorithms.advantages`); everything the loop decides from that
    (a greedy baseline, ``sum_pi_squared`` in the old-log-prob pass, whether
    the update may take the old log-probs itself) asks this object instead of
    reading the signature again. ``params`` is None for a callable whose
    signature cannot be read: it names nothing the loop can see.
    """

    fn: Callable
    args: dict = field(default_factory=dict)
    params: Any = None  # inspect's parameters mapping, or None

    @classmethod
    def of(cls, fn: Callable, args: dict | None = None) -> "Estimator":
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # no signature to read
            params = None
        return cls(fn, dict(args or {}), params)

    @classmethod
    def from_config(cls, cfg) -> "Estimator":
        """``algorithm.advantage_fn`` from the registry, with ``algorithm.advantage_fn_args``."""
        from rltk import get_component
        from rltk.training.setup import args_of

        return cls.of(get_component("advantage_fn", cfg.algorithm.advantage_fn), args_of(cfg, "algorithm.advantage_fn"))

    @property
    def readable(self) -> bool:
        return self.params is not None

    def names(self, field_name: str) -> bool:
        """Whether the estimator's signature names ``field_name``."""
        return self.params is not None and field_name in self.params

    def __call__(self, batch: dict[str, torch.Tensor], strategy=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(advantages, returns)``, ``[B, T]`` fp32 each, from the batch fields the estimator names.

        With several ranks it sees the *global* batch: the fields are gathered from every
        rank (rows in rank order, widths padded with zeros, which the response mask
        marks as padding), every rank computes the same result, and each keeps its
        own rows. Batch statistics (the whitening of ``gae`` and the REINFORCE++
        family, or anything a plugin computes over the batch) are then those of one
        process holding the whole batch. Group ids are made distinct per rank: a
        rank samples every response of its prompts, so a group never spans ranks,
        while the workflows number groups per process.

        ``sequence_rewards`` / ``policy_lengths`` (the ``[B]`` row sums an outcome
        estimator may name) are passed only as the row sums of the batch's current
        ``token_rewards`` / ``response_mask``: :func:`rltk.batch.refresh_row_sums`
        retakes them when those tensors were replaced (a KL penalty folded into the
        rewards) or written in place since ``collate`` summed them. Each rank sums
        its own rows before the gather.
        """
        params, args = self.params, self.args
        if params is None:  # the error inspect gives for a callable it cannot read
            params = inspect.signature(self.fn).parameters
        missing = [
            n for n, p in params.items()
            if p.default is inspect.Parameter.empty and n not in batch and n not in args
            and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        ]
        if missing:
            raise ValueError(
                f"advantage function needs batch field(s) {missing} that this recipe does not provide "
                f"(available: {sorted(batch)}); choose another algorithm.advantage_fn "
                f"(e.g. 'values' needs the ppo recipe's critic)"
            )
        # A stale sum would silently change R_i: never pass one (costs a row sum only when retaken).
        refresh_row_sums(batch, [name for name in ROW_SUMS if name in params and name not in args])
        fields = {k: v for k, v in batch.items() if k in params and k not in args}
        if strategy is None or strategy.world_size == 1:
            advantages, returns = self.fn(**fields, **args)
        else:
            B, T = batch["response_mask"].shape
            gathered, counts = {}, []
            for name, value in fields.items():
                gathered[name], counts = strategy.gather_rows(value)
            if "group_ids" in gathered:
                rank_of_row = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
                pairs = torch.stack([rank_of_row, gathered["group_ids"].to(torch.int64).cpu()], dim=1)
                gathered["group_ids"] = torch.unique(pairs, dim=0, return_inverse=True)[1].to(
                    batch["group_ids"].device)
            advantages, returns = self.fn(**gathered, **args)
            start = sum(counts[: strategy.rank])
            advantages = advantages[start : start + B, :T].contiguous()
            returns = returns[start : start + B, :T].contiguous()
        return advantages.float(), returns.float()


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


def compute_advantages(adv_fn: Callable, batch: dict[str, torch.Tensor], args: dict, strategy=None) -> None:
    """Fill ``batch["advantages"]`` and ``batch["returns"]`` with ``adv_fn`` (see :meth:`Estimator.__call__`,
    which returns them instead; a loop builds its :class:`Estimator` once per stage)."""
    batch["advantages"], batch["returns"] = Estimator.of(adv_fn, args)(batch, strategy)


def rollout_metrics(batch: dict[str, torch.Tensor], workflow, sample_strategy, elapsed: float,
                    strategy=None) -> dict[str, float]:
    """What every RL step logs about its batch: reward, accuracy, lengths, throughput, plus the
    workflow's, reward functions' and sample strategy's own counters.

    Two sets of responses, named apart: ``batch`` is what the trainer read, *after* the sample
    strategy (filtered, mixed with expert data ...), and gives ``reward`` (mean score),
    ``accuracy`` (fraction with score >= 1), ``response_length``, ``tokens_per_s``,
    ``batch/samples`` and ``batch/groups``; the ``rollout/*`` and ``reward/*`` counters of the
    workflow (and ``rollout/reward``, ``rollout/accuracy``, ``rollout/samples``,
    ``rollout/groups`` of :func:`rltk.training.collect.collect_experiences`) describe everything
    it produced, *before* the sample strategy.

    With a ``strategy`` the numbers cover every rank: reward, accuracy and length are means over
    all responses, ``tokens_per_s`` and the ``batch/`` counts are totals, and the components'
    counters are averaged over ranks.
    """
    scores = batch["scores"].double().cpu()
    local = torch.stack([
        scores.sum(), (scores >= 1).double().sum(), batch["response_lengths"].double().sum().cpu(),
        torch.tensor(float(scores.numel()), dtype=torch.float64),
        batch["attention_mask"].double().sum().cpu(),
        torch.tensor(float(batch["group_ids"].unique().numel()), dtype=torch.float64),
    ])
    score_sum, correct, length_sum, n, tokens, groups = (
        local if strategy is None else strategy.all_reduce_sum(local)).tolist()
    counters = {
        **workflow.metrics(),
        **{f"reward_fn/{k}": v for k, v in workflow.reward.stats().items()},
        **sample_strategy.metrics(),
    }
    if strategy is not None and strategy.world_size > 1:
        every_rank = strategy.all_gather_object(counters)
        counters = {k: sum(float(c.get(k, 0.0)) for c in every_rank) / len(every_rank)
                    for k in sorted(set().union(*every_rank))}
    return {
        "reward": score_sum / max(n, 1),
        "accuracy": correct / max(n, 1),
        "response_length": length_sum / max(n, 1),
        "tokens_per_s": tokens / elapsed,
        "batch/samples": n,
        "batch/groups": groups,
        "time/step_s": elapsed,
        **counters,
    }


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
                        pg_loss, pg_metrics = loss.policy_loss(
                            logprobs=logprobs, old_logprobs=old_logprobs, advantages=mb["advantages"],
                            response_mask=mb["response_mask"], loss_agg=pg_agg, **loss.policy_loss_args,
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
