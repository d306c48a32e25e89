"""The advantage estimators peers ship: grpo_passk, gdpo, gpg, optimal_token_baseline.

Hand-derived numbers, a literal per-group loop transcription of each published
formula (the conformance tests, including masking, groups of one and all-equal
groups), and invariants.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rltk
from rltk.algorithms import advantages as adv
from tests.algorithms.calls import call_with_fields

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None)

NAMES = {
    "grpo_passk": adv.grpo_passk,
    "gdpo": adv.gdpo,
    "gpg": adv.gpg,
    "optimal_token_baseline": adv.optimal_token_baseline,
}


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


def per_response(advantages, mask):
    """The advantage each response carries on its policy tokens (0 for an empty one)."""
    return (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)


@pytest.mark.parametrize("name", sorted(NAMES))
def test_every_estimator_is_registered_under_verls_name(name):
    entry = {e.name: e for e in rltk.list_components("advantage_fn")}[name]
    assert entry.obj is NAMES[name] and entry.plugin == "rltk:advantages"
    assert "arXiv:" in NAMES[name].__doc__ and "Shape:" in NAMES[name].__doc__


# --------------------------------------------------------------------------
# grpo_passk
# --------------------------------------------------------------------------


def test_grpo_passk_by_hand():
    # group 7: returns 1, 0, 0.5 -> only the best is credited: (1 - 0.5) / (std 0.5 + eps)
    # group 3: a tie at the top (1, 1, 0) -> 0; group 5: a group of one -> 0
    rewards, mask = outcome_batch([1.0, 0.0, 0.5, 1.0, 1.0, 0.0, 2.0], [2, 3, 1, 2, 2, 2, 1])
    groups = torch.tensor([7, 7, 7, 3, 3, 3, 5])
    advantages, returns = adv.grpo_passk(token_rewards=rewards, response_mask=mask, group_ids=groups)
    assert per_response(advantages, mask).tolist() == pytest.approx([0.5 / (0.5 + 1e-6), 0, 0, 0, 0, 0, 0])
    assert advantages[0].tolist() == pytest.approx([0.5 / (0.5 + 1e-6)] * 2 + [0.0])
    assert per_response(returns, mask).tolist() == pytest.approx([1.0, 0.0, 0.5, 1.0, 1.0, 0.0, 2.0])
    advantages, _ = adv.grpo_passk(token_rewards=rewards, response_mask=mask, group_ids=groups, norm_by_std=False)
    assert per_response(advantages, mask).tolist() == pytest.approx([0.5, 0, 0, 0, 0, 0, 0])


def reference_passk(scores, group_ids, norm_by_std=True, eps=1e-6):
    """verl's loop: topk(2) per group, the best gets r_max - r_second (over the group std); groups of
    one give 0 here (verl raises)."""
    out = [0.0] * len(scores)
    for g in set(group_ids):
        members = [i for i, x in enumerate(group_ids) if x == g]
        if len(members) < 2:
            continue
        rs = torch.tensor([scores[i] for i in members], dtype=torch.float64)
        top, index = torch.topk(rs, 2)
        gap = (top[0] - top[1]).item()
        if norm_by_std:
            gap /= rs.std().item() + eps
        out[members[index[0].item()]] = gap
    return out


def random_outcomes(seed, B, n_groups, levels):
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randint(0, levels, (B,), generator=g) / max(levels - 1, 1)).tolist()
    lengths = torch.randint(0, 5, (B,), generator=g).tolist()
    groups = (torch.randint(0, n_groups, (B,), generator=g) * 11 + 3).tolist()
    return scores, lengths, groups


outcomes = st.builds(random_outcomes, seed=st.integers(0, 2**31 - 1), B=st.integers(1, 10),
                     n_groups=st.integers(1, 4), levels=st.integers(1, 5))


@SETTINGS
@given(batch=outcomes, norm_by_std=st.booleans())
def test_grpo_passk_matches_the_loop_reference(batch, norm_by_std):
    scores, lengths, groups = batch
    rewards, mask = outcome_batch(scores, lengths, T=5)
    advantages, _ = adv.grpo_passk(token_rewards=rewards, response_mask=mask, group_ids=torch.tensor(groups),
                                   norm_by_std=norm_by_std)
    # an empty response has no token to carry its reward: its return is 0
    expected = torch.tensor(reference_passk(rewards.sum(-1).tolist(), groups, norm_by_std), dtype=torch.float32)
    torch.testing.assert_close(advantages, expected[:, None] * mask, atol=1e-5, rtol=1e-5)
    # at most one credited response per group, never a negative advantage
    assert (advantages >= 0).all()


# --------------------------------------------------------------------------
# gdpo
# --------------------------------------------------------------------------


def test_gdpo_by_hand():
    # Two rewards, weights 1 and 2. Group 0: r0 = (1, 0), r1 = (1, 0): each normalises to +-1/sqrt(2).
    # Group 1: r0 = (1, 1) all equal -> 0; r1 = (2, 0) -> +-1/sqrt(2).
    components = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 2.0], [1.0, 0.0]])
    mask = torch.ones(4, 3)
    groups = torch.tensor([0, 0, 1, 1])
    eps = 1e-6
    unit = 0.5 / (1 / math.sqrt(2) + eps)  # a pair (1, 0): +-0.5 over its unbiased std 0.7071
    unit1 = 1.0 / (math.sqrt(2) + eps)  # a pair (2, 0): +-1 over std 1.4142
    advantages, returns = adv.gdpo(reward_components=components, response_mask=mask, group_ids=groups,
                                   reward_weights=[1.0, 2.0], whiten=False)
    expected = [3 * unit, -3 * unit, 2 * unit1, -2 * unit1]
    assert per_response(advantages, mask).tolist() == pytest.approx(expected, rel=1e-6)
    assert per_response(returns, mask).tolist() == pytest.approx([3.0, 0.0, 5.0, 1.0])
    # whitening over the 12 policy tokens (3 per response): mean 0, population std of the four values
    advantages, _ = adv.gdpo(reward_components=components, response_mask=mask, group_ids=groups,
                             reward_weights=[1.0, 2.0])
    std = math.sqrt(sum(a * a for a in expected) / 4)
    assert per_response(advantages, mask).tolist() == pytest.approx([a / (std + 1e-8) for a in expected], rel=1e-6)


def test_gdpo_keeps_a_weak_reward_that_grpo_drowns():
    # GRPO on the sum: 10 * correctness + format; the format reward barely moves the advantage.
    components = torch.tensor([[10.0, 0.0], [10.0, 1.0], [0.0, 0.0], [0.0, 1.0]])
    mask = torch.ones(4, 1)
    groups = torch.zeros(4, dtype=torch.long)
    advantages, _ = adv.gdpo(reward_components=components, response_mask=mask, group_ids=groups, whiten=False)
    a = advantages[:, 0]
    # each reward contributes +-0.866 (= 0.5 / std 0.577): the format step is as large as the correctness step
    assert (a[1] - a[0]).item() == pytest.approx((a[0] - a[2]).item(), rel=1e-5)
    summed = components.sum(-1, keepdim=True)
    grpo, _ = adv.grpo(token_rewards=summed, response_mask=mask, group_ids=groups)
    assert (grpo[1, 0] - grpo[0, 0]).item() < 0.2 * (grpo[0, 0] - grpo[2, 0]).item()


def reference_gdpo(components, group_ids, weights, norm_by_std, eps=1e-6):
    """Per reward and per group, by loops: (r - mean) / (std + eps); groups of one / all-equal -> 0."""
    B, K = len(components), len(components[0])
    out = [0.0] * B
    for k in range(K):
        for g in set(group_ids):
            members = [i for i, x in enumerate(group_ids) if x == g]
            rs = [components[i][k] for i in members]
            if len(rs) == 1 or len(set(rs)) == 1:
                continue
            mean = sum(rs) / len(rs)
            std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (len(rs) - 1))
            for i in members:
                out[i] += weights[k] * ((components[i][k] - mean) / (std + eps) if norm_by_std else components[i][k] - mean)
    return out


@SETTINGS
@given(batch=outcomes, K=st.integers(1, 3), norm_by_std=st.booleans(), seed=st.integers(0, 1000))
def test_gdpo_matches_the_loop_reference_and_whitens_over_policy_tokens(batch, K, norm_by_std, seed):
    _, lengths, groups = batch
    B = len(groups)
    g = torch.Generator().manual_seed(seed)
    components = torch.randint(0, 3, (B, K), generator=g).float()
    weights = (torch.rand(K, generator=g) + 0.5).tolist()
    _, mask = outcome_batch([0.0] * B, lengths, T=5)
    ids = torch.tensor(groups)
    raw, _ = adv.gdpo(reward_components=components, response_mask=mask, group_ids=ids, reward_weights=weights,
                      norm_by_std=norm_by_std, whiten=False)
    expected = torch.tensor(reference_gdpo(components.tolist(), groups, weights, norm_by_std), dtype=torch.float32)
    torch.testing.assert_close(raw, expected[:, None] * mask, atol=1e-5, rtol=1e-5)
    whitened, _ = adv.gdpo(reward_components=components, response_mask=mask, group_ids=ids, reward_weights=weights,
                           norm_by_std=norm_by_std)
    torch.testing.assert_close(whitened, adv.masked_whiten(raw, mask), atol=1e-5, rtol=1e-5)


@SETTINGS
@given(batch=outcomes)
def test_gdpo_with_one_reward_and_no_whitening_is_grpo(batch):
    scores, lengths, groups = batch
    rewards, mask = outcome_batch(scores, lengths, T=5)
    ids = torch.tensor(groups)
    ours, _ = adv.gdpo(reward_components=rewards.sum(-1, keepdim=True), response_mask=mask, group_ids=ids,
                       whiten=False)
    grpo, _ = adv.grpo(token_rewards=rewards, response_mask=mask, group_ids=ids)
    torch.testing.assert_close(ours, grpo, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "components, weights, message",
    [
        (torch.zeros(2), None, r"gdpo: reward_components must be a \[B, K\] tensor .*got shape \(2,\)"),
        (torch.zeros(2, 0), None, r"K >= 1 .*got shape \(2, 0\)"),
        (torch.zeros(3, 2), None, r"reward_components has 3 rows but response_mask \(2, 4\) has 2"),
        (torch.zeros(2, 2), [1.0], r"reward_weights must be 2 finite numbers, .*got \[1.0\]"),
    ],
)
def test_gdpo_rejects_inputs_it_cannot_use(components, weights, message):
    with pytest.raises(ValueError, match=message):
        adv.gdpo(reward_components=components, response_mask=torch.ones(2, 4), group_ids=torch.tensor([0, 0]),
                 reward_weights=weights)


# --------------------------------------------------------------------------
# gpg
# --------------------------------------------------------------------------


def test_gpg_by_hand():
    # groups: (1, 0) has signal; (1, 1) all equal and (0.5) alone have none: B = 5, B - M = 2
    rewards, mask = outcome_batch([1.0, 0.0, 1.0, 1.0, 0.5], [2, 1, 3, 1, 2])
    groups = torch.tensor([1, 1, 2, 2, 3])
    advantages, _ = adv.gpg(token_rewards=rewards, response_mask=mask, group_ids=groups)
    assert per_response(advantages, mask).tolist() == pytest.approx([1.25, -1.25, 0.0, 0.0, 0.0])
    advantages, _ = adv.gpg(token_rewards=rewards, response_mask=mask, group_ids=groups, f_norm=2.0)
    assert per_response(advantages, mask).tolist() == pytest.approx([0.625, -0.625, 0.0, 0.0, 0.0])


def reference_gpg(scores, group_ids, f_norm=1.0):
    """The paper's estimator by loops: alpha = B / (B - M), M the responses in groups without signal."""
    centred = [0.0] * len(scores)
    informative = 0
    for g in set(group_ids):
        members = [i for i, x in enumerate(group_ids) if x == g]
        rs = [scores[i] for i in members]
        if len(rs) == 1 or len(set(rs)) == 1:
            continue
        informative += len(rs)
        for i in members:
            centred[i] = scores[i] - sum(rs) / len(rs)
    alpha = len(scores) / max(informative, 1)
    return [alpha * c / f_norm for c in centred]


@SETTINGS
@given(batch=outcomes, f_norm=st.sampled_from([1.0, 0.5, 3.0]))
def test_gpg_matches_the_loop_reference(batch, f_norm):
    scores, lengths, groups = batch
    rewards, mask = outcome_batch(scores, lengths, T=5)
    advantages, _ = adv.gpg(token_rewards=rewards, response_mask=mask, group_ids=torch.tensor(groups), f_norm=f_norm)
    expected = torch.tensor(reference_gpg(rewards.sum(-1).tolist(), groups, f_norm), dtype=torch.float32)
    torch.testing.assert_close(advantages, expected[:, None] * mask, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("f_norm", [0.0, -1.0, float("inf")])
def test_gpg_rejects_a_normaliser_that_is_not_positive(f_norm):
    rewards, mask = outcome_batch([1.0, 0.0], [1, 1])
    with pytest.raises(ValueError, match=rf"gpg: f_norm must be a number > 0 .*got {f_norm!r}"):
        adv.gpg(token_rewards=rewards, response_mask=mask, group_ids=torch.tensor([0, 0]), f_norm=f_norm)


# --------------------------------------------------------------------------
# optimal_token_baseline
# --------------------------------------------------------------------------


def otb_inputs():
    # response 0: 2 tokens, reward 1;  response 1: 3 tokens, reward 0.5 (same prompt)
    rewards, mask = outcome_batch([1.0, 0.5], [2, 3])
    # per-token energy w = 1 - 2 pi + sum pi^2: 0.5 for response 0 (pi 0.5, sum 0.5), 0.75 for response 1
    old_logprobs = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.25, 0.25, 0.25]]))
    sum_pi_squared = torch.tensor([[0.5, 0.5, 0.5], [0.25, 0.25, 0.25]])
    return rewards, mask, old_logprobs, sum_pi_squared


def test_optimal_token_baseline_by_hand():
    rewards, mask, old_logprobs, sum_pi_squared = otb_inputs()
    groups = torch.tensor([4, 4])
    advantages, returns = adv.optimal_token_baseline(
        token_rewards=rewards, response_mask=mask, group_ids=groups, old_logprobs=old_logprobs,
        sum_pi_squared=sum_pi_squared,
    )
    # W: (0.5, 1.0) and (0.75, 1.5, 2.25); G: (1, 1) and (0.5, 0.5, 0.5)
    # t=0: B = (1 * 0.5 + 0.5 * 0.75) / 1.25 = 0.7;  t=1: B = (1 * 1 + 0.5 * 1.5) / 2.5 = 0.7
    # t=2: only response 1 is left: baseline 0 (zero tail), A = G = 0.5
    torch.testing.assert_close(advantages, torch.tensor([[0.3, 0.3, 0.0], [-0.2, -0.2, 0.5]]))
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 0.0], [0.5, 0.5, 0.5]]))
    advantages, _ = adv.optimal_token_baseline(
        token_rewards=rewards, response_mask=mask, group_ids=groups, old_logprobs=old_logprobs,
        sum_pi_squared=sum_pi_squared, handle_zero_tail=False,
    )
    assert advantages[1, 2].item() == 0.0  # its own return as the baseline


def test_optimal_token_baseline_groups_of_one_and_all_equal_groups_get_exactly_zero():
    rewards, mask = outcome_batch([0.1, 0.1, 0.1, 0.7], [2, 3, 3, 2])
    old_logprobs = torch.log(torch.rand(4, 3, generator=torch.Generator().manual_seed(0)) * 0.9 + 0.05)
    sum_pi_squared = torch.rand(4, 3, generator=torch.Generator().manual_seed(1))
    for handle_zero_tail in (True, False):
        advantages, _ = adv.optimal_token_baseline(
            token_rewards=rewards, response_mask=mask, group_ids=torch.tensor([2, 2, 2, 9]),
            old_logprobs=old_logprobs, sum_pi_squared=sum_pi_squared, handle_zero_tail=handle_zero_tail,
        )
        assert (advantages == 0).all()


def reference_otb(rewards, mask, group_ids, old_logprobs, sum_pi_squared, handle_zero_tail=True):
    """verl's optimal token baseline by its per-group loop (contiguous masks), with groups of one at 0
    and no zero tail in a group whose returns are all equal (the documented differences)."""
    returns = (rewards * mask).flip(-1).cumsum(-1).flip(-1).double()
    w = 1 - 2 * old_logprobs.double().exp() + sum_pi_squared.double()
    W = (w * mask).cumsum(-1)
    baselines = torch.zeros_like(returns)
    alone = []
    for g in set(group_ids.tolist()):
        idx = [i for i, x in enumerate(group_ids.tolist()) if x == g]
        if len(idx) == 1:
            alone.append(idx[0])
            continue
        G, Wg, m = returns[idx], W[idx], mask[idx].double()
        baselines[idx] = ((G * Wg * m).sum(0) / (Wg * m).sum(0).clamp(min=1e-300)).expand(len(idx), -1)
        if handle_zero_tail and len(set((rewards[idx] * mask[idx]).sum(-1).tolist())) > 1:
            lengths = m.sum(-1)
            ordered = lengths.sort().values
            longest = (lengths == ordered[-1]).nonzero()[:, 0]
            if len(longest) == 1 and ordered[-1] > ordered[-2]:
                baselines[idx[longest[0]], int(ordered[-2]):] = 0.0
    advantages = (returns - baselines) * mask
    advantages[alone] = 0.0
    return advantages.float(), (returns * mask).float()


@SETTINGS
@given(batch=outcomes, zero_tail=st.booleans(), seed=st.integers(0, 1000), dense=st.booleans())
def test_optimal_token_baseline_matches_the_loop_reference(batch, zero_tail, seed, dense):
    scores, lengths, groups = batch
    g = torch.Generator().manual_seed(seed)
    rewards, mask = outcome_batch(scores, lengths, T=5)
    if dense:  # process rewards on every policy token
        rewards = torch.randn(rewards.shape, generator=g).round(decimals=1) * mask
    old_logprobs = torch.log(torch.rand(mask.shape, generator=g) * 0.9 + 0.05)
    # sum_v pi(v)^2 >= pi^2 for the sampled token's own probability
    sum_pi_squared = old_logprobs.exp() ** 2 + torch.rand(mask.shape, generator=g) * 0.3
    ids = torch.tensor(groups)
    advantages, returns = adv.optimal_token_baseline(
        token_rewards=rewards, response_mask=mask, group_ids=ids, old_logprobs=old_logprobs,
        sum_pi_squared=sum_pi_squared, handle_zero_tail=zero_tail,
    )
    expected, expected_returns = reference_otb(rewards, mask, ids, old_logprobs, sum_pi_squared, zero_tail)
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(returns, expected_returns, atol=1e-5, rtol=1e-5)


@SETTINGS
@given(batch=outcomes, seed=st.integers(0, 1000))
def test_optimal_token_baseline_with_equal_energies_is_the_per_position_group_mean(batch, seed):
    """With the same per-token energy everywhere, W_t is proportional to t + 1 for every response, so
    B*_t is the plain mean of G_t over the responses present at t."""
    scores, lengths, groups = batch
    rewards, mask = outcome_batch(scores, lengths, T=5)
    advantages, returns = adv.optimal_token_baseline(
        token_rewards=rewards, response_mask=mask, group_ids=torch.tensor(groups),
        old_logprobs=torch.full(mask.shape, math.log(0.5)), sum_pi_squared=torch.full(mask.shape, 0.5),
        handle_zero_tail=False,
    )
    for i, gi in enumerate(groups):
        members = [j for j, x in enumerate(groups) if x == gi]
        for t in range(int(mask[i].sum())):
            present = [j for j in members if mask[j, t] > 0]
            expected = 0.0 if len(members) == 1 else returns[i, t] - sum(returns[j, t] for j in present) / len(present)
            assert advantages[i, t].item() == pytest.approx(float(expected), abs=1e-5)


def test_optimal_token_baseline_needs_sum_pi_squared_and_says_so():
    rewards, mask, old_logprobs, _ = otb_inputs()
    fields = {"token_rewards": rewards, "response_mask": mask, "group_ids": torch.tensor([1, 1]),
              "old_logprobs": old_logprobs}
    with pytest.raises(TypeError, match="sum_pi_squared"):
        call_with_fields(adv.optimal_token_baseline, fields, {})
    with pytest.raises(ValueError, match=r"sum_pi_squared has shape \(2, 2\) but token_rewards has \(2, 3\)"):
        adv.optimal_token_baseline(**fields, sum_pi_squared=torch.zeros(2, 2))


# --------------------------------------------------------------------------
# Shared: outputs, empty batches, groups of one
# --------------------------------------------------------------------------


def fields_for(B, T, rewards, mask, groups):
    g = torch.Generator().manual_seed(B * 31 + T)
    return {
        "token_rewards": rewards, "response_mask": mask, "group_ids": groups,
        "reward_components": torch.stack([rewards.sum(-1), rewards.sum(-1) * 0.5], dim=-1),
        "old_logprobs": torch.log(torch.rand(B, T, generator=g) * 0.9 + 0.05),
        "sum_pi_squared": torch.rand(B, T, generator=g),
    }


@pytest.mark.parametrize("name", sorted(NAMES))
def test_all_empty_responses_give_zeros_not_nan(name):
    B, T = 3, 4
    fields = fields_for(B, T, torch.zeros(B, T), torch.zeros(B, T), torch.tensor([1, 1, 2]))
    advantages, returns = call_with_fields(NAMES[name], fields, {})
    assert (advantages == 0).all() and (returns == 0).all()


@pytest.mark.parametrize("name", sorted(NAMES))
@pytest.mark.parametrize("score", [0.1, 1.0, -7.3, 1e6])
def test_groups_of_one_and_all_equal_groups_get_exactly_zero(name, score):
    rewards, mask = outcome_batch([score] * 4, [2, 1, 3, 2])
    fields = fields_for(4, 3, rewards, mask, torch.tensor([9, 9, 9, 4]))
    args = {"whiten": False} if name == "gdpo" else {}
    advantages, _ = call_with_fields(NAMES[name], fields, args)
    assert (advantages == 0).all()


@SETTINGS
@given(batch=outcomes)
def test_outputs_are_float32_zero_outside_the_mask_and_ignore_a_constant_shift(batch):
    scores, lengths, groups = batch
    lengths = [max(n, 1) for n in lengths]  # an empty response has no token to carry a shifted reward
    rewards, mask = outcome_batch(scores, lengths, T=5)
    base = fields_for(len(scores), 5, rewards, mask, torch.tensor(groups))
    shifted = {**base, "token_rewards": outcome_batch([s + 3.0 for s in scores], lengths, T=5)[0],
               "reward_components": base["reward_components"] + 3.0}
    for name, fn in NAMES.items():
        # (the zero tail of optimal_token_baseline is a raw return, which a shift moves)
        args = {"handle_zero_tail": False} if name == "optimal_token_baseline" else {}
        advantages, returns = call_with_fields(fn, base, args)
        assert advantages.dtype == torch.float32 and returns.dtype == torch.float32, name
        assert (advantages[mask == 0] == 0).all(), name
        if name == "optimal_token_baseline":  # per-token returns, zero off the mask
            assert (returns[mask == 0] == 0).all(), name
        else:  # outcome estimators: R_i on every token of the row, padding included
            assert torch.equal(returns, returns[:, :1].expand_as(returns)), name
        # a constant added to every reward changes no group-relative advantage
        moved, _ = call_with_fields(fn, shifted, args)
        torch.testing.assert_close(moved, advantages, atol=1e-4, rtol=1e-4, msg=name)
