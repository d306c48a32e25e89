"""The Bradley-Terry reward-model loss against numbers worked out by hand."""

import math

import pytest
import torch

import rltk
from rltk.algorithms.reward_model_losses import bradley_terry_loss


def test_bradley_terry_value_and_metrics_by_hand():
    # r_c - r_r = [2, 0, -2]:
    #   -log sigmoid(2)  = log(1 + e^-2) = 0.126928
    #   -log sigmoid(0)  = log 2         = 0.693147
    #   -log sigmoid(-2) = log(1 + e^2)  = 2.126928      mean 2.947003 / 3 = 0.982334
    chosen = torch.tensor([2.0, 0.0, -1.0])
    rejected = torch.tensor([0.0, 0.0, 1.0])
    loss, metrics = bradley_terry_loss(chosen_rewards=chosen, rejected_rewards=rejected)
    assert loss.item() == pytest.approx(0.982334, abs=1e-6)
    assert metrics["rm/accuracy"] == pytest.approx(0.5)  # (1 + 0.5 + 0) / 3: the tie counts half
    assert metrics["rm/margin"] == pytest.approx(0.0)
    assert metrics["rm/chosen_reward"] == pytest.approx(1 / 3)
    assert metrics["rm/rejected_reward"] == pytest.approx(1 / 3)


def test_bradley_terry_gradient_by_hand():
    # dL/dr_c,i = -sigmoid(-(d_i)) / B and dL/dr_r,i = +sigmoid(-(d_i)) / B; d = [2, 0, -2], B = 3:
    # sigmoid(-2) = 0.119203, sigmoid(0) = 0.5, sigmoid(2) = 0.880797
    chosen = torch.tensor([2.0, 0.0, -1.0], requires_grad=True)
    rejected = torch.tensor([0.0, 0.0, 1.0], requires_grad=True)
    loss, _ = bradley_terry_loss(chosen_rewards=chosen, rejected_rewards=rejected)
    loss.backward()
    expected = torch.tensor([0.119203, 0.5, 0.880797]) / 3
    torch.testing.assert_close(chosen.grad, -expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(rejected.grad, expected, atol=1e-6, rtol=0)


def test_bradley_terry_margin_by_hand():
    # margin 1: d - 1 = [1, -1, -3]: log(1 + e^-1) = 0.313262, log(1 + e) = 1.313262, log(1 + e^3) = 3.048587
    loss, _ = bradley_terry_loss(chosen_rewards=torch.tensor([2.0, 0.0, -1.0]),
                                 rejected_rewards=torch.tensor([0.0, 0.0, 1.0]), margin=1.0)
    assert loss.item() == pytest.approx((0.313262 + 1.313262 + 3.048587) / 3, abs=1e-6)


def test_bradley_terry_does_not_overflow():
    # d = +-200: exp(200) overflows float32; logsigmoid does not. The loss is log(1 + e^-200) ~ 0 and ~200.
    loss, _ = bradley_terry_loss(chosen_rewards=torch.tensor([100.0, -100.0]),
                                 rejected_rewards=torch.tensor([-100.0, 100.0]))
    assert math.isfinite(loss.item())
    assert loss.item() == pytest.approx(100.0, rel=1e-6)


def test_bradley_terry_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"chosen_rewards \(3,\) and rejected_rewards \(2,\)"):
        bradley_terry_loss(chosen_rewards=torch.zeros(3), rejected_rewards=torch.zeros(2))


def test_bradley_terry_is_registered():
    assert rltk.get_component("reward_model_loss", "bradley_terry") is bradley_terry_loss
