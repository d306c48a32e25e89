"""An installable rltk plugin: one advantage function, one reward function, one training loop and one
rollout engine.

``pip install ./plugins/rltk-plugin-example`` and then
``algorithm.advantage_fn=group_rank``, ``reward.reward_fn=[exact_match,overlong_penalty]``, the
rejection-sampling fine-tuning stage after a supervised one:
``rltk run grpo 'stages=[{name: warmup, type: sft}, {name: rft, type: rft}]'``, or
``rollout.engine=rltk_serve`` (:mod:`rltk_plugin_example.serve_engine`: rltk's own endpoint as inference
servers, a server engine in one file).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import rltk
from rltk_plugin_example.serve_engine import rltk_rollout_engines  # noqa: F401  (registered with this module)

if TYPE_CHECKING:
    import torch


def group_rank_advantages(*, scores: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor):
    """Rank-based group advantage: each response's centred rank within its group.

    For response i in group g with n_g members,

        rank_i = #{j in g : s_j < s_i} + (#{j in g : s_j = s_i} - 1) / 2
        A_i    = (rank_i - (n_g - 1) / 2) / ((n_g - 1) / 2)      in [-1, 1]

    so ties share the average rank. Unlike GRPO's z-score it ignores how far
    apart the scores are, which makes it robust to reward outliers and to
    rewards on arbitrary scales. A group of one and an all-equal group give 0.

    Shape: scores (B,), group_ids (B,), response_mask (B, T) -> advantages,
    returns (B, T), zero outside the mask.
    """
    import torch  # here: importing a plugin should not cost torch (`rltk validate` runs without it)

    scores = scores.float()
    same_group = group_ids[:, None] == group_ids[None, :]  # [B, B]
    below = (same_group & (scores[None, :] < scores[:, None])).sum(1).float()
    ties = (same_group & (scores[None, :] == scores[:, None])).sum(1).float()
    group_size = same_group.sum(1).float()
    rank = below + (ties - 1) / 2
    half = (group_size - 1) / 2
    adv = torch.where(half > 0, (rank - half) / half.clamp(min=0.5), torch.zeros_like(rank))
    advantages = adv[:, None] * response_mask
    return advantages, advantages.clone()


def overlong_penalty(*, response: str, max_length: int = 512, buffer_length: int = 128, unit: str = "chars", **_):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13).

    With L = response length, L_max = ``max_length`` and L_c = ``buffer_length``:

        0                          if L <= L_max - L_c
        ((L_max - L_c) - L) / L_c  if L_max - L_c < L <= L_max
        -1                         if L > L_max

    Length is counted in characters (``unit="chars"``) or whitespace-separated
    words (``unit="words"``). Combine it with a correctness reward.
    """
    if unit not in ("chars", "words"):
        raise ValueError(f"overlong_penalty: unit must be 'chars' or 'words', got {unit!r}")
    if not 0 < buffer_length <= max_length:
        raise ValueError(
            f"overlong_penalty: need 0 < buffer_length <= max_length, got {buffer_length} and {max_length}"
        )
    length = len(response) if unit == "chars" else len(response.split())
    safe = max_length - buffer_length
    if length <= safe:
        return 0.0
    if length <= max_length:
        return (safe - length) / buffer_length
    return -1.0


@rltk.hookimpl
def rltk_advantage_fns():
    return {"group_rank": group_rank_advantages}


@rltk.hookimpl
def rltk_reward_fns():
    return {"overlong_penalty": overlong_penalty}


@rltk.hookimpl
def rltk_stages():
    # the loop is named, not imported: `rltk validate` and `rltk list stage` read this spec without loading it
    return {"rft": rltk.StageSpec(
        "rltk_plugin_example.rft:run_rft_stage",
        "Rejection-sampling fine-tuning: sample n per prompt, keep what the reward accepts, SFT on the kept ones.",
        rl=True)}
