"""OmegaConf resolvers rltk adds for derived values, e.g. ``${sub:${max_len},${prompt_len}}``."""

from __future__ import annotations

import inspect
import math
from typing import Any

from omegaconf import OmegaConf


def _number(x: Any) -> float | int:
    if isinstance(x, (int, float)):
        return x
    try:
        return int(x)
    except (TypeError, ValueError):
        return float(x)


def register_resolvers() -> None:
    """Arithmetic resolvers for derived values, e.g. ``${sub:${max_len},${prompt_len}}``."""
    resolvers = {
        "add": lambda *xs: sum(_number(x) for x in xs),
        "sub": lambda a, b: _number(a) - _number(b),
        "mul": lambda *xs: math.prod(_number(x) for x in xs),
        "div": lambda a, b: _number(a) / _number(b),
        "floordiv": lambda a, b: _number(a) // _number(b),
        "max": lambda *xs: max(_number(x) for x in xs),
        "min": lambda *xs: min(_number(x) for x in xs),
    }
    # omegaconf 2.4 renamed register_new_resolver to register_resolver and deprecated the old name; in
    # 2.3 register_resolver is still the legacy 2.0 call without replace=, so choose by what it accepts.
    register = getattr(OmegaConf, "register_resolver", None)
    if register is None or "replace" not in inspect.signature(register).parameters:
        register = OmegaConf.register_new_resolver
    for name, fn in resolvers.items():
        register(name, fn, replace=True)
