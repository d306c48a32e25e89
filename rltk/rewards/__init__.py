"""Reward functions, their composition, and how they run (in-process or in worker processes)."""

from rltk.rewards.marks import bounded, is_bounded

__all__ = ["bounded", "is_bounded"]
