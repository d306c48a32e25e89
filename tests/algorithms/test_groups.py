"""Group statistics (rltk.algorithms.groups) against a per-group Python loop, and the
output contract of the outcome estimators (what consumers may rely on)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rltk.algorithms import advantages as adv
from rltk.algorithms.aggregation import masked_mean, token_mean
from rltk.algorithms.groups import EQUAL_WITHIN_ULPS, Groups, group_index
from rltk.algorithms.value import clipped_value_loss
from tests.algorithms.calls import call_with_fields
from rltk.training.updates.ppo import explained_variance

SETTINGS = settings(max_examples=80, deadline=None, derandomize=True, database=None)

TOLERANCE = EQUAL_WITHIN_ULPS * torch.finfo(torch.float32).eps


@st.composite
def grouped_values(draw, columns=None):
    """Unsorted, non-contiguous group ids (offsets kept small, or huge for the unique() path),
    groups of one, all-equal groups and groups equal up to a few float32 ulps."""
    n = draw(st.integers(1, 30))
    n_ids = draw(st.integers(1, n))
    scale = draw(st.sampled_from([1, 3, 10**12]))
    base = draw(st.integers(-20, 20))
    ids = [base + scale * draw(st.integers(0, n_ids - 1)) for _ in range(n)]
    values = draw(st.lists(st.sampled_from([0.0, 1.0, 0.1, -2.5, 0.3, 1e6]), min_size=n, max_size=n))
    # Groups whose members all share the value of the group's first member, some nudged by an ulp.
    uniform = draw(st.sets(st.sampled_from(sorted(set(ids))), max_size=3))
    nudge = draw(st.booleans())
    first = {}
    for i, g in enumerate(ids):
        first.setdefault(g, values[i])
        if g in uniform:
            v = torch.tensor(first[g], dtype=torch.float32)
            values[i] = float(torch.nextafter(v, torch.tensor(math.inf)) if nudge and i % 2 else v)
    x = torch.tensor(values, dtype=torch.float64)
    if columns:
        x = torch.stack([x, x.flip(0) * 0.5], 1)
    return torch.tensor(ids, dtype=torch.int64), x


def loop_reference(ids: torch.Tensor, x: torch.Tensor):
    """Per group, one Python iteration each: sum, mean, min, max, all-equal, centred, unbiased std."""
    B = ids.numel()
    centred = torch.zeros_like(x)
    std = torch.zeros_like(x)
    stats = {}
    for g in sorted(set(ids.tolist())):
        members = [i for i in range(B) if ids[i].item() == g]
        v = x[members]
        lo, hi = v.min(0).values, v.max(0).values
        equal = hi - lo <= TOLERANCE * torch.maximum(lo.abs(), hi.abs())
        c = torch.where(equal, 0.0, v - v.sum(0) / len(members))
        centred[members] = c
        std[members] = (c.square().sum(0) / max(len(members) - 1, 1)).sqrt()
        stats[g] = {"sum": v.sum(0), "min": lo, "max": hi, "equal": equal, "size": len(members)}
    return stats, centred, std


@SETTINGS
@given(data=grouped_values())
def test_group_statistics_equal_a_per_group_loop(data):
    ids, x = data
    stats, centred, std = loop_reference(ids, x)
    groups = Groups.of(ids)
    sums, (lo, hi), equal = groups.sum(x), groups.min_max(x), groups.all_equal(x)
    for i, g in enumerate(ids.tolist()):
        k = groups.inverse[i]
        assert groups.counts[k] == stats[g]["size"]
        torch.testing.assert_close(sums[k], stats[g]["sum"], rtol=1e-12, atol=1e-12)
        assert lo[k] == stats[g]["min"] and hi[k] == stats[g]["max"]
        assert bool(equal[k]) == bool(stats[g]["equal"])
    got = groups.centred(x)
    torch.testing.assert_close(got, centred, rtol=1e-12, atol=1e-9)
    assert torch.equal(got == 0, centred == 0) or bool((centred[got != 0] != 0).all())
    # all-equal groups and groups of one are exactly 0, never rounding noise
    for i, g in enumerate(ids.tolist()):
        if stats[g]["equal"] or stats[g]["size"] == 1:
            assert got[i] == 0
    torch.testing.assert_close(groups.expand(groups.std(got)), std, rtol=1e-12, atol=1e-9)
    # two responses share a group number exactly when they share an id
    same_id = ids[:, None] == ids[None, :]
    assert torch.equal(same_id, groups.inverse[:, None] == groups.inverse[None, :])


@SETTINGS
@given(data=grouped_values(), seed=st.integers(0, 2**31 - 1))
def test_float64_sums_take_bincount_with_the_bits_of_index_add(data, seed):
    """Groups.sum of [B] float64 on CPU is a weighted bincount: the same sequential sum in index
    order as zeros + index_add_ (the mean, std and every estimator's statistics rest on it)."""
    ids, x = data
    # spread magnitudes, so that the order of the additions shows in the last bits
    x = x + torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * 1e-3
    groups = Groups.of(ids)
    reference = torch.zeros(groups.n_groups, dtype=torch.float64).index_add_(0, groups.inverse, x)
    assert torch.equal(groups.sum(x), reference)
    used = groups.counts > 0  # an unused number's mean is 0 / 0
    assert torch.equal(groups.mean(x)[used], (reference / groups.counts.to(torch.float64))[used])
    # float32 keeps index_add_: bincount would sum it in float64
    x32 = x.float()
    assert groups.sum(x32).dtype == torch.float32
    assert torch.equal(groups.sum(x32), torch.zeros(groups.n_groups).index_add_(0, groups.inverse, x32))


@SETTINGS
@given(data=grouped_values(columns=2))
def test_group_statistics_of_several_columns_are_those_of_each_column(data):
    ids, x = data
    groups = Groups.of(ids)
    centred, std = groups.centred(x), groups.expand(groups.std(groups.centred(x)))
    for k in range(x.shape[1]):
        _, want_centred, want_std = loop_reference(ids, x[:, k])
        torch.testing.assert_close(centred[:, k], want_centred, rtol=1e-12, atol=1e-9)
        torch.testing.assert_close(std[:, k], want_std, rtol=1e-12, atol=1e-9)


@SETTINGS
@given(data=grouped_values())
def test_the_offset_numbering_groups_like_the_dense_one(data):
    ids, _ = data
    groups = Groups.of(ids)
    inverse, counts = group_index(ids)
    # The same partition; the offset numbering may leave unused (empty) numbers.
    assert torch.equal(groups.inverse[:, None] == groups.inverse[None, :], inverse[:, None] == inverse[None, :])
    assert torch.equal(groups.counts[groups.inverse], counts[inverse])
    assert int((groups.counts > 0).sum()) == counts.numel()


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(-50, 50), min_size=1, max_size=40),
    scale=st.sampled_from([1, 1000, 2**40]),
)
def test_group_index_numbers_groups_like_torch_unique(ids, scale):
    # scale 1 takes the presence-table path, huge ids the sort path: both must agree.
    group_ids = torch.tensor(ids, dtype=torch.int64) * scale
    inverse, counts = group_index(group_ids)
    _, expected_inverse, expected_counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    assert torch.equal(inverse, expected_inverse)
    assert torch.equal(counts, expected_counts)


def test_group_index_takes_the_histogram_path_without_the_slow_index_put():
    # 0 .. G-1 all present: the offsets are the dense index itself.
    ids = torch.tensor([3, 0, 2, 1, 3, 0])
    inverse, counts = group_index(ids)
    assert inverse.tolist() == [3, 0, 2, 1, 3, 0] and counts.tolist() == [2, 1, 1, 2]
    # gaps: ranked densely, like torch.unique
    ids = torch.tensor([40, 7, 40, 12])
    inverse, counts = group_index(ids)
    assert inverse.tolist() == [2, 0, 2, 1] and counts.tolist() == [1, 1, 2]
    # int32 ids and a span beyond 4 B (the sort path) agree too
    assert group_index(torch.tensor([5, -(2**40), 5]))[0].tolist() == [1, 0, 1]
    assert group_index(torch.tensor([9, 2, 9], dtype=torch.int32))[0].tolist() == [1, 0, 1]


# --------------------------------------------------------------------------
# The output contract (module doc of rltk.algorithms.advantages)
# --------------------------------------------------------------------------

OUTCOME = ["grpo", "rloo", "opo", "reinforce_plus_plus_baseline", "remax", "grpo_passk", "gdpo", "gpg"]


def contract_batch():
    # rows of lengths 3, 1, 2, 3 (row 2 with a masked tool token inside), scores 1, 0, 2, 0.5
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [1, 0, 1, 0], [1, 1, 1, 0]])
    rewards = torch.zeros(4, 4)
    rewards[0, 2], rewards[1, 0], rewards[2, 2], rewards[3, 2] = 1.0, 0.0, 2.0, 0.5
    return {
        "token_rewards": rewards, "response_mask": mask, "group_ids": torch.tensor([5, 5, 9, 9]),
        "baseline_scores": torch.tensor([0.5, 0.5, 0.5, 0.5]),
        "reward_components": torch.stack([rewards.sum(-1), torch.tensor([1.0, 0.0, 0.0, 1.0])], 1),
    }


@pytest.mark.parametrize("name", OUTCOME)
def test_outcome_returns_are_a_broadcast_view_and_advantages_the_callers_own(name):
    batch = contract_batch()
    inputs = {k: v.clone() for k, v in batch.items()}
    advantages, returns = call_with_fields(getattr(adv, name), batch, {})
    R = batch["token_rewards"].sum(-1) if name != "gdpo" else batch["reward_components"].sum(-1)
    # R_i on every token of row i, padding included, held in B floats
    assert returns.shape == (4, 4) and returns.stride() == (1, 0)
    assert torch.equal(returns, R[:, None].expand(4, 4))
    dense = returns.contiguous()  # dense on demand
    assert dense.is_contiguous() and torch.equal(dense, R[:, None].expand(4, 4))
    # the advantages are the caller's: contiguous, shared with nothing the estimator returned or read
    assert advantages.is_contiguous()
    taken = {t.untyped_storage().data_ptr() for t in batch.values()}
    assert advantages.untyped_storage().data_ptr() not in taken | {returns.untyped_storage().data_ptr()}
    assert returns.untyped_storage().data_ptr() not in taken
    advantages.mul_(3.0).add_(1.0)  # in place: allowed, and changes neither the returns nor the inputs
    assert torch.equal(returns, dense)
    for k in batch:
        assert torch.equal(batch[k], inputs[k]), k
    # an element-wise in-place write into the returns fails loudly; an indexed one only warns and
    # writes through to every token of the row, which is why the contract says: never write into it
    with pytest.raises(RuntimeError, match="single memory location"):
        returns.mul_(2.0)
    with pytest.warns(UserWarning, match="expanded tensors is deprecated"):
        returns[returns > 0] = 0.0
    assert (returns == 0).all()


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus", "optimal_token_baseline"])
def test_per_token_returns_stay_dense_and_zero_off_the_mask(name):
    batch = contract_batch()
    B, T = batch["response_mask"].shape
    batch.update(values=torch.randn(B, T), old_logprobs=-torch.rand(B, T), sum_pi_squared=torch.rand(B, T))
    advantages, returns = call_with_fields(getattr(adv, name), batch, {})
    assert returns.is_contiguous() and advantages.is_contiguous()
    assert (returns[batch["response_mask"] == 0] == 0).all()
    assert returns.untyped_storage().data_ptr() != advantages.untyped_storage().data_ptr()


def test_consumers_read_the_view_as_they_read_masked_dense_returns():
    """The critic's loss, explained variance and the logged mean select policy tokens, so a
    view holding R_i on padding gives exactly what the old zero-padded returns gave."""
    batch = contract_batch()
    mask = batch["response_mask"]
    _, view = adv.grpo(**{k: batch[k] for k in ("token_rewards", "response_mask", "group_ids")})
    dense = view * mask  # the old contract: zero off the mask
    values, old_values = torch.randn(4, 4), torch.randn(4, 4)
    for clip in (None, 0.2):
        loss_view, m_view = clipped_value_loss(values=values, old_values=old_values, returns=view,
                                               response_mask=mask, loss_agg=token_mean, clip_range=clip)
        loss_dense, m_dense = clipped_value_loss(values=values, old_values=old_values, returns=dense,
                                                 response_mask=mask, loss_agg=token_mean, clip_range=clip)
        assert torch.equal(loss_view, loss_dense)
        assert all(torch.equal(m_view[k], m_dense[k]) for k in m_dense)
    assert explained_variance(values, view, mask) == explained_variance(values, dense, mask)
    assert torch.equal(masked_mean(view, mask), masked_mean(dense, mask))
    # micro-batch slicing and indexing give views/copies with the same values
    assert torch.equal(view[1:3], dense[1:3] + view[1:3] * (1 - mask[1:3]))
    assert torch.equal(view[torch.tensor([3, 0])] * mask[torch.tensor([3, 0])], dense[torch.tensor([3, 0])])
