"""collate's reward_components: each reward function's own score, in the composer's order."""

from __future__ import annotations

import pytest
import torch

from rltk.batch import Experience, collate
from rltk.rewards.compose import RewardComposer


def correct(*, response: str, ground_truth: str) -> float:
    return float(response == ground_truth)


def shape(*, response: str) -> dict:
    """A dict-returning reward: its score plus two details that are no components."""
    return {"length": float(len(response)), "digits": float(sum(c.isdigit() for c in response)),
            "score": 0.5 if response.isdigit() else 0.0}


def experiences(composer, responses, ground_truth="12"):
    out = []
    for i, response in enumerate(responses):
        score, details = composer(prompt="1+11=", response=response, ground_truth=ground_truth)
        out.append(Experience(prompt_ids=[5, 6], response_ids=[7] * (i + 1), score=score, group_id=0,
                              reward_details=details, info={"row_id": "r0"}))
    return out


def test_columns_follow_the_composer_order_and_ignore_the_details_of_dict_rewards():
    # "shape" comes first in the config, so it is column 0 (the config order, not the alphabetical one)
    composer = RewardComposer([("shape", shape, 2.0, {}), ("correct", correct, 1.0, {})], timeout_s=None)
    batch = collate(experiences(composer, ["12", "1x", "7"]), pad_token_id=0, reward_names=composer.names)
    assert batch["reward_components"].dtype == torch.float32
    assert batch["reward_components"].tolist() == [[0.5, 1.0], [0.0, 0.0], [0.5, 0.0]]
    # the scores are the weighted sum of the columns
    torch.testing.assert_close(batch["reward_components"] @ torch.tensor([2.0, 1.0]), batch["scores"])
    # the details of the dict reward are in reward_details, but no column
    assert "shape/length" in experiences(composer, ["12"])[0].reward_details


def test_no_names_no_field():
    composer = RewardComposer([("correct", correct, 1.0, {})], timeout_s=None)
    assert "reward_components" not in collate(experiences(composer, ["12"]), pad_token_id=0)


def test_an_experience_without_a_reward_score_is_refused_by_name():
    composer = RewardComposer([("correct", correct, 1.0, {}), ("shape", shape, 1.0, {})], timeout_s=None)
    batch = experiences(composer, ["12", "3"])
    batch[1].reward_details = {"correct": 1.0}
    with pytest.raises(ValueError, match=r"experience 1 \(row 'r0'\) has no reward_details entry for reward\(s\) "
                                         r"\['shape'\].*reward.reward_fn \['correct', 'shape'\]"):
        collate(batch, pad_token_id=0, reward_names=composer.names)
    expert = Experience(prompt_ids=[5], response_ids=[7], score=1.0, group_id=-1, info={"expert": True})
    with pytest.raises(ValueError, match="unset buffer.expert.score"):
        collate([expert], pad_token_id=0, reward_names=["correct"])
    with pytest.raises(ValueError, match="at least one reward name"):
        collate(batch, pad_token_id=0, reward_names=[])
