"""Checks of the ``guard`` section (the divergence guard, rltk/training/guard.py)."""

from __future__ import annotations

import math

from omegaconf import DictConfig

from rltk.config.errors import ConfigError


def check_guard(cfg: DictConfig) -> None:
    """Counts are whole numbers >= 0 (patience >= 1) and ``0 <= entropy_min < entropy_max <= 1``."""
    g = cfg.guard
    for key, minimum in (("max_skipped_steps", 0), ("entropy_patience", 1), ("check_weights_every", 0)):
        value = g[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            off = " (0 turns this check off)" if minimum == 0 else ""
            raise ConfigError(f"bad value {value!r} for 'guard.{key}': must be an integer >= {minimum}{off}")
    low, high = g.entropy_min, g.entropy_max
    for key, value in (("entropy_min", low), ("entropy_max", high)):
        if not math.isfinite(value) or not 0 <= value <= 1:
            raise ConfigError(
                f"bad value {value!r} for 'guard.{key}': must be in [0, 1], a fraction of log(vocabulary size) "
                f"(1 is the uniform distribution's entropy, 0 a single token's)"
            )
    if low >= high:
        raise ConfigError(
            f"bad values guard.entropy_min={low!r} >= guard.entropy_max={high!r}: the floor must be below the "
            f"ceiling (defaults 1e-4 and 0.999; 0 and 1 turn each off)"
        )
