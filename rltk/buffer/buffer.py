"""The experience buffer: experiences in arrival order, each tagged with its step and source.

Workflows' experiences go in with :meth:`ExperienceBuffer.put`; a sample
strategy (:mod:`rltk.buffer.strategies`) decides which come out for the
trainer, and removes them. The buffer itself has no policy: it stores, finds
and removes, oldest first.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from rltk.batch import Experience

POLICY = "policy"


@dataclass(frozen=True)
class BufferItem:
    """One stored experience, the training step it was produced at, and where it came from.

    ``source`` is ``"policy"`` for the policy's own rollouts; other names mark
    other streams (``"expert"`` demonstrations for the ``mix_expert`` strategy).
    """

    experience: Experience
    step: int
    source: str = POLICY


class ExperienceBuffer:
    """Experiences oldest first, with the step and source each was put in with.

    Args:
        capacity: keep at most this many experiences; putting more evicts the
            oldest and counts them in :attr:`evicted`. ``None`` means no limit
            (on-policy strategies empty the buffer every step anyway).
    """

    def __init__(self, capacity: int | None = None):
        if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1):
            raise ValueError(f"ExperienceBuffer: capacity must be an integer >= 1 or None, got {capacity!r}")
        self.capacity = capacity
        self.evicted = 0
        self._items: list[BufferItem] = []

    def put(self, experiences: Iterable[Experience], step: int, source: str = POLICY) -> None:
        """Append ``experiences`` produced at training step ``step``, in their order."""
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"ExperienceBuffer.put: step must be an integer training step, got {step!r}")
        if not isinstance(source, str) or not source:
            raise TypeError(f"ExperienceBuffer.put: source must be a non-empty string, got {source!r}")
        new = []
        for index, experience in enumerate(experiences):
            if not isinstance(experience, Experience):
                raise TypeError(
                    f"ExperienceBuffer.put: item {index} is a {type(experience).__name__}, "
                    f"not a rltk.batch.Experience"
                )
            new.append(BufferItem(experience, step, source))
        self._items.extend(new)
        if self.capacity is not None and len(self._items) > self.capacity:
            overflow = len(self._items) - self.capacity
            self.evicted += overflow
            del self._items[:overflow]

    def __len__(self) -> int:
        return len(self._items)

    def items(self, source: str | None = None) -> list[BufferItem]:
        """The stored items, oldest first (a copy; of one ``source`` if given)."""
        return [item for item in self._items if source is None or item.source == source]

    def latest_step(self, source: str | None = None) -> int | None:
        """The newest step among the stored items (of ``source``), ``None`` if there are none."""
        steps = [item.step for item in self._items if source is None or item.source == source]
        return max(steps) if steps else None

    def take(self, predicate: Callable[[BufferItem], bool]) -> list[BufferItem]:
        """Remove and return every item for which ``predicate`` is true, oldest first."""
        taken, kept = [], []
        for item in self._items:
            (taken if predicate(item) else kept).append(item)
        self._items = kept
        return taken

    def drop(self, predicate: Callable[[BufferItem], bool]) -> int:
        """Remove every item for which ``predicate`` is true; returns how many."""
        return len(self.take(predicate))

    def pop(self, count: int | None = None, source: str | None = None) -> list[BufferItem]:
        """Remove and return the ``count`` oldest items (of ``source``); all of them if ``None``."""
        if count is not None and (not isinstance(count, int) or count < 0):
            raise ValueError(f"ExperienceBuffer.pop: count must be an integer >= 0 or None, got {count!r}")
        chosen: set[int] = set()
        for position, item in enumerate(self._items):
            if count is not None and len(chosen) >= count:
                break
            if source is None or item.source == source:
                chosen.add(position)
        taken = [item for position, item in enumerate(self._items) if position in chosen]
        self._items = [item for position, item in enumerate(self._items) if position not in chosen]
        return taken

    def drop_older_than(self, min_step: int, source: str | None = None) -> int:
        """Remove items produced before ``min_step`` (of ``source``); returns how many."""
        return self.drop(lambda item: item.step < min_step and (source is None or item.source == source))

    def clear(self) -> int:
        """Remove everything; returns how many items were dropped."""
        count = len(self._items)
        self._items = []
        return count

    def state_dict(self) -> dict[str, Any]:
        """The stored items and the eviction count, JSON-able, for a checkpoint.

        ``{"evicted": int, "items": [{"step", "source", "experience": {field: value}}, ...]}``,
        oldest first. A sample strategy that leaves experiences for later steps
        (``staleness`` with a ``batch_size``) trains a resumed run on exactly
        what the uninterrupted run would have; on-policy strategies empty the
        buffer every step, so their state is an empty list. Floats survive JSON
        exactly; an experience's ``info`` must hold JSON-able values.
        """
        return {
            "evicted": self.evicted,
            "items": [{"step": item.step, "source": item.source, "experience": dataclasses.asdict(item.experience)}
                      for item in self._items],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents with those of a :meth:`state_dict` (e.g. read back from a checkpoint).

        Raises ``ValueError`` naming the offending item when an entry is not a
        stored experience, and when the items exceed this buffer's ``capacity``.
        """
        if not isinstance(state, dict) or set(state) != {"evicted", "items"} or not isinstance(state["items"], list):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"ExperienceBuffer.load_state_dict: expected {{'evicted': int, 'items': list}} as "
                             f"ExperienceBuffer.state_dict() returns, got {got}")
        evicted = state["evicted"]
        if isinstance(evicted, bool) or not isinstance(evicted, int) or evicted < 0:
            raise ValueError(
                f"ExperienceBuffer.load_state_dict: state['evicted'] = {evicted!r} must be an integer >= 0")
        if self.capacity is not None and len(state["items"]) > self.capacity:
            raise ValueError(f"ExperienceBuffer.load_state_dict: {len(state['items'])} items do not fit this "
                             f"buffer's capacity={self.capacity}")
        items = []
        for index, entry in enumerate(state["items"]):
            try:
                items.append(BufferItem(Experience(**entry["experience"]), entry["step"], entry["source"]))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"ExperienceBuffer.load_state_dict: state['items'][{index}] is not a stored "
                                 f"experience ({type(exc).__name__}: {exc})") from exc
        self._items = items
        self.evicted = evicted
