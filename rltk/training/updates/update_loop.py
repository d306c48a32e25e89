"""The loop every update runs: epochs over shuffled mini-batches, one optimizer step per mini-batch, each
step accumulated over micro-batches whose losses are shares of the mini-batch's.

:func:`optimizer_epochs` is the skeleton of :func:`rltk.training.updates.rl.policy_update` and
:func:`rltk.training.updates.ppo.critic_update`; :func:`optimizer_step`, one mini-batch of it, that of
:func:`rltk.training.updates.preference.preference_step` and :func:`rltk.training.updates.sft.sft_step`. What differs
between them is the loss of one micro-batch, passed in as a function (the *micro-loss*)::

    micro_loss(mb, micro[, mini]) -> MicroLoss(loss, shares)

``mb`` is the micro-batch's rows on the strategy's device, ``micro`` its
:class:`~rltk.training.step.micro_batches.MicroBatch`, ``mini`` the :class:`MiniBatch` around it (its rows and
global counts; :func:`optimizer_epochs` only). ``loss`` is the micro-batch's share of the mini-batch loss,
normalised by *global* counts (summed over micro-batches and ranks), so the summed gradient is that of one
large batch whatever the micro-batch size and process count. ``shares()`` is read after the backward and
gives the micro-batch's share of each logged number: summed over micro-batches and ranks, each is the
mini-batch's.

What the skeleton owns, so that no update writes it again: the shuffle (one ``randperm`` of the batch per
epoch from ``generator``: seeded runs depend on the order of these draws), the all-reduced counts, the
lockstep of ranks (every rank runs as many micro-batches as the busiest; padding ones are backwarded times
0 and add nothing), the optimizer step, and the metrics: summed over micro-batches and ranks per step,
averaged over steps. The micro-batch schedule itself (autocast around the forward, the backward outside it,
gradient sync in the last) is the strategy's :meth:`~rltk.strategies.base.TrainingStrategy.forward_backward`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple

import torch

from rltk.algorithms.aggregation import loss_agg_normalisers
from rltk.batch import slice_batch
from rltk.training.step.micro_batches import MicroBatch
from rltk.training.step.ranks import check_mini_batches

__all__ = ["MicroLoss", "MiniBatch", "optimizer_epochs", "optimizer_step", "shares", "updates_per_step"]


class MicroLoss(NamedTuple):
    """What a micro-loss returns for one micro-batch."""

    #: its share of the mini-batch loss (0-dim, with gradient): the skeleton backwards it
    loss: torch.Tensor
    #: its share of each logged number, read after the backward (a padding micro-batch's only for the names)
    shares: Callable[[], dict[str, float]]


@dataclass(frozen=True)
class MiniBatch:
    """The mini-batch a micro-batch belongs to: its rows and its counts over every rank."""

    #: the mini-batch's rows, as indices into the whole batch. Shape: (b,)
    rows: torch.Tensor
    #: response tokens of the mini-batch, summed over ranks (the ``token-mean`` denominator)
    global_tokens: float
    #: sequences of the mini-batch, summed over ranks (the ``seq-mean-*`` denominator)
    global_seqs: float

    def loss_agg(self, loss_agg: Callable, **args: Any) -> Callable:
        """``loss_agg`` bound to these global counts and its own ``args``: ``(loss_mat, mask) -> scalar``."""
        return functools.partial(loss_agg, global_tokens=self.global_tokens, global_seqs=self.global_seqs, **args)

    def token_share(self, response_mask: torch.Tensor) -> float:
        """A micro-batch's fraction of the mini-batch's global tokens: the weight of its per-token means."""
        return response_mask.sum().item() / max(self.global_tokens, 1.0)


def shares(values: dict[str, Any], weight: float = 1.0) -> dict[str, float]:
    """``values`` (tensors or numbers) as floats times ``weight``: a micro-batch's shares of logged numbers.

    A number that is already the micro-batch's share of a mini-batch sum takes weight 1; a mean over the
    micro-batch's tokens takes its :meth:`MiniBatch.token_share`.
    """
    return {k: float(v.detach().item() if isinstance(v, torch.Tensor) else v) * weight for k, v in values.items()}


def optimizer_step(strategy, micro_batches: Iterable[MicroBatch],
                   micro_loss: Callable[[dict[str, torch.Tensor], MicroBatch], MicroLoss],
                   ) -> tuple[dict[str, float], dict[str, float]]:
    """Accumulate ``micro_loss`` over ``micro_batches`` (the strategy's schedule:
    :meth:`rltk.strategies.base.TrainingStrategy.forward_backward`), then take one optimizer step.

    Every rank must pass as many micro-batches as the busiest (sharded engines gather parameters in each
    forward; DDP all-reduces in the last backward): the padding ones are backwarded times 0, and add 0
    under each of their names, so every rank holds the same names for the all-reduce.

    Returns ``(metrics, step info)``: each metric's micro-batch shares summed over micro-batches and ranks,
    and the strategy's step info (``grad_norm``, ``lr``, ``skipped``) as floats.
    """
    totals = strategy.forward_backward(micro_batches, micro_loss)
    info = {k: float(v) for k, v in strategy.step().items()}
    if strategy.data_world_size > 1:  # every data rank's shares add up to the global numbers
        names = sorted(totals)
        summed = strategy.all_reduce_sum(torch.tensor([totals[k] for k in names], dtype=torch.float64))
        totals = dict(zip(names, summed.tolist()))
    return totals, info


def updates_per_step(cfg) -> int:
    """Optimizer steps one RL step takes, ``trainer.mini_batches * trainer.ppo_epochs`` (what an RL stage's
    LR schedule counts: one :func:`optimizer_epochs` per step)."""
    return cfg.trainer.mini_batches * cfg.trainer.ppo_epochs


def optimizer_epochs(strategy, batch: dict[str, torch.Tensor],
                     micro_loss: Callable[[dict[str, torch.Tensor], MicroBatch, MiniBatch], MicroLoss],
                     settings, *, epochs: int, mini_batches: int,
                     generator: torch.Generator | None = None) -> dict[str, float]:
    """``epochs`` passes over ``batch`` in ``mini_batches`` shuffled mini-batches, one optimizer step each.

    Each epoch draws one permutation of the rows from ``generator`` (the global generator when None) and
    cuts it into ``mini_batches`` parts whose sizes differ by at most one row (see
    :func:`rltk.training.step.ranks.check_mini_batches`). A mini-batch's token and sequence counts are summed over
    ranks (:class:`MiniBatch`), its micro-batches cut by ``settings``
    (:class:`rltk.training.step.forward.ForwardSettings`; a rank with no rows in it runs padding ones from
    ``batch``) and run by :func:`optimizer_step` with ``micro_loss(mb, micro, mini)``.

    Returns each metric and step-info number averaged over the ``epochs * mini_batches`` optimizer steps.
    """
    if mini_batches < 1:
        raise ValueError(f"mini_batches must be at least 1, got {mini_batches} (trainer.mini_batches)")
    B = batch["input_ids"].shape[0]
    check_mini_batches(strategy, B, mini_batches)
    totals: dict[str, float] = {}
    for _ in range(epochs):
        order = torch.randperm(B, generator=generator)
        for rows in order.tensor_split(mini_batches):
            part = slice_batch(batch, rows)
            local = loss_agg_normalisers(part["response_mask"])
            counts = torch.tensor([float(local["global_tokens"]), float(local["global_seqs"])], dtype=torch.float64)
            global_tokens, global_seqs = strategy.all_reduce_sum(counts).tolist()
            mini = MiniBatch(rows, global_tokens, global_seqs)
            metrics, info = optimizer_step(strategy, settings.micro_batches(strategy, part, fallback=batch),
                                           functools.partial(micro_loss, mini=mini))
            for name, value in {**metrics, **info}.items():
                totals[name] = totals.get(name, 0.0) + value
    return {name: total / (epochs * mini_batches) for name, total in totals.items()}
