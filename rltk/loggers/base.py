"""What every metric logger implements, and the value conversion they share.

A logger is a class registered under kind ``logger`` (see
``rltk/loggers/builtin.py``). The recipe builds it on the main rank as
``cls(run_dir=Path, config=dict, total_steps=int, **args)``, calls
``log(metrics, step)`` after every step and ``close()`` once at the end. On
resume it passes ``resume_step=<step of the checkpoint>`` so that no curve shows
the steps after the checkpoint twice.

A logger that wants the run's stages (a supervised warm-up, then RL, ...) as
spans of global steps defines ``set_stages(stages: list[StageSpan])``; the
recipe calls it once, right after construction and before the first ``log``.
It is optional: :func:`announce_stages` skips loggers without it, so loggers
written before stages existed keep working unchanged.
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
    reaching ``sft.stop_at_accuracy``); the next stage's steps still start
    after ``last_step``.
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


def announce_stages(logger: Any, stages: Sequence[StageSpan]) -> None:
    """Tell ``logger`` the run's stages if it has ``set_stages``; a logger without it needs nothing."""
    set_stages = getattr(logger, "set_stages", None)
    if callable(set_stages):
        set_stages(list(stages))


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
