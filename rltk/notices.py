"""Say once per process why a faster path does not apply.

rltk takes faster paths where a model allows them (prompt sharing in the policy forward, the
``hf`` engine's own sampling loop, the fused log-prob op). Where one cannot run, the slower path
gives the same numbers, so nothing fails: without a word the user would only see a slower run.
:func:`notice_once` logs the reason the first time it is met, and never again for that reason.
"""

from __future__ import annotations

import logging

_said: set[tuple[str, str]] = set()


def notice_once(logger: logging.Logger, topic: str, reason: str) -> None:
    """Log ``"<topic>: <reason>"`` as a warning, the first time this process meets that pair."""
    if (topic, reason) in _said:
        return
    _said.add((topic, reason))
    logger.warning("%s: %s", topic, reason)
