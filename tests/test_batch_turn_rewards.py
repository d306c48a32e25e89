import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rltk.batch import Experience, collate
from rltk.buffer.buffer import ExperienceBuffer


def test_turn_rewards_land_on_their_positions_and_the_rest_on_the_last_token():
    e = Experience(prompt_ids=[5, 6], response_ids=[1, 2, 3, 4, 5, 6], score=2.0, group_id=0,
                   response_mask=[1, 1, 0, 0, 1, 1], turn_rewards=[(1, 0.25), (5, 0.5)])
    plain = Experience(prompt_ids=[5], response_ids=[7, 8], score=1.0, group_id=1)
    batch = collate([e, plain], pad_token_id=0)
    assert batch["token_rewards"].tolist() == [[0.0, 0.25, 0.0, 0.0, 0.0, 1.75], [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]]
    assert batch["scores"].tolist() == [2.0, 1.0]  # the episode score is unchanged for group advantages


def test_two_rewards_on_one_position_add_up():
    e = Experience(prompt_ids=[5], response_ids=[1, 2, 3], score=1.0, group_id=0,
                   turn_rewards=[(1, 0.5), (1, 0.25)])
    assert collate([e], 0)["token_rewards"][0].tolist() == [0.0, 0.75, 0.25]


def test_bad_positions_are_refused():
    with pytest.raises(ValueError, match="turn_rewards position 3 is outside the response's 3 tokens"):
        Experience(prompt_ids=[5], response_ids=[1, 2, 3], score=0.0, group_id=0, turn_rewards=[(3, 1.0)])
    with pytest.raises(ValueError, match="position True"):
        Experience(prompt_ids=[5], response_ids=[1, 2, 3], score=0.0, group_id=0, turn_rewards=[(True, 1.0)])


def test_a_checkpointed_buffer_keeps_turn_rewards():
    buffer = ExperienceBuffer()
    buffer.put([Experience(prompt_ids=[5], response_ids=[1, 2], score=1.0, group_id=0, turn_rewards=[(0, 0.5)])], 0)
    restored = ExperienceBuffer()
    restored.load_state_dict(json.loads(json.dumps(buffer.state_dict())))
    (item,) = restored.pop()
    assert item.experience.turn_rewards == [(0, 0.5)]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 12).flatmap(lambda t: st.tuples(
    st.just(t), st.lists(st.tuples(st.integers(0, t - 1), st.floats(-2, 2)), max_size=5), st.floats(-3, 3))))
def test_token_rewards_always_sum_to_the_score(case):
    t, turn_rewards, score = case
    e = Experience(prompt_ids=[9], response_ids=list(range(t)), score=score, group_id=0, turn_rewards=turn_rewards)
    row = collate([e], 0)["token_rewards"][0]
    assert row.sum().item() == pytest.approx(score, abs=1e-4)
    for position in range(t - 1):
        assert row[position].item() == pytest.approx(sum(r for p, r in turn_rewards if p == position), abs=1e-5)
