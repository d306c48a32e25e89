"""The advantage estimator as the loop calls it: its signature read once, its fields gathered over ranks.

The estimator declares the batch fields it needs by naming them (see
:mod:`rltk.algorithms.advantages`); :class:`Estimator` reads that once and
calls it on the global batch.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from rltk.batch import ROW_SUMS, refresh_row_sums
from rltk.training.scaffold.setup import args_of


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
        if strategy is None or strategy.data_world_size == 1:
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
            start = sum(counts[: strategy.data_rank])
            advantages = advantages[start : start + B, :T].contiguous()
            returns = returns[start : start + B, :T].contiguous()
        return advantages.float(), returns.float()


def compute_advantages(adv_fn: Callable, batch: dict[str, torch.Tensor], args: dict, strategy=None) -> None:
    """Fill ``batch["advantages"]`` and ``batch["returns"]`` with ``adv_fn`` (see :meth:`Estimator.__call__`,
    which returns them instead; a loop builds its :class:`Estimator` once per stage)."""
    batch["advantages"], batch["returns"] = Estimator.of(adv_fn, args)(batch, strategy)
