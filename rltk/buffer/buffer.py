"""The experience buffer: experiences in arrival order, each tagged with its step, source and policy version.

Workflows' experiences go in with :meth:`ExperienceBuffer.put`; a sample
strategy (:mod:`rltk.buffer.strategies`) decides which come out for the
trainer, and removes them. The buffer itself has no policy: it stores, finds
and removes, oldest first.

**Policy versions and staleness**, one definition for the whole package (the
experience queue's bound and ``staleness/*`` metrics, the rollout traces):
versions count an RL stage's steps, the weights before step ``s`` being
version :func:`trainer_version` ``(s) = s - 1`` (the stage's starting weights
are version 0, after a resume the resumed step); an experience's
:func:`staleness` is the version of the trainer that trains it minus the
version that sampled its oldest token (0 on-policy).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

if TYPE_CHECKING:  # the experiences are only passed on here: no torch to import
    from rltk.batch import Experience


POLICY = "policy"


def trainer_version(step: int) -> int:
    """The policy version RL step ``step`` (of a stage, counted from 1) trains: the weights before its update."""
    return step - 1


def staleness(version: int, sampled_version: int) -> int:
    """How many policy versions an experience lags the trainer: ``version`` (the trainer's, the weights the step
    updates) minus ``sampled_version`` (the policy that sampled the experience's oldest token). 0 on-policy."""
    return version - sampled_version


@dataclass(frozen=True)
class BufferItem:
    """One stored experience, the training step it was put in at, where it came from, and which policy sampled it.

    ``source`` is ``"policy"`` for the policy's own rollouts; other names mark
    other streams (``"expert"`` demonstrations for the ``mix_expert`` strategy).
    ``version`` is the policy version that sampled its oldest token; ``None``
    means the weights of step ``step`` (``trainer_version(step)``, as a
    synchronous run samples). See :attr:`sampled_version`.
    """

    experience: Experience
    step: int
    source: str = POLICY
    version: int | None = None

    @property
    def sampled_version(self) -> int:
        """The policy version that sampled it (its oldest token's)."""
        return trainer_version(self.step) if self.version is None else self.version


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

    def put(self, experiences: Iterable[Experience], step: int, source: str = POLICY,
            versions: Sequence[int] | None = None) -> None:
        """Append ``experiences`` produced at training step ``step``, in their order.

        ``versions[i]`` is the policy version that sampled ``experiences[i]``'s oldest token (an asynchronous run's
        producer); ``None``: the weights of step ``step`` sampled them all.
        """
        from rltk.batch import Experience  # here, not at the top: the buffer's import needs no torch

        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"ExperienceBuffer.put: step must be an integer training step, got {step!r}")
        if not isinstance(source, str) or not source:
            raise TypeError(f"ExperienceBuffer.put: source must be a non-empty string, got {source!r}")
        experiences = list(experiences)
        if versions is not None and len(versions) != len(experiences):
            raise ValueError(f"ExperienceBuffer.put: {len(versions)} versions for {len(experiences)} experiences; "
                             f"give one per experience (the version of its oldest token), or None")
        new = []
        for index, experience in enumerate(experiences):
            if not isinstance(experience, Experience):
                raise TypeError(
                    f"ExperienceBuffer.put: item {index} is a {type(experience).__name__}, "
                    f"not a rltk.batch.Experience"
                )
            new.append(BufferItem(experience, step, source, None if versions is None else int(versions[index])))
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

        ``{"evicted": int, "items": [{"step", "source", "version", "experience": {field: value}}, ...]}``,
        oldest first (``version`` ``None``: the weights of ``step``; a state
        without it, saved before versions were kept, loads so). A sample
        strategy that leaves experiences for later steps (``staleness`` with a
        ``batch_size``) trains a resumed run on exactly what the uninterrupted
        run would have; on-policy strategies empty the buffer every step, so
        their state is an empty list. Floats survive JSON exactly; an
        experience's ``info`` must hold JSON-able values.
        """
        return {
            "evicted": self.evicted,
            "items": [{"step": item.step, "source": item.source, "version": item.version,
                       "experience": _experience_state(item.experience)} for item in self._items],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents with those of a :meth:`state_dict` (e.g. read back from a checkpoint).

        Raises ``ValueError`` naming the offending item when an entry is not a
        stored experience, and when the items exceed this buffer's ``capacity``.
        """
        from rltk.batch import Experience

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
                items.append(BufferItem(Experience(**entry["experience"]), entry["step"], entry["source"],
                                        entry.get("version")))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"ExperienceBuffer.load_state_dict: state['items'][{index}] is not a stored "
                                 f"experience ({type(exc).__name__}: {exc})") from exc
        self._items = items
        self.evicted = evicted


def _experience_state(experience: Experience) -> dict[str, Any]:
    """An experience's fields, JSON-able: a VLM prompt's images as their processor outputs
    (:meth:`rltk.batch.PromptImages.state`), which is all the trainer reads of them."""
    vision = experience.vision
    state = dataclasses.asdict(dataclasses.replace(experience, vision=None))
    state["vision"] = None if vision is None else vision.state()
    return state
