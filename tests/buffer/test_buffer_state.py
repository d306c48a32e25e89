"""ExperienceBuffer.state_dict / load_state_dict: what a sample strategy left for later survives a checkpoint."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rltk.batch import Experience
from rltk.buffer.buffer import ExperienceBuffer
from rltk.buffer.strategies import Staleness

finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@st.composite
def experiences(draw):
    n = draw(st.integers(0, 5))
    return Experience(
        prompt_ids=draw(st.lists(st.integers(0, 50_000), min_size=1, max_size=4)),
        response_ids=draw(st.lists(st.integers(0, 50_000), min_size=n, max_size=n)),
        score=draw(finite), group_id=draw(st.integers(0, 1000)),
        response_mask=draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)),
        rollout_logprobs=draw(st.none() | st.lists(finite, min_size=n, max_size=n)),
        finish_reason=draw(st.sampled_from(["stop", "length"])),
        reward_details=draw(st.dictionaries(st.text(max_size=5), finite, max_size=2)),
        info=draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5) | st.integers(), max_size=2)),
        baseline_score=draw(st.none() | finite),
    )


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(st.tuples(st.lists(experiences(), max_size=3), st.integers(0, 100),
                                  st.sampled_from(["policy", "expert"])), max_size=4),
       capacity=st.none() | st.integers(1, 6))
def test_a_json_round_trip_gives_back_every_item_exactly(batches, capacity):
    buffer = ExperienceBuffer(capacity)
    for items, step, source in batches:
        buffer.put(items, step, source)
    restored = ExperienceBuffer(capacity)
    restored.load_state_dict(json.loads(json.dumps(buffer.state_dict())))  # as state.json stores it
    assert restored.items() == buffer.items()  # dataclass equality: every field, floats bit for bit
    assert restored.evicted == buffer.evicted


def exp(tag: int, group: int) -> Experience:
    return Experience(prompt_ids=[tag], response_ids=[1, 2], score=0.1 * tag, group_id=group,
                      rollout_logprobs=[-0.1 * tag, -1.0 / 3])


def test_staleness_trains_a_resumed_run_on_what_it_had_left():
    # 3 groups of 2 arrive per step; batch_size 2 takes one group per step and leaves the rest
    strategy, straight, first = Staleness(max_staleness=3, batch_size=2), ExperienceBuffer(), ExperienceBuffer()
    arrivals = {step: [exp(10 * step + i, 10 * step + i // 2) for i in range(6)] for step in (1, 2, 3)}
    for step in (1, 2, 3):
        straight.put(arrivals[step], step)
        expected = strategy.sample(straight, step)
        if step < 3:  # the first run checkpoints after step 2
            first.put(arrivals[step], step)
            strategy.sample(first, step)
    resumed = ExperienceBuffer()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    resumed.put(arrivals[3], 3)
    assert strategy.sample(resumed, 3) == expected
    # one group per step, oldest first: step 1's three groups go at steps 1, 2 and 3
    assert [e.prompt_ids[0] for e in expected] == [14, 15]
    assert resumed.items() == straight.items()


def test_the_sampling_policy_versions_survive_and_a_state_saved_without_them_loads_as_the_steps_weights():
    buffer = ExperienceBuffer()
    buffer.put([exp(1, 0), exp(2, 0)], 5, versions=[3, 4])  # an asynchronous producer's, lagging 1 and 0
    buffer.put([exp(3, 1)], 5)  # sampled by step 5's own weights: version 4
    state = json.loads(json.dumps(buffer.state_dict()))
    restored = ExperienceBuffer()
    restored.load_state_dict(state)
    assert restored.items() == buffer.items()
    assert [item.sampled_version for item in restored.items()] == [3, 4, 4]
    for entry in state["items"]:  # a checkpoint from before versions were kept
        del entry["version"]
    restored.load_state_dict(state)
    assert [item.sampled_version for item in restored.items()] == [4, 4, 4]
    with pytest.raises(ValueError, match="1 versions for 2 experiences"):
        buffer.put([exp(1, 0), exp(2, 0)], 6, versions=[5])


def test_loading_replaces_what_was_there():
    buffer = ExperienceBuffer()
    buffer.put([exp(1, 0)], 1)
    buffer.load_state_dict({"evicted": 4, "items": []})
    assert len(buffer) == 0 and buffer.evicted == 4


@pytest.mark.parametrize("state, message", [
    ([], r"expected \{'evicted': int, 'items': list\}.*got list"),
    ({"items": []}, r"got \['items'\]"),
    ({"evicted": -1, "items": []}, r"state\['evicted'\] = -1 must be an integer >= 0"),
    ({"evicted": 0, "items": [{"step": 1, "source": "policy"}]},
     r"state\['items'\]\[0\] is not a stored experience \(KeyError"),
    ({"evicted": 0, "items": [{"step": 1, "source": "policy", "experience": {
        "prompt_ids": [1], "response_ids": [1, 2], "score": 0.0, "group_id": 0, "response_mask": [1]}}]},
     r"state\['items'\]\[0\] is not a stored experience \(ValueError: response_mask has 1 entries"),
    ({"evicted": 0, "items": [{"step": 1, "source": "policy", "experience": {"prompt": "x"}}] * 3},
     r"3 items do not fit this buffer's capacity=2"),
])
def test_bad_state_is_refused_naming_the_entry(state, message):
    buffer = ExperienceBuffer(capacity=2)
    buffer.put([exp(1, 0)], 1)
    with pytest.raises(ValueError, match=message):
        buffer.load_state_dict(state)
    assert len(buffer) == 1  # left as it was
