"""Reward functions, their composition, and how they run (in-process or in worker processes)."""

from rltk.rewards.marks import batched, bounded, is_batched, is_bounded

__all__ = ["batched", "bounded", "is_batched", "is_bounded"]
