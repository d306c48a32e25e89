"""Calling an estimator the way the loop does, on a hand-built dict of fields."""

from __future__ import annotations

import inspect
from typing import Any, Callable


def call_with_fields(fn: Callable, available: dict[str, Any], args: dict[str, Any]) -> Any:
    """``fn`` with the fields of ``available`` its signature names, plus ``args`` (as
    :class:`rltk.training.step.estimator.Estimator` passes them, without its checks and row-sum cache)."""
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in available.items() if k in params and k not in args}, **args)
