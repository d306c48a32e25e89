"""collate's layout: prompts left-padded, responses right-padded from column P, every field on its row."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rltk.batch import Experience, collate

PAD = 0


def test_a_hand_written_batch():
    experiences = [
        Experience(prompt_ids=[5, 6, 7], response_ids=[8, 9], score=1.0, group_id=0,
                   rollout_logprobs=[-0.5, -0.25]),
        Experience(prompt_ids=[5], response_ids=[4, 3, 2], score=0.5, group_id=0, response_mask=[1, 0, 1]),
        Experience(prompt_ids=[6, 6], response_ids=[], score=0.0, group_id=1),
    ]
    batch = collate(experiences, pad_token_id=PAD)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0], [0, 0, 5, 4, 3, 2], [0, 6, 6, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]]
    assert batch["response_mask"].tolist() == [[1, 1, 0], [1, 0, 1], [0, 0, 0]]
    assert batch["rollout_logprobs"].tolist() == [[-0.5, -0.25, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert batch["has_rollout_logprobs"].tolist() == [True, False, False]
    assert batch["token_rewards"].tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.5], [0.0, 0.0, 0.0]]
    assert batch["response_lengths"].tolist() == [2, 3, 0]
    assert batch["policy_lengths"].tolist() == [2, 2, 0]
    assert batch["group_ids"].tolist() == [0, 0, 1]
    assert batch["input_ids"].dtype == batch["attention_mask"].dtype == torch.long
    assert batch["response_mask"].dtype == batch["rollout_logprobs"].dtype == torch.float32


@st.composite
def experience(draw):
    prompt = draw(st.lists(st.integers(1, 50), min_size=1, max_size=6))
    t = draw(st.integers(0, 5))
    response = draw(st.lists(st.integers(1, 50), min_size=t, max_size=t))
    mask = draw(st.lists(st.integers(0, 1), min_size=t, max_size=t))
    logprobs = draw(st.none() | st.lists(st.floats(-20, 0, width=32), min_size=t, max_size=t))
    turns = draw(st.lists(st.tuples(st.integers(0, t - 1), st.floats(-1, 1, width=32)), max_size=3)) if t else []
    return Experience(prompt_ids=prompt, response_ids=response, score=draw(st.floats(-2, 2, width=32)),
                      group_id=draw(st.integers(0, 3)), response_mask=mask, rollout_logprobs=logprobs,
                      turn_rewards=turns or None)


@settings(max_examples=150, deadline=None)
@given(st.lists(experience(), min_size=1, max_size=6))
def test_every_field_matches_an_element_by_element_reference(experiences):
    batch = collate(experiences, pad_token_id=PAD)
    P = max(len(e.prompt_ids) for e in experiences)
    T = max(max(len(e.response_ids) for e in experiences), 1)
    for i, e in enumerate(experiences):
        p, t = len(e.prompt_ids), len(e.response_ids)
        for column in range(P + T):
            if P - p <= column < P:
                token, attended = e.prompt_ids[column - (P - p)], 1
            elif P <= column < P + t:
                token, attended = e.response_ids[column - P], 1
            else:
                token, attended = PAD, 0
            assert batch["input_ids"][i, column] == token and batch["attention_mask"][i, column] == attended
        for j in range(T):
            inside = j < t
            assert batch["response_mask"][i, j] == (e.response_mask[j] if inside else 0)
            logprob = e.rollout_logprobs[j] if inside and e.rollout_logprobs is not None else 0.0
            assert batch["rollout_logprobs"][i, j] == torch.tensor(logprob, dtype=torch.float32)
        # float32 arithmetic in collate's order: the score on the last token, turn rewards added, their sum taken off
        rewards = torch.zeros(T, dtype=torch.float32)
        if t:
            rewards[t - 1] = e.score
            for position, reward in e.turn_rewards or []:
                rewards[position] += reward
            rewards[t - 1] -= sum(reward for _, reward in e.turn_rewards or [])
        assert torch.equal(batch["token_rewards"][i], rewards)
