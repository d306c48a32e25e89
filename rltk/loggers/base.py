"""What every metric logger implements, and the value conversion they share.

A logger is a class registered under kind ``logger`` (see
``rltk/loggers/builtin.py``). The recipe builds it on the main rank as
``cls(run_dir=Path, config=dict, total_steps=int, **args)``, calls
``log(metrics, step)`` after every step and ``close()`` once at the end. On
resume it passes ``resume_step=<step of the checkpoint>`` so that no curve shows
the steps after the checkpoint twice.
"""

from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class MetricLogger(Protocol):
    """The interface of a registered logger (structural: no base class needed)."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` for optimizer step ``step`` (called in increasing step order)."""

    def close(self) -> None:
        """Flush and release files or connections; safe to call twice."""


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
