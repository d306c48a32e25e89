"""What every metric logger implements, and the value conversion they share.

A logger is a class registered under kind ``logger`` (see
``rltk/loggers/builtin.py``). The recipe builds it on the main rank as
``cls(run_dir=Path, config=dict, total_steps=int, **args)``, calls
``log(metrics, step)`` after every step and ``close()`` once at the end. On
resume it passes ``resume_step=<step of the checkpoint>`` so that no curve shows
the steps after the checkpoint twice.

What a logger can do beyond ``log`` and ``close`` is declared on :class:`Logger`, with no-op defaults:
``set_stages(stages)`` (the run's stages as spans of global steps, called before the first ``log`` and again
when a stage stops before its cap) and ``truncate_after(step)`` (a resumed run drops rows a file logger wrote
after the checkpoint). rltk's loggers subclass it; a plugin's logger that only has ``log`` and ``close``
(the :class:`MetricLogger` protocol) is wrapped by :func:`as_logger` once, when it is built, so the trainer
calls every method on every logger.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable


@runtime_checkable
class MetricLogger(Protocol):
    """The interface of a registered logger (structural: no base class needed)."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` for optimizer step ``step`` (called in increasing step order)."""

    def close(self) -> None:
        """Flush and release files or connections; safe to call twice."""


@dataclass(frozen=True)
class StageSpan:
    """One stage of a run as loggers see it: it owns global steps ``first_step + 1 .. last_step``.

    ``name`` is the stage's name in the config (``stages[i].name``, e.g.
    ``warmup``) and ``type`` its runner (``sft`` or ``rl``). ``cap``: ``steps``
    is the most the stage runs, and it may stop before (a warm-up that ends on
    reaching ``sft.stop_at_accuracy``); when it does, the run numbers the next
    stage's steps from where it stopped and gives the loggers the spans again
    (:func:`stage_ended`).
    """

    name: str
    type: str
    first_step: int
    steps: int
    cap: bool = False

    @property
    def last_step(self) -> int:
        """The global step of this stage's last step."""
        return self.first_step + self.steps


def stage_spans(stages: Sequence[tuple]) -> list[StageSpan]:
    """``(name, type, steps)`` or ``(name, type, steps, cap)`` of consecutive stages as spans of global steps."""
    spans, first = [], 0
    for name, kind, steps, *cap in stages:
        spans.append(StageSpan(str(name), str(kind), first, int(steps), bool(cap and cap[0])))
        first += int(steps)
    return spans


def stage_ended(spans: Sequence[StageSpan], index: int, last_step: int) -> list[StageSpan]:
    """``spans`` once stage ``index`` has ended at global step ``last_step``: its span ends there (no longer a
    cap) and the later stages follow it, each as long as before."""
    spans = list(spans)
    ended = spans[index]
    shift = last_step - ended.last_step
    spans[index] = StageSpan(ended.name, ended.type, ended.first_step, last_step - ended.first_step)
    for later in range(index + 1, len(spans)):
        span = spans[later]
        spans[later] = StageSpan(span.name, span.type, span.first_step + shift, span.steps, span.cap)
    return spans


class Logger:
    """A base for loggers: :meth:`log` to write, the rest declared with defaults a logger may override."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` for step ``step`` (called in increasing step order)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement log()")

    def close(self) -> None:
        """Flush and release files or connections; safe to call twice."""

    def set_stages(self, stages: Sequence[StageSpan]) -> None:
        """The run's stages as spans of global steps, before the first :meth:`log` (the console's ETA is per
        stage), and again when a stage that may stop early has stopped (its span ends where it did, the
        later ones follow it); a logger that does not show stages ignores them."""

    def truncate_after(self, step: int, *, keep_at_step: int | None = None) -> int:
        """Drop what was logged after ``step`` (and past the first ``keep_at_step`` rows at it), for a run
        resumed from the checkpoint of ``step``; returns how many rows went. Nothing to drop by default."""
        return 0


class _ProtocolLogger(Logger):
    """A logger written against :class:`MetricLogger` alone (a plugin's), with the methods it has of
    :class:`Logger`'s and the defaults for the rest."""

    def __init__(self, logger: Any):
        self.logger = logger
        self.log, self.close = logger.log, logger.close
        for name in ("set_stages", "truncate_after"):  # read once, here, so no caller probes a logger
            method = getattr(logger, name, None)
            if callable(method):
                setattr(self, name, method)


def as_logger(logger: Any) -> Logger:
    """``logger`` as a :class:`Logger`: itself if it subclasses it, else wrapped once."""
    return logger if isinstance(logger, Logger) else _ProtocolLogger(logger)


def scalar(key: str, value: Any) -> float:
    """``value`` as a Python float: accepts ints, floats, bools, numpy scalars and one-element tensors/arrays.

    Raises ``TypeError`` naming ``key`` for anything else (strings, lists, ...).
    """
    if isinstance(value, numbers.Real):  # int, float, bool and numpy's int/float scalars
        return float(value)
    numel = getattr(value, "numel", None)  # torch.Tensor
    size = getattr(value, "size", None)  # numpy array or scalar
    if (callable(numel) and numel() == 1) or (isinstance(size, int) and size == 1 and hasattr(value, "item")):
        item = value.item()
        if isinstance(item, numbers.Real):
            return float(item)
    raise TypeError(
        f"metric '{key}' has value {value!r} of type {type(value).__name__}; loggers take numbers "
        "(int, float, numpy scalar or one-element tensor)."
    )


def scalar_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Every metric converted by :func:`scalar` (an unconvertible one is an error naming it)."""
    return {str(k): scalar(str(k), v) for k, v in metrics.items()}


def finite_or_none(value: float) -> float | None:
    """``value``, or ``None`` for NaN/inf (strict JSON has no NaN)."""
    return value if math.isfinite(value) else None


def as_path(run_dir: str | Path | None, logger_name: str) -> Path:
    """``run_dir`` as a ``Path``; a clear error when a file logger got none."""
    if run_dir is None:
        raise ValueError(f"the '{logger_name}' logger writes files and needs run_dir=<folder>, got None.")
    return Path(run_dir)
