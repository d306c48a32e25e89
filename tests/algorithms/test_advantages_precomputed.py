"""The optional [B] inputs of the outcome estimators: ``sequence_rewards`` (R_i) and ``policy_lengths`` (l_i).

Given, they replace a [B, T] pass each (issue #13, item 3); the results must be exactly those
of the estimator summing ``token_rewards`` and ``response_mask`` itself, for every mask layout
and every kind of token rewards the trainer builds (outcome, KL folded in, multi-turn).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rltk.algorithms import advantages as adv
from rltk.algorithms.kl import apply_kl_penalty
from rltk.batch import Experience, collate
from rltk.registry import BATCH_FIELDS
from tests.algorithms.calls import call_with_fields

SETTINGS = settings(max_examples=80, deadline=None, derandomize=True, database=None)

# Estimators that take R_i, and those that take l_i.
TAKE_RETURNS = ["grpo", "rloo", "opo", "reinforce_plus_plus_baseline", "remax", "grpo_passk", "gpg"]
TAKE_LENGTHS = ["opo", "reinforce_plus_plus_baseline", "gdpo"]
OUTCOME = sorted(set(TAKE_RETURNS) | set(TAKE_LENGTHS))
# Configured variants whose code paths differ.
VARIANTS = {
    "grpo": [{}, {"norm_by_std": False}],
    "reinforce_plus_plus_baseline": [{}, {"whiten": False}],
    "gdpo": [{}, {"whiten": False}],
}


def precomputed(batch: dict) -> dict:
    """``batch`` plus the row sums rltk.batch.collate adds."""
    return {
        **batch,
        "sequence_rewards": batch["token_rewards"].sum(-1),
        "policy_lengths": batch["response_mask"].sum(-1).to(torch.long),
    }


def both_ways(name: str, batch: dict, kwargs: dict):
    """(summing itself, given the row sums) results of estimator ``name``."""
    fn = getattr(adv, name)
    summing = {k: v for k, v in batch.items() if k not in ("sequence_rewards", "policy_lengths")}
    return call_with_fields(fn, summing, kwargs), call_with_fields(fn, precomputed(summing), kwargs)


def test_the_inputs_are_named_where_expected_and_provided_by_the_trainer():
    for name in OUTCOME:
        params = inspect.signature(getattr(adv, name)).parameters
        assert ("sequence_rewards" in params) == (name in TAKE_RETURNS), name
        assert ("policy_lengths" in params) == (name in TAKE_LENGTHS), name
        for field in ("sequence_rewards", "policy_lengths"):
            if field in params:
                assert params[field].default is None, (name, field)  # optional: plugins' batches lack them
    # batch fields, so a config cannot set them as estimator arguments
    assert {"sequence_rewards", "policy_lengths"} <= BATCH_FIELDS


# --------------------------------------------------------------------------
# Hand-computed: the given values are the ones used
# --------------------------------------------------------------------------

#   group 7: returns 1, 0, 1 (lengths 2, 1, 3)    group 3: 2 (alone)    group 11: 0.1, 0.1 (all equal)
SCORES = [1.0, 2.0, 0.1, 0.0, 0.1, 1.0]
GROUPS = torch.tensor([7, 3, 11, 7, 11, 7])
LENGTHS = [2, 1, 3, 1, 2, 3]


def hand_batch():
    mask = torch.zeros(6, 3)
    rewards = torch.zeros(6, 3)
    for i, (score, n) in enumerate(zip(SCORES, LENGTHS)):
        mask[i, :n] = 1
        rewards[i, n - 1] = score
    return {"token_rewards": rewards, "response_mask": mask, "group_ids": GROUPS}


def test_grpo_by_hand_from_sequence_rewards_alone():
    # token_rewards all zero: a result that is not all zero can only come from sequence_rewards
    batch = hand_batch()
    advantages, returns = adv.grpo(
        token_rewards=torch.zeros(6, 3), response_mask=batch["response_mask"], group_ids=GROUPS,
        sequence_rewards=torch.tensor(SCORES),
    )
    s = (1 / 3) ** 0.5  # std of (1, 0, 1), Bessel-corrected
    expected = [(1 - 2 / 3) / (s + 1e-6), 0.0, 0.0, (0 - 2 / 3) / (s + 1e-6), 0.0, (1 - 2 / 3) / (s + 1e-6)]
    assert advantages[:, 0].tolist() == pytest.approx(expected, abs=1e-5)
    assert returns[:, 0].tolist() == pytest.approx(SCORES)
    assert (advantages == torch.tensor(expected)[:, None] * batch["response_mask"]).all()


def test_opo_by_hand_weights_the_baseline_by_the_given_lengths():
    batch = hand_batch()
    # group 7: returns (1, 0, 1), lengths (2, 1, 3) from the mask -> b = 5/6
    a, _ = adv.opo(**batch, sequence_rewards=torch.tensor(SCORES), policy_lengths=torch.tensor(LENGTHS))
    assert a[:, 0].tolist() == pytest.approx([1 / 6, 0, 0, -5 / 6, 0, 1 / 6], abs=1e-6)
    # equal lengths given instead: b = 2/3, the plain mean; the mask only places the advantages
    a, _ = adv.opo(**batch, sequence_rewards=torch.tensor(SCORES), policy_lengths=torch.ones(6, dtype=torch.long))
    assert a[:, 0].tolist() == pytest.approx([1 / 3, 0, 0, -2 / 3, 0, 1 / 3], abs=1e-6)


def test_reinforce_plus_plus_baseline_whitens_over_the_given_lengths():
    # a = (0.5, -0.5) repeated on (3, 1) tokens: mean 0.25, population std sqrt(0.1875)
    rewards = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    a, _ = adv.reinforce_plus_plus_baseline(
        token_rewards=rewards, response_mask=mask, group_ids=torch.tensor([0, 0]),
        sequence_rewards=torch.tensor([1.0, 0.0]), policy_lengths=torch.tensor([3, 1]),
    )
    s = 0.1875**0.5
    assert a[:, 0].tolist() == pytest.approx([0.25 / s, -0.75 / s], abs=1e-6)


def test_returns_are_a_copy_of_the_given_sums():
    batch = precomputed(hand_batch())
    given_sums = batch["sequence_rewards"]
    _, returns = call_with_fields(adv.rloo, batch, {})
    assert returns.untyped_storage().data_ptr() != given_sums.untyped_storage().data_ptr()
    given_sums.fill_(-5.0)  # the caller reuses its buffer: the returns it got must not change
    assert returns[:, 0].tolist() == pytest.approx(SCORES)


@pytest.mark.parametrize("name", OUTCOME)
def test_misshapen_inputs_name_the_field(name):
    batch = hand_batch()
    batch.update(baseline_scores=torch.zeros(6), reward_components=torch.zeros(6, 2))
    field = "sequence_rewards" if name in TAKE_RETURNS else "policy_lengths"
    with pytest.raises(ValueError, match=rf"{name}: {field} has shape \(5,\) but must be \[B\] = \(6,\)"):
        call_with_fields(getattr(adv, name), batch, {field: torch.zeros(5)})


# --------------------------------------------------------------------------
# Properties: given or summed, the same bits
# --------------------------------------------------------------------------


def token_batch(seed, B, T, layout, rewards_kind, group_size):
    """A batch as the trainer builds it: outcome scores on the last token, or a KL penalty folded in
    (dense rewards on every policy token), or multi-turn turn rewards (collate); ragged rows, tool
    tokens inside responses, empty responses, groups of one and all-equal groups."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).float()
    if layout == "holes":  # tool / environment tokens inside a response
        mask = mask * (torch.rand(B, T, generator=g) < 0.7).float()
    scores = torch.randint(-2, 3, (B,), generator=g).float() / torch.tensor([1.0, 3.0, 10.0])[
        torch.randint(0, 3, (B,), generator=g)]  # 1/3 and 0.1: sums that round
    group_ids = torch.randperm(B, generator=g) // group_size * 5 + 11
    if rewards_kind == "turns":
        experiences = []
        for i in range(B):
            n = int(lengths[i])
            turns = None
            if n >= 2:
                k = int(torch.randint(1, n, (), generator=g))
                turns = [(int(p), float(r)) for p, r in zip(
                    torch.randint(0, n - 1, (k,), generator=g), torch.randn(k, generator=g).round(decimals=2))]
            experiences.append(Experience(
                prompt_ids=[1], response_ids=[2] * n, score=float(scores[i]), group_id=int(group_ids[i]),
                response_mask=[int(v) for v in mask[i, :n]], turn_rewards=turns))
        batch = collate(experiences, pad_token_id=0)
        batch = {k: batch[k] for k in ("token_rewards", "response_mask", "group_ids")}
        T = batch["token_rewards"].shape[1]
    else:
        rewards = torch.zeros(B, T)
        has = lengths > 0
        rewards[torch.arange(B)[has], (lengths - 1)[has]] = scores[has]
        if rewards_kind == "kl":
            kl = torch.rand(B, T, generator=g) * 0.3
            rewards = apply_kl_penalty(rewards, kl, 0.05, mask)
        batch = {"token_rewards": rewards, "response_mask": mask, "group_ids": group_ids}
    batch["baseline_scores"] = torch.randint(-1, 2, (B,), generator=g).float() / 3
    batch["reward_components"] = torch.randint(0, 2, (B, 2), generator=g).float()
    return batch


token_batches = st.builds(
    token_batch,
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 24),
    T=st.integers(1, 12),
    layout=st.sampled_from(["contiguous", "holes"]),
    rewards_kind=st.sampled_from(["outcome", "kl", "turns"]),
    group_size=st.integers(1, 5),
)


@SETTINGS
@given(batch=token_batches)
def test_given_row_sums_give_exactly_the_summed_results(batch):
    for name in OUTCOME:
        for kwargs in VARIANTS.get(name, [{}]):
            (a_sum, r_sum), (a_given, r_given) = both_ways(name, batch, kwargs)
            # bit for bit, including the sign of zeros
            assert torch.equal(a_sum.view(torch.int32), a_given.view(torch.int32)), (name, kwargs)
            assert torch.equal(r_sum.contiguous().view(torch.int32), r_given.contiguous().view(torch.int32)), name
            assert a_given.is_contiguous() and (r_given.shape[1] == 1 or r_given.stride()[1] == 0), name


@SETTINGS
@given(batch=token_batches)
def test_collate_sums_are_the_row_sums_of_its_tensors(batch):
    # built through collate for "turns"; for every kind, the sums the trainer passes are exact
    sums = precomputed(batch)
    assert torch.equal(sums["sequence_rewards"], batch["token_rewards"].sum(-1))
    assert sums["policy_lengths"].tolist() == batch["response_mask"].sum(-1).tolist()


@pytest.mark.parametrize("name", OUTCOME)
def test_empty_responses_and_an_empty_batch_with_given_sums(name):
    mask = torch.zeros(3, 2)
    batch = precomputed({"token_rewards": torch.zeros(3, 2), "response_mask": mask,
                         "group_ids": torch.tensor([0, 0, 1])})
    batch.update(baseline_scores=torch.zeros(3), reward_components=torch.zeros(3, 1))
    advantages, returns = call_with_fields(getattr(adv, name), batch, {})
    assert torch.equal(advantages, torch.zeros(3, 2)) and torch.isfinite(returns).all()
