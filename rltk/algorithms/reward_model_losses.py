"""Losses of reward-model training from preference pairs (kind ``reward_model_loss``).

A ``reward_model_loss`` is ``fn(*, chosen_rewards, rejected_rewards, **args) -> (loss, metrics)``:
``chosen_rewards`` and ``rejected_rewards`` are the model's scalar rewards ``[B]`` of the
preferred and the dispreferred response to the same prompt; ``loss`` is the mean over the
pairs, ``metrics`` floats over the same pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import rltk

__all__ = ["bradley_terry_loss", "pairwise_wins"]

#: The builtin reward-model losses by config name, filled by ``@register_reward_model_loss(name)`` on each
#: definition and returned by this module's ``rltk_reward_model_losses`` hook (the entry point
#: ``reward_model_losses``).
REWARD_MODEL_LOSSES = rltk.ComponentTable("reward_model_loss")
register_reward_model_loss = REWARD_MODEL_LOSSES.register


@register_reward_model_loss("bradley_terry")
def bradley_terry_loss(*, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                       margin: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Bradley-Terry pairwise loss: the negative log-likelihood that the chosen response is preferred.

    Under the Bradley-Terry model, ``P(chosen > rejected) = sigmoid(r_c - r_r)``, so with ``B`` pairs

        L = - 1/B sum_i log sigmoid(r_c,i - r_r,i - margin)

    ``margin`` (default 0) asks for a gap of at least that many reward units (Llama 2's margin
    loss, Touvron et al. 2023); 0 is the plain model. Computed with ``logsigmoid`` (no overflow
    for large differences). Metrics: ``rm/accuracy`` (fraction of pairs with ``r_c > r_r``, a tie
    counting half: a model that scores every text alike is at 0.5, chance),
    ``rm/margin`` (mean ``r_c - r_r``), ``rm/chosen_reward``, ``rm/rejected_reward``.

    References: R. A. Bradley and M. E. Terry, "Rank Analysis of Incomplete Block Designs: I. The
    Method of Paired Comparisons", Biometrika 39, 1952; L. Ouyang et al., "Training language models
    to follow instructions with human feedback", arXiv:2203.02155, 2022 (eq. 1, the reward-model loss).
    """
    if chosen_rewards.shape != rejected_rewards.shape or chosen_rewards.dim() != 1:
        raise ValueError(f"bradley_terry_loss: chosen_rewards {tuple(chosen_rewards.shape)} and rejected_rewards "
                         f"{tuple(rejected_rewards.shape)} must be the same [B]")
    diff = chosen_rewards.float() - rejected_rewards.float()
    loss = -F.logsigmoid(diff - margin).mean()
    with torch.no_grad():
        metrics = {"rm/accuracy": pairwise_wins(diff).mean().item(), "rm/margin": diff.mean().item(),
                   "rm/chosen_reward": chosen_rewards.float().mean().item(),
                   "rm/rejected_reward": rejected_rewards.float().mean().item()}
    return loss, metrics


def pairwise_wins(diff: torch.Tensor) -> torch.Tensor:
    """1 where ``r_c - r_r > 0``, 0.5 on a tie, 0 otherwise: a pair's share of the pairwise accuracy."""
    return (diff > 0).float() + 0.5 * (diff == 0).float()


@rltk.hookimpl
def rltk_reward_model_losses():
    """Register the builtin reward-model losses (each marked ``@register_reward_model_loss`` where it is defined)."""
    return REWARD_MODEL_LOSSES
