"""The settings of the rollout correction (:func:`rltk.algorithms.mismatch.rollout_correction`) and their
check, without torch: ``rltk validate`` checks ``algorithm.rollout_correction`` before anything heavy loads."""

from __future__ import annotations

import math
from typing import Mapping

TIS_LEVELS = ("token", "sequence")
MIS_LEVELS = ("token", "sequence")
REJECTION_LEVELS = ("geometric", "sequence", "token")

# The settings :func:`rollout_correction` takes, with their defaults.
DEFAULTS = {
    "tis": None, "tis_cap": 2.0,
    "mis": None, "mis_low": 0.5, "mis_high": 2.0,
    "rejection": None, "rejection_low": 0.5, "rejection_high": 2.0,
}

def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_rollout_correction(settings: Mapping, where: str = "rollout_correction") -> None:
    """Raise ``ValueError`` naming ``<where>.<setting>`` for a bad setting of :func:`rollout_correction`.

    Checks the level names, that ``tis`` and ``mis`` are not both set, that
    ``tis_cap >= 1`` and that each band ``[low, high]`` contains 1 (a band
    without 1 drops on-policy tokens, a cap below 1 shrinks every gradient).
    """
    unknown = sorted(set(settings) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: no such setting. Valid: {', '.join(DEFAULTS)}")
    s = {**DEFAULTS, **settings}
    for name, levels in (("tis", TIS_LEVELS), ("mis", MIS_LEVELS), ("rejection", REJECTION_LEVELS)):
        if s[name] is not None and s[name] not in levels:
            raise ValueError(f"bad value {s[name]!r} for '{where}.{name}'. Valid: null (off), {', '.join(levels)}")
    if s["tis"] is not None and s["mis"] is not None:
        raise ValueError(
            f"'{where}.tis'={s['tis']!r} and '{where}.mis'={s['mis']!r} both set the importance weight; "
            f"choose one (truncate with tis, or mask outside a band with mis) and set the other to null"
        )
    if s["tis_cap"] is not None and not (_is_number(s["tis_cap"]) and s["tis_cap"] >= 1):
        raise ValueError(
            f"bad value {s['tis_cap']!r} for '{where}.tis_cap': must be a number >= 1 (Yao et al. use 2), or "
            f"null for untruncated importance weights; a cap below 1 would shrink the weight of on-policy tokens"
        )
    for mode in ("mis", "rejection"):
        low, high = s[f"{mode}_low"], s[f"{mode}_high"]
        if not (_is_number(low) and 0 <= low <= 1):
            raise ValueError(
                f"bad value {low!r} for '{where}.{mode}_low': must be in [0, 1] (0: no lower bound), "
                f"so that the band keeps ratio 1"
            )
        if not (_is_number(high) and high >= 1):
            raise ValueError(
                f"bad value {high!r} for '{where}.{mode}_high': must be a number >= 1, so that the band keeps ratio 1"
            )


def correction_active(settings: Mapping) -> bool:
    """Whether any mode of ``settings`` is on (``tis``, ``mis`` or ``rejection`` not None)."""
    return any(settings.get(name) is not None for name in ("tis", "mis", "rejection"))
