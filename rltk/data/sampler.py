"""A resumable, seeded order over dataset rows."""

from __future__ import annotations

import random


class RowSampler:
    """Yields batches of rows, reshuffled each epoch; its position is checkpointable.

    The order of epoch ``e`` is a permutation seeded by ``(seed, e)``, so
    ``state_dict()`` -> ``load_state_dict()`` continues with exactly the rows an
    uninterrupted run would have drawn.
    """

    def __init__(self, rows: list, batch_size: int, *, seed: int = 0, shuffle: bool = True):
        if not rows:
            raise ValueError("RowSampler needs at least one row (is the dataset empty after filtering?)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.rows = rows
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def next_batch(self) -> list:
        """The next ``batch_size`` rows, wrapping into a new epoch when one ends."""
        batch = []
        while len(batch) < self.batch_size:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.batch_size - len(batch), len(self._order) - self.position)
            batch.extend(self.rows[i] for i in self._order[self.position : self.position + take])
            self.position += take
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)
