import time
from functools import partial

import pytest

from rltk.rewards import bounded, builtin, is_bounded
from rltk.rewards.compose import build_reward_composer
from rltk.rewards.format import format_tags
from tests.rewards import reward_fns as rf


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
    """The builtins but code_execution promise bounded work on any input (tests/rewards/test_{math,countdown,format}.py prove
    the caps), so they run in-process with no timeout and no per-call thread or process."""
    fns = builtin.rltk_reward_fns()
    # code_execution runs a program for up to its timeouts: never in-process, always under reward.timeout_s.
    assert not is_bounded(fns.pop("code_execution"))
    assert sorted(fns) == ["countdown", "exact_match", "format_tags", "math_answer"]
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
        assert time.perf_counter() - start < 2.0
        assert composer(prompt="p", response="aab", ground_truth="", extras={}) == (1.0, {"format_tags": 1.0})
    finally:
        composer.close()
