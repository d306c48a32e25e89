"""The format reward: does the response follow a tag layout such as ``<think>..</think><answer>..</answer>``?

Format rewards teach the shape of an answer independently of its
correctness, as in DeepSeek-R1 (DeepSeek-AI 2025, arXiv:2501.12948) and
TinyZero; they are usually combined with a small weight with a correctness
reward (see :mod:`rltk.rewards.compose`).
"""

from __future__ import annotations

import re
from functools import lru_cache

from rltk.rewards.marks import bounded

_TAG_NAME = re.compile(r"[A-Za-z_][\w\-]*")


@lru_cache(maxsize=64)
def _compile(pattern: str) -> re.Pattern:
    return re.compile(pattern, re.DOTALL)


@lru_cache(maxsize=64)
def layout_pattern(tags: tuple[str, ...]) -> str:
    """The regex for ``<t1>..</t1> <t2>..</t2> ...`` in order, whitespace allowed between blocks."""
    for tag in tags:
        if not _TAG_NAME.fullmatch(tag):
            raise ValueError(
                f"format_tags: tag name {tag!r} is not valid; use letters, digits, '_' or '-' "
                f"(e.g. tags=['think', 'answer'])"
            )
    blocks = r"\s*".join(rf"<{re.escape(t)}>.*?</{re.escape(t)}>" for t in tags)
    return rf"\s*{blocks}\s*"


@bounded(unless_args=("pattern",))  # a user regex may backtrack without end: run it under the timeout
def format_tags(
    *,
    prompt: str,
    response: str,
    ground_truth: str,
    extras: dict,
    tags: tuple[str, ...] | list[str] = ("think", "answer"),
    pattern: str | None = None,
    max_chars: int = 100_000,
) -> float:
    """1.0 when the whole response has the tag layout, else 0.0.

    With ``tags=["think", "answer"]`` (default) the response must be exactly
    ``<think>...</think>`` then ``<answer>...</answer>``, with only
    whitespace around and between the blocks, and each tag opened and closed
    exactly once (so ``<answer>a</answer><answer>b</answer>`` fails). With
    ``pattern`` the response must match that regular expression in full
    (``re.fullmatch`` with ``re.DOTALL``) and ``tags`` is ignored.

    Args:
        tags: the tag names, in the order their blocks must appear.
        pattern: a custom regex instead of the tag layout.
        max_chars: responses longer than this score 0.0 without being
            matched (bounds the time a custom regex can take).
    """
    if len(response) > max_chars:
        return 0.0
    if pattern is not None:
        return 1.0 if _compile(pattern).fullmatch(response) else 0.0
    tags = tuple(tags)
    layout = _compile(layout_pattern(tags))  # validates the tag names
    # Counting first keeps the lazy regex below linear: with every tag
    # present once there is a single way to match.
    for tag in tags:
        if response.count(f"<{tag}>") != 1 or response.count(f"</{tag}>") != 1:
            return 0.0
    return 1.0 if layout.fullmatch(response) else 0.0
