"""The [B] row sums the trainer hands the outcome estimators (sequence_rewards, policy_lengths) are
the row sums of the tensors they stand for: from collate, and after the rewards change."""

from __future__ import annotations

import inspect

import pytest
import torch

from rltk.algorithms import advantages as adv
from rltk.algorithms.kl import apply_kl_penalty
from rltk.batch import Experience, collate, refresh_row_sums
from rltk.training.step.estimator import compute_advantages

OUTCOME = ["grpo", "rloo", "opo", "reinforce_plus_plus_baseline", "remax", "gpg"]


def episodes():
    # two groups of two; a multi-turn episode with tool tokens and turn rewards, an empty response
    return [
        Experience(prompt_ids=[5, 6], response_ids=[1, 2, 3, 4, 5, 6], score=2.0, group_id=0,
                   response_mask=[1, 1, 0, 0, 1, 1], turn_rewards=[(1, 0.25), (5, 0.1)], baseline_score=0.5),
        Experience(prompt_ids=[5], response_ids=[7, 8], score=1.0 / 3, group_id=0, baseline_score=0.5),
        Experience(prompt_ids=[4], response_ids=[9, 9, 9], score=0.7, group_id=1, baseline_score=0.1),
        Experience(prompt_ids=[4], response_ids=[], score=0.0, group_id=1, baseline_score=0.1),
    ]


def summing(name, batch):
    """What the estimator gives summing token_rewards and the mask itself."""
    fn = getattr(adv, name)
    named = inspect.signature(fn).parameters
    return fn(**{k: batch[k] for k in ("token_rewards", "response_mask", "group_ids", "baseline_scores")
                 if k in named})


def test_collate_adds_the_row_sums_of_its_tensors():
    batch = collate(episodes(), pad_token_id=0)
    assert torch.equal(batch["sequence_rewards"], batch["token_rewards"].sum(-1))
    assert batch["sequence_rewards"].dtype == torch.float32
    assert batch["policy_lengths"].tolist() == [4, 2, 3, 0]  # tool tokens do not count ...
    assert batch["response_lengths"].tolist() == [6, 2, 3, 0]  # ... where response_lengths counts them
    assert batch["sequence_rewards"].tolist() == pytest.approx([2.0, 1 / 3, 0.7, 0.0])


def test_collate_reads_the_sums_off_the_experiences_exactly_as_the_tensors_sum():
    # collate takes a single-turn row's sum from its score, not from the tensor: the two must agree to
    # the bit, for scores float32 cannot hold exactly, negative ones, and an empty response that scored
    # (nothing of it lands on a token, so its row sums to 0)
    scores = [1 / 3, -0.1, 1e-8, 12345.678, -2.5]
    experiences = [Experience(prompt_ids=[1], response_ids=[2] * (i + 1), score=s, group_id=i // 2)
                   for i, s in enumerate(scores)]
    experiences.append(Experience(prompt_ids=[1], response_ids=[], score=0.9, group_id=3))
    batch = collate(experiences, pad_token_id=0)
    assert torch.equal(batch["sequence_rewards"], batch["token_rewards"].sum(-1))
    assert batch["sequence_rewards"][-1].item() == 0.0
    assert torch.equal(batch["policy_lengths"], batch["response_mask"].sum(-1).long())


@pytest.mark.parametrize("name", OUTCOME)
def test_untouched_sums_are_passed_as_collate_took_them(name):
    batch = collate(episodes(), pad_token_id=0)
    taken = batch["sequence_rewards"], batch["policy_lengths"]
    compute_advantages(getattr(adv, name), batch, {})
    assert batch["sequence_rewards"] is taken[0] and batch["policy_lengths"] is taken[1]  # not summed again
    advantages, returns = summing(name, batch)
    assert torch.equal(batch["advantages"], advantages) and torch.equal(batch["returns"], returns)


@pytest.mark.parametrize("name", OUTCOME)
@pytest.mark.parametrize("change", ["kl_fold", "in_place", "new_mask"])
def test_sums_of_changed_tensors_are_retaken(name, change):
    batch = collate(episodes(), pad_token_id=0)
    stale = batch["sequence_rewards"].clone()
    if change == "kl_fold":  # the recipes' KL-in-reward line: a new token_rewards tensor
        kl = torch.rand(batch["response_mask"].shape, generator=torch.Generator().manual_seed(0))
        batch["token_rewards"] = apply_kl_penalty(batch["token_rewards"], kl, 0.5, batch["response_mask"])
    elif change == "in_place":  # a bonus written into the rewards
        batch["token_rewards"][2, 0] += 1.5
    else:  # a mask with one more token dropped (same rewards)
        batch["response_mask"] = batch["response_mask"].clone()
        batch["response_mask"][0, 0] = 0.0
    compute_advantages(getattr(adv, name), batch, {})
    assert torch.equal(batch["sequence_rewards"], batch["token_rewards"].sum(-1))
    if "policy_lengths" in inspect.signature(getattr(adv, name)).parameters:  # only what it names is retaken
        assert batch["policy_lengths"].tolist() == batch["response_mask"].sum(-1).tolist()
    if change != "new_mask":
        assert not torch.equal(batch["sequence_rewards"], stale)  # a stale sum would have been wrong
    advantages, returns = summing(name, batch)
    assert torch.equal(batch["advantages"], advantages) and torch.equal(batch["returns"], returns)


def test_a_batch_built_by_hand_gets_its_sums_and_a_dict_copy_keeps_them():
    rewards = torch.tensor([[0.0, 1.0], [0.5, 0.0]])
    batch = {"token_rewards": rewards, "response_mask": torch.ones(2, 2)}
    refresh_row_sums(batch, ["sequence_rewards"])
    assert batch["sequence_rewards"].tolist() == [1.0, 0.5] and "policy_lengths" not in batch
    copy = dict(batch)
    refresh_row_sums(copy, ["sequence_rewards"])
    assert copy["sequence_rewards"] is batch["sequence_rewards"]
    # sums that did not come from take_row_sums are never trusted
    batch["sequence_rewards"] = torch.tensor([9.0, 9.0])
    refresh_row_sums(batch, ["sequence_rewards"])
    assert batch["sequence_rewards"].tolist() == [1.0, 0.5]
