"""The update skeleton (rltk.training.updates.update_loop) on a stub strategy: its draws, steps and averages by hand."""

from __future__ import annotations

import contextlib

import torch

from rltk.strategies.base import TrainingStrategy
from rltk.strategies.layout import ParallelLayout
from rltk.training.step.forward import ForwardSettings
from rltk.training.updates.update_loop import MicroLoss, optimizer_epochs


class StubStrategy:
    """Records backwards and steps; ``world_size`` ranks that all hold this rank's numbers, the busiest
    of which runs ``busiest`` micro-batches."""

    device = torch.device("cpu")

    forward_backward, _check_split = TrainingStrategy.forward_backward, TrainingStrategy._check_split
    layout, _split_forwards = ParallelLayout(), 0  # data parallel only

    def __init__(self, world_size: int = 1, busiest: int = 0):
        self.world_size = self.data_world_size = world_size
        self.busiest = busiest
        self.backwards: list[float] = []
        self.steps = 0

    @contextlib.contextmanager
    def accumulate(self, is_last):
        yield

    @contextlib.contextmanager
    def autocast(self):
        yield

    def backward(self, loss):
        self.backwards.append(float(loss))

    def step(self):
        self.steps += 1
        return {"lr": torch.tensor(0.5)}

    def all_reduce_sum(self, tensor):
        return tensor * self.world_size

    def all_reduce_max(self, tensor):
        return tensor.clamp(min=self.busiest)


def rows(n: int) -> dict[str, torch.Tensor]:
    """``n`` rows of one prompt token and two response tokens, the second response token padding in odd rows."""
    response_mask = torch.tensor([[1.0, float(i % 2 == 0)] for i in range(n)]).reshape(n, 2)
    return {"input_ids": torch.arange(3 * n).reshape(n, 3), "attention_mask": torch.ones(n, 3),
            "response_mask": response_mask}


def counting_loss(seen: list):
    """A micro-loss whose loss is its row count and whose shares are its rows and its share of the tokens."""

    def micro_loss(mb, micro, *, mini):
        seen.append(mini.rows.tolist())
        return MicroLoss(torch.tensor(float(len(micro.rows))),
                         lambda: {"rows": len(micro.rows), "token_share": mini.token_share(mb["response_mask"])})

    return micro_loss


def test_each_epoch_draws_one_permutation_and_each_mini_batch_takes_one_step():
    generator = torch.Generator().manual_seed(5)
    strategy, seen = StubStrategy(), []
    metrics = optimizer_epochs(strategy, rows(6), counting_loss(seen), ForwardSettings(micro_batch_size=2),
                               epochs=2, mini_batches=2, generator=generator)
    # 2 epochs x 2 mini-batches of 3 rows, each cut into micro-batches of 2 and 1 rows
    replay = torch.Generator().manual_seed(5)
    expected = [part.tolist() for _ in range(2) for part in torch.randperm(6, generator=replay).tensor_split(2)]
    assert seen == [part for part in expected for _ in range(2)]
    assert torch.equal(generator.get_state(), replay.get_state())  # no other draw from the generator
    assert strategy.steps == 4 and strategy.backwards == [2.0, 1.0] * 4
    # per step: 3 rows and the whole of the mini-batch's tokens; the step info averaged too
    assert metrics == {"rows": 3.0, "token_share": 1.0, "lr": 0.5}


def test_a_rank_with_no_rows_in_a_mini_batch_pads_and_still_reports_every_name():
    # one row on this rank, two mini-batches: the second is empty here, so this rank runs padding
    # micro-batches only; the all-reduce of its metrics needs the same names as the busier rank's
    strategy, seen = StubStrategy(world_size=2, busiest=2), []
    metrics = optimizer_epochs(strategy, rows(1), counting_loss(seen), ForwardSettings(micro_batch_size=2),
                               epochs=1, mini_batches=2, generator=torch.Generator().manual_seed(0))
    assert seen == [[0], [0], [], []]  # two micro-batches a step, as many as the busiest rank
    assert strategy.backwards == [1.0, 0.0, 0.0, 0.0]  # padding is backwarded times 0
    # step 1: one real row, its tokens half the (doubled) global tokens; step 2: zeros; then x2 ranks
    assert metrics == {"rows": (2.0 + 0.0) / 2, "token_share": (1.0 + 0.0) / 2, "lr": 0.5}
