"""Clipped value loss and the entropy bonus."""

from __future__ import annotations

import functools

import pytest
import torch

from rltk.algorithms import aggregation as agg
from rltk.algorithms import value


def value_case():
    values = torch.tensor([[1.0, 2.0, 0.0, 7.0]], requires_grad=True)
    old_values = torch.tensor([[0.5, 2.0, 0.5, float("nan")]])
    returns = torch.tensor([[2.0, 1.0, 0.0, float("inf")]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last token is padding with garbage
    return values, old_values, returns, mask


def test_clipped_value_loss_by_hand():
    values, old_values, returns, mask = value_case()
    loss, metrics = value.clipped_value_loss(
        values=values, old_values=old_values, returns=returns, response_mask=mask, loss_agg=agg.token_mean
    )
    loss.backward()
    # t0: V moved +0.5 -> clipped to 0.7; errors (1 - 2)^2 = 1, (0.7 - 2)^2 = 1.69 -> 0.5 * 1.69
    # t1: V did not move; both errors 1 -> 0.5
    # t2: V moved -0.5 -> clipped to 0.3; errors 0, 0.09 -> 0.5 * 0.09
    assert loss.item() == pytest.approx((0.845 + 0.5 + 0.045) / 3)
    # the clipped error wins on t0 and t2 (no gradient); t1 has gradient (V - R) / 3
    assert values.grad[0].tolist() == pytest.approx([0.0, 1 / 3, 0.0, 0.0])
    assert float(metrics["vf_clip_frac"]) == pytest.approx(2 / 3)
    assert float(metrics["values_mean"]) == pytest.approx(1.0)


def test_unclipped_value_loss_is_half_the_squared_error():
    values, old_values, returns, mask = value_case()
    loss, metrics = value.clipped_value_loss(
        values=values, old_values=old_values, returns=returns, response_mask=mask, loss_agg=agg.token_mean,
        clip_range=None,
    )
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * (1 + 1 + 0) / 3)
    assert values.grad[0].tolist() == pytest.approx([-1 / 3, 1 / 3, 0.0, 0.0])
    assert float(metrics["vf_clip_frac"]) == 0.0


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 4)
    _, perfect = value.clipped_value_loss(
        values=returns.clone(), old_values=returns, returns=returns, response_mask=mask, loss_agg=agg.token_mean
    )
    _, constant = value.clipped_value_loss(
        values=torch.full((1, 4), 2.5), old_values=torch.full((1, 4), 2.5), returns=returns, response_mask=mask,
        loss_agg=agg.token_mean,
    )
    assert float(perfect["vf_explained_var"]) == pytest.approx(1.0)
    assert float(constant["vf_explained_var"]) == pytest.approx(0.0)  # predicting the mean explains nothing


def test_value_loss_accumulates_exactly_over_micro_batches():
    g = torch.Generator().manual_seed(3)
    values = torch.randn(6, 5, generator=g, dtype=torch.float64)
    old_values = values + 0.3 * torch.randn(6, 5, generator=g, dtype=torch.float64)
    returns = torch.randn(6, 5, generator=g, dtype=torch.float64)
    mask = (torch.arange(5) < torch.tensor([[5], [0], [2], [4], [1], [3]])).double()
    whole_v = values.clone().requires_grad_(True)
    whole, _ = value.clipped_value_loss(
        values=whole_v, old_values=old_values, returns=returns, response_mask=mask, loss_agg=agg.token_mean
    )
    whole.backward()
    bound = functools.partial(agg.token_mean, **agg.loss_agg_normalisers(mask))
    micro_v = values.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        micro, _ = value.clipped_value_loss(
            values=micro_v[rows], old_values=old_values[rows], returns=returns[rows], response_mask=mask[rows],
            loss_agg=bound,
        )
        micro.backward()
        total += micro.item()
    assert total == pytest.approx(whole.item(), abs=1e-12)
    torch.testing.assert_close(micro_v.grad, whole_v.grad, atol=1e-12, rtol=0)


def test_clip_range_must_be_positive():
    values, old_values, returns, mask = value_case()
    with pytest.raises(ValueError, match=r"clip_range must be > 0 .*got 0"):
        value.clipped_value_loss(
            values=values, old_values=old_values, returns=returns, response_mask=mask, loss_agg=agg.token_mean,
            clip_range=0,
        )


def test_entropy_bonus_is_the_aggregated_entropy_and_its_gradient_raises_entropy():
    entropy = torch.tensor([[1.0, 3.0, 9.0], [2.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    bonus = value.entropy_bonus(entropy, mask, agg.token_mean)
    assert bonus.item() == pytest.approx(2.0)  # (1 + 3 + 2) / 3
    (-0.01 * bonus).backward()  # what the recipe adds to the loss
    # descending the loss raises the entropy of every policy token
    expected = torch.tensor([[-0.01 / 3, -0.01 / 3, 0.0], [-0.01 / 3, 0.0, 0.0]])
    torch.testing.assert_close(entropy.grad, expected)
    assert value.entropy_loss is value.entropy_bonus
    assert value.entropy_bonus(entropy, mask, agg.seq_mean_token_mean).item() == pytest.approx(2.0)  # (2 + 2) / 2


def test_entropy_bonus_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"entropy_bonus: every input must be the same \[B, T\]"):
        value.entropy_bonus(torch.zeros(2, 3), torch.ones(2, 2), agg.token_mean)
