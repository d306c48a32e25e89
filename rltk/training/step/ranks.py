"""Numbers every rank agrees on: maxima, sums and flags over the ranks of a training strategy.

Each works without a strategy or with one process (it returns the local value), so the loop calls
them the same way on one process or many. Collective otherwise: every rank calls them together.
"""

from __future__ import annotations

import torch


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
    largest = all_ranks_max(strategy, local_rows)
    if largest < mini_batches:
        raise ValueError(
            f"the largest rank's rollout batch has {largest} sequences, fewer than trainer.mini_batches="
            f"{mini_batches}; lower trainer.mini_batches or sample more (trainer.prompts_per_step, rollout.n)"
        )


def all_ranks_max(strategy, local_count: int) -> int:
    """The largest ``local_count`` over ranks (``local_count`` without a strategy).

    Sharded engines gather parameters inside every forward, a collective: a
    rank that ran fewer forwards than another would leave it waiting forever.
    """
    if strategy is None or strategy.data_world_size == 1:
        return local_count
    return int(strategy.all_reduce_max(torch.tensor([local_count], dtype=torch.int64)).item())


def global_masked_mean(values: torch.Tensor, mask: torch.Tensor, strategy=None) -> float:
    """``sum(values * mask) / sum(mask)`` over every rank's tokens (0 when there are none)."""
    local = torch.stack([(values.detach().double() * mask).sum(), mask.double().sum()]).cpu()
    total, count = (local if strategy is None else strategy.all_reduce_sum(local)).tolist()
    return total / count if count else 0.0


def any_rank(strategy, flag: bool) -> bool:
    """True on every rank if ``flag`` is True on at least one."""
    if strategy is None or strategy.data_world_size == 1:
        return flag
    return bool(strategy.all_reduce_sum(torch.tensor([float(flag)])).item() > 0)




def rows_in(batch: dict[str, torch.Tensor], strategy) -> int:
    """The batch's sequences summed over ranks: what the adaptive KL controller counts as steps."""
    return int(strategy.all_reduce_sum(torch.tensor([batch["input_ids"].shape[0]])).item())
