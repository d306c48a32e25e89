"""Advantage estimators: hand-computed cases, loop references and invariants."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rltk
from rltk.algorithms import advantages as adv
from rltk.training.step.estimator import Estimator
from tests.algorithms.calls import call_with_fields

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None)

NAMES = {
    "gae": adv.gae,
    "grpo": adv.grpo,
    "rloo": adv.rloo,
    "reinforce_plus_plus": adv.reinforce_plus_plus,
    "reinforce_plus_plus_baseline": adv.reinforce_plus_plus_baseline,
    "remax": adv.remax,
    "opo": adv.opo,
}


# Estimators whose returns are per-token and zero off the mask; the outcome estimators'
# returns are R_i on every token of row i (see "What consumers may rely on" in the module doc).
PER_TOKEN_RETURNS = {"gae", "reinforce_plus_plus", "optimal_token_baseline"}


def outcome_batch(scores, lengths, T=None):
    """token_rewards / response_mask for outcome rewards: score on the last token of each row."""
    T = T or max(max(lengths), 1)
    mask = torch.zeros(len(scores), T)
    rewards = torch.zeros(len(scores), T)
    for i, (score, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = 1
        if n:
            rewards[i, n - 1] = score
    return rewards, mask


# --------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(NAMES))
def test_every_estimator_is_registered_under_its_name(name):
    assert rltk.get_component("advantage_fn", name) is NAMES[name]


def test_the_loop_passes_exactly_the_declared_fields():
    rewards, mask = outcome_batch([1.0, 0.0], [2, 2])
    batch = {
        "token_rewards": rewards,
        "response_mask": mask,
        "group_ids": torch.tensor([4, 4]),
        "values": torch.zeros(2, 2),  # not declared by grpo: must not be passed
        "scores": torch.tensor([1.0, 0.0]),
    }
    advantages, _ = Estimator.of(adv.grpo, {"norm_by_std": False})(batch)
    assert advantages.tolist() == [[0.5, 0.5], [-0.5, -0.5]]


# --------------------------------------------------------------------------
# Hand-computed group estimators
# --------------------------------------------------------------------------

# Responses, interleaved and with non-contiguous ids:
#   group 7: scores 1, 0, 1      group 3: score 2 (alone)      group 11: 0.1, 0.1 (all equal)
SCORES = [1.0, 2.0, 0.1, 0.0, 0.1, 1.0]
GROUPS = torch.tensor([7, 3, 11, 7, 11, 7])
LENGTHS = [2, 1, 3, 1, 2, 3]


def test_grpo_by_hand():
    rewards, mask = outcome_batch(SCORES, LENGTHS)
    advantages, returns = adv.grpo(token_rewards=rewards, response_mask=mask, group_ids=GROUPS)
    # group 7: mean 2/3; unbiased std = sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3)
    std = math.sqrt(1 / 3)
    expected = [(1 / 3) / std, 0.0, 0.0, (-2 / 3) / std, 0.0, (1 / 3) / std]
    per_row = [advantages[i, 0].item() for i in range(6)]
    assert per_row == pytest.approx(expected, abs=1e-5)
    # every policy token of a row carries its row's advantage, padding carries 0
    assert torch.equal(advantages, advantages[:, :1] * mask)
    assert returns[:, 0].tolist() == pytest.approx(SCORES)
    # returns of an outcome estimator: R_i on every token of row i (a broadcast view, see the module doc)
    assert torch.equal(returns, returns[:, :1].expand_as(returns))


def test_dr_grpo_by_hand_skips_the_std():
    rewards, mask = outcome_batch(SCORES, LENGTHS)
    advantages, _ = adv.grpo(token_rewards=rewards, response_mask=mask, group_ids=GROUPS, norm_by_std=False)
    assert advantages[:, 0].tolist() == pytest.approx([1 / 3, 0, 0, -2 / 3, 0, 1 / 3], abs=1e-6)


def test_rloo_by_hand():
    rewards, mask = outcome_batch(SCORES, LENGTHS)
    advantages, _ = adv.rloo(token_rewards=rewards, response_mask=mask, group_ids=GROUPS)
    # score 1: 1 - (0 + 1) / 2 = 0.5; score 0: 0 - (1 + 1) / 2 = -1
    assert advantages[:, 0].tolist() == pytest.approx([0.5, 0, 0, -1, 0, 0.5], abs=1e-6)


def test_opo_by_hand_weights_the_baseline_by_length():
    rewards, mask = outcome_batch(SCORES, LENGTHS)
    advantages, _ = adv.opo(token_rewards=rewards, response_mask=mask, group_ids=GROUPS)
    # group 7: lengths 2, 1, 3 -> b = (2*1 + 1*0 + 3*1) / 6 = 5/6
    assert advantages[:, 0].tolist() == pytest.approx([1 / 6, 0, 0, -5 / 6, 0, 1 / 6], abs=1e-6)


def test_remax_by_hand():
    rewards, mask = outcome_batch([1.0, 0.0, 0.5], [2, 3, 1])
    advantages, returns = adv.remax(
        token_rewards=rewards, response_mask=mask, baseline_scores=torch.tensor([0.5, 0.5, 0.5])
    )
    assert advantages.tolist() == [[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5], [0.0, 0.0, 0.0]]
    assert (returns * mask).tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0]]


def test_reinforce_plus_plus_baseline_by_hand():
    # group 1: scores 1, 0 (one token each) -> centred 0.5, -0.5; group 2: alone -> 0
    rewards, mask = outcome_batch([1.0, 0.0, 3.0], [1, 1, 1])
    groups = torch.tensor([1, 1, 2])
    raw, _ = adv.reinforce_plus_plus_baseline(
        token_rewards=rewards, response_mask=mask, group_ids=groups, whiten=False
    )
    assert raw[:, 0].tolist() == [0.5, -0.5, 0.0]
    # whitened over the 3 tokens {0.5, -0.5, 0}: mean 0, population std sqrt(1/6)
    whitened, _ = adv.reinforce_plus_plus_baseline(token_rewards=rewards, response_mask=mask, group_ids=groups)
    s = math.sqrt(1 / 6)
    assert whitened[:, 0].tolist() == pytest.approx([0.5 / s, -0.5 / s, 0.0], abs=1e-6)


def test_reinforce_plus_plus_by_hand():
    # gamma 0.5, reward 1 on the last of 3 tokens: G = 0.25, 0.5, 1
    rewards, mask = outcome_batch([1.0], [3])
    raw, returns = adv.reinforce_plus_plus(token_rewards=rewards, response_mask=mask, gamma=0.5, whiten=False)
    assert returns.tolist() == [[0.25, 0.5, 1.0]]
    assert torch.equal(raw, returns)
    whitened, _ = adv.reinforce_plus_plus(token_rewards=rewards, response_mask=mask, gamma=0.5)
    g = torch.tensor([0.25, 0.5, 1.0])
    expected = (g - g.mean()) / g.std(unbiased=False)
    assert whitened[0].tolist() == pytest.approx(expected.tolist(), abs=1e-6)


# --------------------------------------------------------------------------
# Hand-computed GAE
# --------------------------------------------------------------------------


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    advantages, returns = adv.gae(
        token_rewards=rewards, values=values, response_mask=mask, gamma=0.9, lam=0.8, whiten=False
    )
    # t=2: delta = 1 - 0.7 = 0.3                     A = 0.3
    # t=1: delta = 0.9 * 0.7 - 0.6 = 0.03            A = 0.03 + 0.72 * 0.3   = 0.246
    # t=0: delta = 0.9 * 0.6 - 0.5 = 0.04            A = 0.04 + 0.72 * 0.246 = 0.21712
    assert advantages[0].tolist() == pytest.approx([0.21712, 0.246, 0.3], abs=1e-6)
    assert returns[0].tolist() == pytest.approx([0.71712, 0.846, 1.0], abs=1e-6)


def test_gae_skips_tool_tokens_and_credits_their_rewards_to_the_previous_policy_token():
    # policy tokens at t=0 and t=3; tokens 1, 2 are tool output, token 4 trailing env text.
    mask = torch.tensor([[1.0, 0, 0, 1, 0]])
    rewards = torch.tensor([[0.0, 0.5, 0, 0, 1.0]])
    values = torch.tensor([[1.0, 9, 9, 2, 9]])  # values on masked tokens must be ignored
    advantages, returns = adv.gae(
        token_rewards=rewards, values=values, response_mask=mask, gamma=0.9, lam=0.5, whiten=False
    )
    # t=3: r' = 0 + 1 (trailing)  delta = 1 - 2 = -1                     A = -1
    # t=0: r' = 0 + 0.5 (tool)    delta = 0.5 + 0.9 * 2 - 1 = 1.3         A = 1.3 + 0.45 * (-1) = 0.85
    assert advantages[0].tolist() == pytest.approx([0.85, 0, 0, -1.0, 0], abs=1e-6)
    assert returns[0].tolist() == pytest.approx([1.85, 0, 0, 1.0, 0], abs=1e-6)


def test_gae_drops_rewards_before_the_first_policy_token():
    mask = torch.tensor([[0.0, 1, 1]])
    rewards = torch.tensor([[5.0, 0, 1]])
    advantages, _ = adv.gae(
        token_rewards=rewards, values=torch.zeros(1, 3), response_mask=mask, gamma=1.0, lam=1.0, whiten=False
    )
    assert advantages.tolist() == [[0.0, 1.0, 1.0]]


def test_gae_ignores_non_finite_values_on_padding():
    values = torch.tensor([[0.5, float("nan"), float("inf")]])
    advantages, returns = adv.gae(
        token_rewards=torch.tensor([[1.0, 0, 0]]), values=values, response_mask=torch.tensor([[1.0, 0, 0]]),
        whiten=False,
    )
    assert advantages.tolist() == [[0.5, 0.0, 0.0]]
    assert returns.tolist() == [[1.0, 0.0, 0.0]]


def test_gae_whitening_gives_zero_mean_unit_std_over_policy_tokens():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    mask = (torch.arange(6) < torch.tensor([[6], [3], [1], [5]])).float()
    advantages, _ = adv.gae(token_rewards=rewards * mask, values=values, response_mask=mask)
    on = advantages[mask > 0]
    assert on.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert on.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)
    assert (advantages[mask == 0] == 0).all()


def test_long_rows_cross_the_chunk_boundaries_of_the_fast_path():
    # T = 150 spans three 64-step chunks; compare against the plain recursion.
    g = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(3, 150, generator=g), torch.randn(3, 150, generator=g)
    mask = torch.ones(3, 150)
    advantages, _ = adv.gae(token_rewards=rewards, values=values, response_mask=mask, gamma=0.99, lam=0.9, whiten=False)
    expected, _ = reference_gae(rewards, values, mask, 0.99, 0.9)
    torch.testing.assert_close(advantages, expected, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------
# Loop references (tests only) and random batches
# --------------------------------------------------------------------------


def reference_gae(rewards, values, mask, gamma, lam):
    """Per row, per token, in float64: the documented semantics spelled out."""
    B, T = mask.shape
    advantages = torch.zeros(B, T, dtype=torch.float64)
    returns = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        steps = [t for t in range(T) if mask[b, t] > 0]
        credited = {}
        for i, t in enumerate(steps):
            until = steps[i + 1] if i + 1 < len(steps) else T
            credited[t] = sum(float(rewards[b, k]) for k in range(t, until))
        next_advantage = next_value = 0.0
        for t in reversed(steps):
            delta = credited[t] + gamma * next_value - float(values[b, t])
            next_advantage = delta + gamma * lam * next_advantage
            next_value = float(values[b, t])
            advantages[b, t] = next_advantage
            returns[b, t] = next_advantage + next_value
    return advantages.float(), returns.float()


def reference_group_baselines(scores, group_ids, lengths):
    """Per group, by a plain loop: grpo, Dr. GRPO, rloo, opo advantages per response."""
    out = {k: [0.0] * len(scores) for k in ("grpo", "drgrpo", "rloo", "opo")}
    for g in set(group_ids):
        members = [i for i, x in enumerate(group_ids) if x == g]
        rs = [scores[i] for i in members]
        n = len(rs)
        if n == 1 or len(set(rs)) == 1:
            continue  # documented: groups of one and all-equal groups get 0
        mean = sum(rs) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (n - 1))
        total_length = sum(lengths[i] for i in members)
        opo_baseline = sum(lengths[i] * scores[i] for i in members) / max(total_length, 1)
        for i in members:
            others = [scores[j] for j in members if j != i]
            out["grpo"][i] = (scores[i] - mean) / (std + 1e-6)
            out["drgrpo"][i] = scores[i] - mean
            out["rloo"][i] = scores[i] - sum(others) / len(others)
            out["opo"][i] = scores[i] - opo_baseline
    return out


def random_batch(seed, B, T, layout, stray_rewards, n_groups):
    g = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        lengths = torch.randint(0, T + 1, (B,), generator=g)
        mask = (torch.arange(T) < lengths[:, None]).float()
    else:  # tool tokens anywhere, including leading ones
        mask = (torch.rand(B, T, generator=g) < 0.6).float()
    rewards = torch.randn(B, T, generator=g).round(decimals=1)
    if not stray_rewards:
        rewards = rewards * mask
    values = torch.randn(B, T, generator=g)
    # Non-contiguous, unsorted ids (multiples of 13 shuffled), with repeats.
    group_ids = (torch.randint(0, n_groups, (B,), generator=g) * 13 + 5)[torch.randperm(B, generator=g)]
    return rewards, values, mask, group_ids


batches = st.builds(
    random_batch,
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 9),
    T=st.integers(1, 10),
    layout=st.sampled_from(["contiguous", "holes"]),
    stray_rewards=st.booleans(),
    n_groups=st.integers(1, 4),
)


@SETTINGS
@given(batch=batches, gamma=st.sampled_from([0.0, 0.5, 0.9, 1.0]), lam=st.sampled_from([0.0, 0.7, 1.0]))
def test_gae_matches_the_loop_reference(batch, gamma, lam):
    rewards, values, mask, _ = batch
    advantages, returns = adv.gae(
        token_rewards=rewards, values=values, response_mask=mask, gamma=gamma, lam=lam, whiten=False
    )
    expected_advantages, expected_returns = reference_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(advantages, expected_advantages, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(returns, expected_returns, atol=1e-5, rtol=1e-5)
    assert advantages.dtype == returns.dtype == torch.float32


@SETTINGS
@given(batch=batches, gamma=st.sampled_from([0.5, 1.0]))
def test_discounted_returns_are_gae_with_zero_values_and_lam_one(batch, gamma):
    rewards, _, mask, _ = batch
    returns = adv.discounted_returns(rewards, mask, gamma)
    expected, _ = reference_gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)
    torch.testing.assert_close(returns, expected, atol=1e-5, rtol=1e-5)


@SETTINGS
@given(batch=batches)
def test_gae_with_gamma_lam_one_and_zero_values_is_the_reward_to_go(batch):
    rewards, _, _, _ = batch
    B, T = rewards.shape
    mask = torch.ones(B, T)
    advantages, _ = adv.gae(
        token_rewards=rewards, values=torch.zeros(B, T), response_mask=mask, gamma=1.0, lam=1.0, whiten=False
    )
    reward_to_go = rewards.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(advantages, reward_to_go, atol=1e-5, rtol=1e-5)


@SETTINGS
@given(batch=batches)
def test_group_estimators_match_the_per_group_loop(batch):
    rewards, _, mask, group_ids = batch
    scores = rewards.sum(-1).tolist()
    lengths = mask.sum(-1).tolist()
    expected = reference_group_baselines(scores, group_ids.tolist(), lengths)
    fields = {"token_rewards": rewards, "response_mask": mask, "group_ids": group_ids}
    got = {
        "grpo": adv.grpo(**fields)[0],
        "drgrpo": adv.grpo(**fields, norm_by_std=False)[0],
        "rloo": adv.rloo(**fields)[0],
        "opo": adv.opo(**fields)[0],
    }
    for name, advantages in got.items():
        want = torch.tensor(expected[name], dtype=torch.float32)[:, None] * (mask > 0)
        torch.testing.assert_close(advantages, want, atol=1e-4, rtol=1e-4, msg=name)


def per_response(advantages, mask):
    """A_i read at each row's first policy token (0 for an empty row)."""
    return advantages.gather(1, mask.argmax(-1, keepdim=True)).squeeze(1).double()


@SETTINGS
@given(batch=batches, shift=st.integers(-3, 3))
def test_group_advantages_have_zero_mean_and_ignore_a_constant_shift(batch, shift):
    rewards, _, mask, group_ids = batch
    # Shift each group's returns by its own constant (placed on the first token).
    shifted = rewards.clone()
    shifted[:, 0] += (group_ids % 5 - 2).float() * shift
    full = torch.ones_like(mask)  # these estimators' A_i do not depend on the mask
    for fn, kwargs in [
        (adv.grpo, {}), (adv.grpo, {"norm_by_std": False}), (adv.rloo, {}),
        (adv.reinforce_plus_plus_baseline, {"whiten": False}),
    ]:
        base, _ = fn(token_rewards=rewards, response_mask=full, group_ids=group_ids, **kwargs)
        moved, _ = fn(token_rewards=shifted, response_mask=full, group_ids=group_ids, **kwargs)
        torch.testing.assert_close(base, moved, atol=2e-4, rtol=1e-4)
        a = per_response(base, full)
        for g in group_ids.unique():
            assert abs(a[group_ids == g].sum().item()) < 1e-4
    # OPO's baseline is the length-weighted mean, so the length-weighted mean of A is 0.
    base, _ = adv.opo(token_rewards=rewards, response_mask=mask, group_ids=group_ids)
    moved, _ = adv.opo(token_rewards=shifted, response_mask=mask, group_ids=group_ids)
    torch.testing.assert_close(base, moved, atol=2e-4, rtol=1e-4)
    a, lengths = per_response(base, mask), mask.sum(-1).double()
    for g in group_ids.unique():
        members = group_ids == g
        assert abs((a[members] * lengths[members]).sum().item()) < 1e-4 * max(1.0, lengths[members].sum().item())


@SETTINGS
@given(batch=batches)
def test_outputs_are_float32_and_zero_outside_the_mask(batch):
    rewards, values, mask, group_ids = batch
    fields = {
        "token_rewards": rewards, "response_mask": mask, "group_ids": group_ids, "values": values,
        "baseline_scores": torch.zeros(rewards.shape[0]),
    }
    for name, fn in NAMES.items():
        advantages, returns = call_with_fields(fn, fields, {})
        for out in (advantages, returns):
            assert out.shape == rewards.shape and out.dtype == torch.float32, name
            assert torch.isfinite(out).all(), name
        assert (advantages[mask == 0] == 0).all(), name
        if name in PER_TOKEN_RETURNS:
            assert (returns[mask == 0] == 0).all(), name
        else:  # outcome estimators: R_i on every token of the row, padding included
            assert torch.equal(returns, rewards.sum(-1, keepdim=True).expand_as(returns)), name


# --------------------------------------------------------------------------
# Groups of one, all-equal groups, empty batches
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo", "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("score", [0.1, 1.0, -7.3, 1e6])
def test_groups_of_one_and_all_equal_groups_get_exactly_zero(name, score):
    # 0.1 * 3 / 3 != 0.1 in floating point: equality must be tested, not computed.
    rewards, mask = outcome_batch([score, score, score, score], [2, 1, 3, 2])
    groups = torch.tensor([9, 9, 9, 4])  # an all-equal group of 3 and a group of one
    kwargs = {"whiten": False} if name == "reinforce_plus_plus_baseline" else {}
    advantages, _ = NAMES[name](token_rewards=rewards, response_mask=mask, group_ids=groups, **kwargs)
    assert (advantages == 0).all()


def test_whitening_an_all_equal_batch_gives_exactly_zero():
    # 0.1 has no exact float mean over 7 copies; the result must still be exactly 0.
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0]])
    assert (adv.masked_whiten(torch.full((3, 4), 0.1), mask) == 0).all()
    advantages, _ = adv.reinforce_plus_plus(token_rewards=torch.full((3, 4), 0.1) * mask, response_mask=mask, gamma=0.0)
    assert (advantages == 0).all()


@pytest.mark.parametrize("name", sorted(NAMES))
def test_all_empty_responses_give_zeros_not_nan(name):
    B, T = 3, 4
    fields = {
        "token_rewards": torch.zeros(B, T), "response_mask": torch.zeros(B, T),
        "group_ids": torch.tensor([1, 1, 2]), "values": torch.zeros(B, T),
        "baseline_scores": torch.zeros(B),
    }
    advantages, returns = call_with_fields(NAMES[name], fields, {})
    assert (advantages == 0).all() and (returns == 0).all()


# --------------------------------------------------------------------------
# Errors a person can act on
# --------------------------------------------------------------------------


def test_float_group_ids_are_rejected_with_the_reason():
    rewards, mask = outcome_batch([1.0, 0.0], [1, 1])
    with pytest.raises(ValueError, match=r"grpo: group_ids must be an integer tensor.*float32"):
        adv.grpo(token_rewards=rewards, response_mask=mask, group_ids=torch.tensor([1.0, 1.0]))


def test_mismatched_shapes_name_both_tensors():
    with pytest.raises(ValueError, match=r"gae: values has shape \(2, 3\) but token_rewards has \(2, 4\)"):
        adv.gae(token_rewards=torch.zeros(2, 4), values=torch.zeros(2, 3), response_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"rloo: group_ids has shape \(3,\) but must be \[B\] = \(2,\)"):
        adv.rloo(token_rewards=torch.zeros(2, 4), response_mask=torch.ones(2, 4), group_ids=torch.tensor([1, 2, 3]))


def test_discount_outside_the_unit_interval_is_rejected():
    with pytest.raises(ValueError, match=r"gae: lam must be in \[0, 1\], got 1.5"):
        adv.gae(token_rewards=torch.zeros(1, 2), values=torch.zeros(1, 2), response_mask=torch.ones(1, 2), lam=1.5)


def test_gae_stays_exact_when_float32_matmuls_are_allowed_to_lose_precision():
    g = torch.Generator().manual_seed(2)
    rewards, values = torch.randn(4, 130, generator=g), torch.randn(4, 130, generator=g)
    mask = torch.ones(4, 130)
    expected, _ = reference_gae(rewards, values, mask, 0.99, 0.95)
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")  # allows bf16 / TF32 matmuls
        advantages, _ = adv.gae(
            token_rewards=rewards, values=values, response_mask=mask, gamma=0.99, lam=0.95, whiten=False
        )
    finally:
        torch.set_float32_matmul_precision(previous)
    torch.testing.assert_close(advantages, expected, atol=1e-4, rtol=1e-5)


def test_a_group_equal_up_to_float_rounding_gets_zero_advantage():
    # 1.0 + 0.1 + 0.2 and 1.3 are the same return, but their float32 sums differ by one ulp
    # (1.3000001 vs 1.2999999). Dividing that by its own tiny std used to give +-0.7.
    rewards = torch.tensor([[1.0, 0.1, 0.2], [1.3, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.ones_like(rewards)
    group_ids = torch.tensor([7, 7, 9, 9])
    assert rewards[0].sum() != rewards[1].sum()
    for fn, kwargs in [(adv.grpo, {}), (adv.grpo, {"norm_by_std": False}), (adv.rloo, {})]:
        advantages, _ = fn(token_rewards=rewards, response_mask=mask, group_ids=group_ids, **kwargs)
        assert advantages[:2].abs().max().item() == 0.0, fn.__name__
        assert advantages[2:].abs().min().item() > 0.4  # a real difference still counts
