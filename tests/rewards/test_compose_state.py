"""RewardComposer's cumulative counters survive a checkpoint: state_dict / load_state_dict."""

from __future__ import annotations

import json
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rltk.rewards.compose import RewardComposer

SAMPLE = dict(prompt="p", response="r", ground_truth="g", extras={})


def one(*, response):
    return 1.0


def fails_on_long(*, response):
    if len(response) > 3:
        raise ValueError("too long")
    return 0.5


def composer() -> RewardComposer:
    return RewardComposer([("one", one, 1.0, {}), ("picky", fails_on_long, 1.0, {})], timeout_s=None)


def score(c: RewardComposer, responses: list[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the first failure warns; counted either way
        for response in responses:
            c(**{**SAMPLE, "response": response})


def test_counts_continue_after_a_json_round_trip_as_if_never_interrupted():
    straight, first = composer(), composer()
    score(straight, ["ab", "abcde", "abcdef", "x"])
    score(first, ["ab", "abcde"])
    state = json.loads(json.dumps(first.state_dict()))  # as the checkpoint's state.json stores it
    assert state == {"calls": 2, "failures": {"one": 0, "picky": 1}, "timeouts": {"one": 0, "picky": 0},
                     "worker_restarts": 0}

    resumed = composer()
    resumed.load_state_dict(state)
    score(resumed, ["abcdef", "x"])
    # 4 samples, of which "abcde" and "abcdef" failed the picky reward
    assert resumed.stats() == straight.stats() == {
        "calls": 4.0, "failures/one": 0.0, "timeouts/one": 0.0, "failures/picky": 2.0, "timeouts/picky": 0.0,
        "worker_restarts": 0.0}


def test_state_dict_is_a_copy():
    c = composer()
    state = c.state_dict()
    score(c, ["abcde"])
    assert state["calls"] == 0 and state["failures"]["picky"] == 0


@settings(max_examples=50, deadline=None)
@given(calls=st.integers(0, 10**12), counts=st.lists(st.integers(0, 10**9), min_size=5, max_size=5))
def test_load_then_save_gives_back_the_same_state(calls, counts):
    state = {"calls": calls, "failures": {"one": counts[0], "picky": counts[1]},
             "timeouts": {"one": counts[2], "picky": counts[3]}, "worker_restarts": counts[4]}
    c = composer()
    c.load_state_dict(state)
    assert c.state_dict() == state
    stats = c.stats()
    assert (stats["calls"], stats["failures/picky"], stats["worker_restarts"]) == (calls, counts[1], counts[4])


def test_reset_after_load_zeroes_everything():
    c = composer()
    c.load_state_dict({"calls": 5, "failures": {"one": 1, "picky": 2}, "timeouts": {"one": 0, "picky": 1},
                       "worker_restarts": 3})
    c.reset_stats()
    assert c.state_dict() == {"calls": 0, "failures": {"one": 0, "picky": 0}, "timeouts": {"one": 0, "picky": 0},
                              "worker_restarts": 0}


OK = {"calls": 1, "failures": {"one": 0, "picky": 0}, "timeouts": {"one": 0, "picky": 0}, "worker_restarts": 0}


@pytest.mark.parametrize("state, message", [
    ({k: v for k, v in OK.items() if k != "timeouts"},
     r"expected the keys \['calls', 'failures', 'timeouts', 'worker_restarts'\]"),
    ([1, 2, 3], r"got list"),
    ({**OK, "calls": -1}, r"state\['calls'\] = -1 must be an integer >= 0"),
    ({**OK, "calls": 1.5}, r"state\['calls'\] = 1.5"),
    ({**OK, "worker_restarts": None}, r"state\['worker_restarts'\] = None"),
    ({**OK, "failures": {"one": True, "picky": 0}}, r"state\['failures\['one'\]'\] = True"),
    ({**OK, "failures": {"one": 0, "other": 0}},
     r"state\['failures'\] counts the reward\(s\) \['one', 'other'\], but this composer's are \['one', 'picky'\]"),
    ({**OK, "timeouts": {"one": 0}}, r"state\['timeouts'\] counts the reward\(s\) \['one'\]"),
])
def test_bad_state_is_refused_naming_the_entry_and_leaves_counts_alone(state, message):
    c = composer()
    score(c, ["abcde"])
    before = c.state_dict()
    with pytest.raises(ValueError, match=message):
        c.load_state_dict(state)
    assert c.state_dict() == before
