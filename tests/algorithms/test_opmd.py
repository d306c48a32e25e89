"""OPMD (Trinity-RFT's online policy mirror descent): advantage and loss on hand-derived numbers."""

from __future__ import annotations

import functools
import math

import pytest
import torch

import rltk
from rltk.algorithms import advantages as adv
from rltk.algorithms import aggregation as agg
from rltk.algorithms import policy_losses as pl


def outcome(scores):
    """token_rewards [B, 2] with the score on the last token, a full mask."""
    rewards = torch.zeros(len(scores), 2)
    rewards[:, -1] = torch.tensor(scores)
    return rewards, torch.ones(len(scores), 2)


def test_mean_baseline_by_hand():
    rewards, mask = outcome([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    a, _ = adv.opmd(token_rewards=rewards, response_mask=mask, group_ids=torch.tensor([0, 0, 0, 0, 1, 1]))
    # group 0 mean 0.5, no std division; group 1 all equal: 0
    assert a[:, 0].tolist() == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0]


def test_logavgexp_baseline_by_hand():
    rewards, mask = outcome([1.0, 0.0, 2.0])
    a, _ = adv.opmd(token_rewards=rewards, response_mask=mask, group_ids=torch.tensor([0, 0, 1]),
                    baseline="logavgexp", tau=1.0)
    # tau log((e^1 + e^0) / 2) = log(1.8591409) = 0.6201145; the group of one gets 0
    assert a[:, 0].tolist() == pytest.approx([1 - 0.6201145, -0.6201145, 0.0], abs=1e-6)
    # a large tau tends to the mean baseline, a small one to the max
    wide, _ = adv.opmd(token_rewards=rewards, response_mask=mask, group_ids=torch.tensor([0, 0, 1]),
                       baseline="logavgexp", tau=1e4)
    narrow, _ = adv.opmd(token_rewards=rewards, response_mask=mask, group_ids=torch.tensor([0, 0, 1]),
                         baseline="logavgexp", tau=1e-3)
    assert wide[:2, 0].tolist() == pytest.approx([0.5, -0.5], abs=1e-4)
    assert narrow[:2, 0].tolist() == pytest.approx([0.0 + 1e-3 * math.log(2), -1.0 + 1e-3 * math.log(2)], abs=1e-6)


def test_opmd_loss_by_hand():
    logprobs = torch.tensor([[-0.5, -1.0]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    loss, metrics = pl.opmd(logprobs=logprobs, old_logprobs=torch.tensor([[-0.7, -0.9]], dtype=torch.float64),
                            advantages=advantages, response_mask=mask,
                            loss_agg=functools.partial(agg.token_mean, global_tokens=2), tau=1.0)
    # l = -A logp / (1 + tau) = [1 * 0.5 / 2, -2 * 1 / 2] = [0.25, -1]; token mean -0.375
    assert loss.item() == pytest.approx(-0.375)
    loss.backward()
    assert logprobs.grad[0].tolist() == pytest.approx([-0.25, 0.5])  # -A / ((1 + tau) * 2 tokens)
    assert metrics["clip_frac"].item() == 0.0  # no ratio enters the loss


def test_preset_names_the_opmd_components():
    preset = rltk.get_component("algorithm", "opmd")
    assert (preset["advantage_fn"], preset["policy_loss"], preset["kl_penalty_fn"], preset["kl_in"]) == \
        ("opmd", "opmd", "k2", "loss")
    assert rltk.get_component("policy_loss", "opmd") is pl.opmd
    assert rltk.get_component("advantage_fn", "opmd") is adv.opmd
