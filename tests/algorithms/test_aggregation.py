"""Loss aggregations: hand-computed values, empty rows, and exact micro-batch equivalence."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rltk
from rltk.algorithms import aggregation as agg

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None)

NAMES = {
    "token-mean": agg.token_mean,
    "seq-mean-token-sum": agg.seq_mean_token_sum,
    "seq-mean-token-mean": agg.seq_mean_token_mean,
    "seq-mean-token-sum-norm": agg.seq_mean_token_sum_norm,
}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_every_aggregation_is_registered_under_its_name(name):
    assert rltk.get_component("loss_agg", name) is NAMES[name]


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_aggregations_by_hand():
    # masked tokens: row 0 -> 1, 2; row 1 -> 4
    assert agg.token_mean(LOSS, MASK).item() == pytest.approx(7 / 3)  # (1 + 2 + 4) / 3
    assert agg.seq_mean_token_sum(LOSS, MASK).item() == pytest.approx(3.5)  # (3 + 4) / 2
    assert agg.seq_mean_token_mean(LOSS, MASK).item() == pytest.approx(2.75)  # (1.5 + 4) / 2
    assert agg.seq_mean_token_sum_norm(LOSS, MASK).item() == pytest.approx(7 / 6)  # 7 / (2 * T=3)
    assert agg.seq_mean_token_sum_norm(LOSS, MASK, norm_constant=7).item() == pytest.approx(0.5)


def test_global_normalisers_replace_the_local_counts():
    assert agg.token_mean(LOSS, MASK, global_tokens=14).item() == pytest.approx(0.5)
    assert agg.seq_mean_token_sum(LOSS, MASK, global_seqs=7).item() == pytest.approx(1.0)
    assert agg.seq_mean_token_mean(LOSS, MASK, global_seqs=11).item() == pytest.approx(0.5)
    assert agg.seq_mean_token_sum_norm(LOSS, MASK, global_seqs=7, norm_constant=2).item() == pytest.approx(0.5)
    # tensors work too (an all_reduce result)
    assert agg.token_mean(LOSS, MASK, global_tokens=torch.tensor(14)).item() == pytest.approx(0.5)


def test_empty_rows_add_nothing_and_are_not_counted():
    loss = torch.cat([LOSS, torch.full((1, 3), 100.0)])
    mask = torch.cat([MASK, torch.zeros(1, 3)])
    for name, fn in NAMES.items():
        assert fn(loss, mask).item() == pytest.approx(fn(LOSS, MASK).item()), name


@pytest.mark.parametrize("name", sorted(NAMES))
def test_an_all_zero_mask_gives_zero_loss_and_zero_gradient(name):
    loss_mat = torch.tensor([[1.0, float("nan")], [float("inf"), -2.0]], requires_grad=True)
    mask = torch.zeros(2, 2)
    for kwargs in ({}, {"global_tokens": 0, "global_seqs": 0}):
        loss = NAMES[name](loss_mat, mask, **kwargs)
        (gradient,) = torch.autograd.grad(loss, loss_mat)
        assert loss.item() == 0.0
        assert (gradient == 0).all()


@pytest.mark.parametrize("name", sorted(NAMES))
def test_non_finite_losses_on_padding_do_not_leak(name):
    loss_mat = torch.tensor([[1.0, float("nan")], [2.0, float("-inf")]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    loss = NAMES[name](loss_mat, mask)
    (gradient,) = torch.autograd.grad(loss, loss_mat)
    assert torch.isfinite(loss) and torch.isfinite(gradient).all()
    assert gradient[:, 1].tolist() == [0.0, 0.0]


def test_normalisers_count_what_the_aggregations_count():
    counts = agg.loss_agg_normalisers(torch.cat([MASK, torch.zeros(1, 3)]))
    assert counts["global_tokens"].item() == 3 and counts["global_seqs"].item() == 2


def test_masked_mean():
    assert agg.masked_mean(LOSS, MASK).item() == pytest.approx(7 / 3)
    assert agg.masked_mean(LOSS, MASK, dim=-1).tolist() == [1.5, 4.0]
    assert agg.masked_mean(LOSS, torch.zeros_like(MASK)).item() == 0.0


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: agg.token_mean(LOSS, MASK, global_tokens=-1), r"'token-mean': global_tokens must be a count >= 0.*got -1"),
        (lambda: agg.seq_mean_token_sum(LOSS, MASK, global_seqs="8"), r"global_seqs must be a count >= 0.*got '8'"),
        (lambda: agg.token_mean(LOSS, MASK[:, :2]), r"loss_mat \(2, 3\) and mask \(2, 2\) must both be \[B, T\]"),
        (lambda: agg.seq_mean_token_sum_norm(LOSS, MASK, norm_constant=0), r"norm_constant must be > 0.*got 0"),
    ],
)
def test_bad_arguments_say_what_is_valid(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --------------------------------------------------------------------------
# Gradient accumulation: the sum over micro-batches equals the whole batch
# --------------------------------------------------------------------------


def random_case(seed, B, T, n_cuts):
    g = torch.Generator().manual_seed(seed)
    loss_mat = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (B,), generator=g)  # includes empty rows
    mask = (torch.arange(T) < lengths[:, None]).double()
    mask = mask * (torch.rand(B, T, generator=g) < 0.8)  # holes (tool tokens)
    cuts = sorted(torch.randint(1, B, (n_cuts,), generator=g).tolist()) if B > 1 else []
    bounds = [0, *cuts, B]
    return loss_mat, mask, [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


cases = st.builds(
    random_case, seed=st.integers(0, 2**30), B=st.integers(1, 12), T=st.integers(1, 7), n_cuts=st.integers(0, 5)
)


@SETTINGS
@given(case=cases)
def test_micro_batches_with_global_normalisers_sum_to_the_whole_batch(case):
    loss_mat, mask, slices = case
    totals = agg.loss_agg_normalisers(mask)
    for name, fn in NAMES.items():
        whole_input = loss_mat.clone().requires_grad_(True)
        whole = fn(whole_input, mask)
        whole.backward()

        micro_input = loss_mat.clone().requires_grad_(True)
        bound = functools.partial(fn, **totals)
        summed = sum(bound(micro_input[a:b], mask[a:b]) for a, b in slices)
        summed.backward()

        assert summed.item() == pytest.approx(whole.item(), abs=1e-12), name
        torch.testing.assert_close(micro_input.grad, whole_input.grad, atol=1e-12, rtol=0, msg=name)


@SETTINGS
@given(case=cases)
def test_local_token_means_match_the_whole_only_when_weighted_by_token_share(case):
    """Why the global counts are needed: a micro-batch's local token-mean has to
    be rescaled by its share of the tokens to add up to the whole batch."""
    loss_mat, mask, slices = case
    whole = agg.token_mean(loss_mat, mask)
    n = mask.sum().clamp(min=1)
    weighted = sum(agg.token_mean(loss_mat[a:b], mask[a:b]) * mask[a:b].sum() / n for a, b in slices)
    assert weighted.item() == pytest.approx(whole.item(), abs=1e-12)


@pytest.mark.parametrize("name", sorted(NAMES))
def test_half_precision_losses_are_summed_in_float32(name):
    # A bf16 result would keep ~3 digits of the sum of 4096 tokens; it must equal the float32 aggregate.
    loss_mat = torch.full((64, 64), 0.3, dtype=torch.bfloat16, requires_grad=True)
    mask = torch.ones(64, 64)
    loss = NAMES[name](loss_mat, mask)
    assert loss.dtype == torch.float32
    reference = NAMES[name](loss_mat.detach().float(), mask)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    loss.backward()
    assert loss_mat.grad.dtype == torch.bfloat16
