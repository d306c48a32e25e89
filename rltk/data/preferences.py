"""Preference pairs: a prompt with a preferred (chosen) and a dispreferred (rejected) response.

A data file gives them as two columns (``dpo.chosen_key`` / ``dpo.rejected_key``,
Trinity-RFT's ``chosen_key`` / ``rejected_key``), each a text completion or
chat messages; they reach the row as ``extras[chosen_key]`` and
``extras[rejected_key]``. A synthetic task has no such columns:
:func:`synthetic_preferences` makes them from the task's own answers, the
correct answer chosen and a near miss rejected, so the ``dpo`` recipe learns
on a fresh machine with nothing downloaded.
"""

from __future__ import annotations

import random

__all__ = ["near_miss", "synthetic_preferences"]


def near_miss(answer: str, rng: random.Random) -> str:
    """A wrong answer close to ``answer``: the mistakes a model that half-knows the task makes.

    An integer answer ``n`` becomes ``n +- 1``, ``n +- 10`` (a dropped or
    spurious carry in a sum) or, with two or more digits, ``n`` with two
    adjacent digits swapped when that changes it; a negative result is
    avoided when ``n >= 0``. Any other answer gets one character
    appended (``"x"`` -> ``"x0"``): still a near miss for exact match.
    """
    text = answer.strip()
    try:
        n = int(text)
    except ValueError:
        return text + "0"
    candidates = {n + 1, n - 1, n + 10, n - 10}
    digits = str(abs(n))
    for i in range(len(digits) - 1):
        swapped = digits[:i] + digits[i + 1] + digits[i] + digits[i + 2:]
        if not swapped.startswith("0"):
            candidates.add(int(swapped) * (-1 if n < 0 else 1))
    candidates.discard(n)
    if n >= 0:
        candidates = {c for c in candidates if c >= 0}
    return str(rng.choice(sorted(candidates)))


def synthetic_preferences(rows: list[dict], seed: int, *, chosen_key: str = "chosen",
                          rejected_key: str = "rejected") -> list[dict]:
    """Task rows with a preference pair in ``extras``: the correct answer chosen, a near miss rejected.

    The chosen response is what the supervised warm-up teaches
    (``extras["solution"]``, else the ground truth); the rejected one is
    :func:`near_miss` of it, drawn with ``seed`` (the same rows and seed give
    the same pairs). Rows are copied, not changed.
    """
    rng = random.Random(seed)
    out = []
    for row in rows:
        extras = dict(row.get("extras") or {})
        chosen = str(extras.get("solution", row["ground_truth"]))
        extras[chosen_key], extras[rejected_key] = chosen, near_miss(chosen, rng)
        out.append({**row, "extras": extras})
    return out
