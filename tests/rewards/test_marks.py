import time
from functools import partial

import pytest

from rltk.rewards import batched, bounded, builtin, is_batched, is_bounded
from rltk.rewards.compose import build_reward_composer
from rltk.rewards.verifiable.format import format_tags
from tests.rewards import reward_fns as rf

from tests.waits import scaled


def test_bare_mark_and_unmarked_functions():
    def plain(**_):
        return 0.0

    assert not is_bounded(plain)
    assert bounded(plain) is plain and is_bounded(plain)
    assert is_bounded(plain, {"anything": 1})


def test_unless_args_void_the_mark_when_set_and_partials_count_as_set():
    @bounded(unless_args=("pattern",))
    def fmt(*, response, pattern=None):
        return 0.0

    assert is_bounded(fmt) and is_bounded(fmt, {"pattern": None}) and is_bounded(fmt, {"other": 1})
    assert not is_bounded(fmt, {"pattern": "(a+)+b"})
    assert not is_bounded(partial(fmt, pattern="x"))
    assert is_bounded(partial(fmt, pattern="x"), {"pattern": None})  # configured args override the partial's
    assert is_bounded(partial(rf.bounded_constant, value=1.0)) and not is_bounded(partial(rf.constant, value=1.0))


def test_bad_marks():
    with pytest.raises(TypeError, match="takes a list of argument names, got the string 'pattern'"):
        bounded(unless_args="pattern")
    with pytest.raises(TypeError, match="@bounded marks reward functions; got int"):
        bounded(42)


def test_every_builtin_reward_is_marked_bounded():
    """The rule builtins promise bounded work on any input (tests/rewards/test_{math,countdown,format}.py prove
    the caps), so they run in-process with no timeout and no per-call thread or process. The reward services
    are batched instead (one in-process call per step, their own timeouts: test_reward_model.py, test_llm_judge.py)."""
    fns = builtin.rltk_reward_fns()
    # code_execution runs a program for up to its timeouts: never in-process, always under reward.timeout_s.
    assert not is_bounded(fns.pop("code_execution"))
    services = {name: fns.pop(name) for name in ("reward_model", "llm_judge")}
    assert all(is_batched(fn) and not is_bounded(fn) for fn in services.values())
    assert sorted(fns) == ["countdown", "exact_match", "format_tags", "math_answer", "multiple_choice"]
    assert all(is_bounded(fn) for fn in fns.values())
    composer = build_reward_composer(list(fns))
    assert composer.in_process == list(fns)
    composer(prompt="p", response="7", ground_truth="7", extras={"numbers": [7]})
    assert composer._pool is None  # no process was started


def test_format_tags_with_a_user_regex_runs_under_a_timeout_that_stops_catastrophic_backtracking():
    """``(a+)+b`` on 'aaa...a' backtracks for ages inside one C call that holds the GIL: no thread
    timeout could stop it, killing the worker process does."""
    composer = build_reward_composer([{"fn": "format_tags", "args": {"pattern": "(a+)+b"}}], timeout_s=0.5,
                                     workers=1)
    try:
        assert composer.in_process == []
        assert composer.specs[0].fn is format_tags
        start = time.perf_counter()
        with pytest.warns(RuntimeWarning, match="RewardTimeout: reward 'format_tags' took longer than timeout_s=0.5"):
            assert composer(prompt="p", response="a" * 40, ground_truth="", extras={}) == (0.0, {"format_tags": 0.0})
        assert time.perf_counter() - start < scaled(2.0)
        assert composer(prompt="p", response="aab", ground_truth="", extras={}) == (1.0, {"format_tags": 1.0})
    finally:
        composer.close()


def test_a_batched_reward_gets_one_call_per_batch_with_lists_and_its_per_sample_errors_are_counted():
    calls = []

    @batched
    def by_length(*, response, ground_truth, scale=1.0):
        calls.append((list(response), list(ground_truth)))
        out = []
        for r in response:
            if r == "hang":
                out.append(TimeoutError("judge did not answer within 1 s"))
            elif r == "garbled":
                out.append(ValueError("no verdict"))
            else:
                out.append({"score": scale * len(r), "chars": float(len(r))})
        return out

    assert is_batched(by_length) and is_batched(partial(by_length, scale=2.0)) and not is_batched(rf.constant)
    from rltk.rewards.compose import RewardComposer
    from rltk.rewards.verifiable.math import exact_match

    composer = RewardComposer([("exact_match", exact_match, 1.0, {}), ("len", by_length, 1.0, {"scale": 0.5})],
                              fallback=-1.0)
    assert composer.in_process == ["exact_match", "len"]
    samples = [{"prompt": "p", "response": r, "ground_truth": "ab"} for r in ("ab", "hang", "abcd", "garbled")]
    with pytest.warns(RuntimeWarning, match="reward 'len' failed on a sample \\(TimeoutError: judge did not answer"):
        results = composer.score_batch(samples)
    assert calls == [(["ab", "hang", "abcd", "garbled"], ["ab"] * 4)]  # one call, the step's samples as lists
    assert [d["len"] for _, d in results] == [1.0, -1.0, 2.0, -1.0]
    assert [total for total, _ in results] == [2.0, -1.0, 2.0, -1.0]
    assert results[2][1]["len/chars"] == 4.0 and "len/chars" not in results[1][1]
    stats = composer.stats()
    assert stats["failures/len"] == 2 and stats["timeouts/len"] == 1 and stats["calls"] == 4


def test_a_batched_reward_that_raises_or_miscounts_fails_the_whole_batch_and_training_goes_on():
    @batched
    def broken(*, response):
        raise RuntimeError("model not loaded")

    @batched
    def short(*, response):
        return [1.0]

    from rltk.rewards.compose import RewardComposer

    for fn, reason in ((broken, "RuntimeError: model not loaded"), (short, "returned 1 scores for 3 samples")):
        composer = RewardComposer([("svc", fn, 1.0, {})], fallback=0.5)
        with pytest.warns(RuntimeWarning, match=reason):
            results = composer.score_batch([{"prompt": "p", "response": "r", "ground_truth": "g"}] * 3)
        assert [score for score, _ in results] == [0.5] * 3 and composer.stats()["failures/svc"] == 3
