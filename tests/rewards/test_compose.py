import threading
import time
import warnings
from functools import partial

import pytest
from omegaconf import OmegaConf

import rltk
from rltk.rewards.compose import RewardComposer, RewardSpec, build_reward_composer
from rltk.rewards.verifiable.format import format_tags
from rltk.rewards.verifiable.math import math_answer

from tests.rewards import reward_fns as rf  # absolute: worker processes import these by this name

from tests.waits import scaled

SAMPLE = dict(prompt="p", response="<answer>#### 7</answer>", ground_truth="7", extras={})


def constant(value):
    """A picklable reward returning ``value`` (it runs in a worker process)."""
    return partial(rf.constant, value=value)


boom = rf.boom


@pytest.fixture
def composers():
    """Collects composers built by a test and stops their worker processes afterwards."""
    made = []
    yield made
    for composer in made:
        composer.close()


def test_weighted_sum_and_details_by_hand(composers):
    composer = RewardComposer([("a", constant(1.0), 1.0, {}), ("b", constant(0.5), -2.0, {}),
                               ("c", partial(rf.bounded_constant, value=0.25), 4.0, None)])
    composers.append(composer)
    score, details = composer(**SAMPLE)
    assert score == 1.0 * 1.0 + (-2.0) * 0.5 + 4.0 * 0.25 == 1.0
    assert details == {"a": 1.0, "b": 0.5, "c": 0.25}
    assert composer.names == ["a", "b", "c"]


def test_real_rewards_with_arguments():
    composer = RewardComposer([
        RewardSpec("math", math_answer, 1.0),
        RewardSpec("format", format_tags, 0.1, {"tags": ["answer"]}),
    ])
    score, details = composer(**SAMPLE)
    assert details == {"math": 1.0, "format": 1.0}
    assert score == pytest.approx(1.1)


def test_dict_results_use_score_or_the_sum(composers):
    with_score = constant({"score": 0.75, "length": 3.0})
    without = constant({"x": 0.5, "y": 0.25})
    composers.append(RewardComposer([("s", with_score, 2.0, {}), ("t", without, 1.0, {})]))
    score, details = composers[-1](**SAMPLE)
    assert score == 2.0 * 0.75 + 0.75
    assert details == {"s": 0.75, "s/length": 3.0, "t": 0.75, "t/x": 0.5, "t/y": 0.25}


@pytest.mark.parametrize("where", ["worker", "in-process"])
def test_raising_component_gets_the_fallback_is_counted_and_warns_once(where, composers):
    timeout_s = 5.0 if where == "worker" else None
    composer = RewardComposer([("ok", constant(1.0), 1.0, {}), ("boom", boom, 0.5, {})], fallback=-1.0,
                              timeout_s=timeout_s)
    composers.append(composer)
    with pytest.warns(RuntimeWarning, match=r"reward 'boom' failed on a sample \(RuntimeError: reward server unreachable\).*fallback=-1.0"):
        score, details = composer(**SAMPLE)
    assert details == {"ok": 1.0, "boom": -1.0}
    assert score == 1.0 + 0.5 * -1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second failure must not warn again
        composer(**SAMPLE)
        composer(**SAMPLE)
    assert composer.failures == {"ok": 0, "boom": 3}
    assert composer.stats() == {"calls": 3.0, "failures/ok": 0.0, "timeouts/ok": 0.0,
                                "failures/boom": 3.0, "timeouts/boom": 0.0, "worker_restarts": 0.0}
    composer.reset_stats()
    assert composer.failures == {"ok": 0, "boom": 0} and composer.stats()["calls"] == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1.0", None, {"score": float("nan")}])
def test_non_numeric_results_are_failures(bad, composers):
    composer = RewardComposer([("bad", constant(bad), 1.0, {})], fallback=0.25)
    composers.append(composer)
    with pytest.warns(RuntimeWarning, match="reward 'bad' failed"):
        assert composer(**SAMPLE) == (0.25, {"bad": 0.25})
    assert composer.failures["bad"] == 1


def test_hanging_component_times_out_and_its_worker_is_killed(composers):
    composer = RewardComposer([("hang", rf.sleep_if, 1.0, {}), ("ok", constant(0.5), 1.0, {})],
                              timeout_s=0.2, workers=2)
    composers.append(composer)
    composer(**SAMPLE)  # workers started and warm
    before = set(composer._pool.worker_pids())
    start = time.perf_counter()
    with pytest.warns(RuntimeWarning, match=r"RewardTimeout: reward 'hang' took longer than timeout_s=0.2"):
        score, details = composer(**{**SAMPLE, "response": "HANG"})
    elapsed = time.perf_counter() - start
    assert 0.2 <= elapsed < scaled(2.0)
    assert details == {"hang": 0.0, "ok": 0.5} and score == 0.5
    stats = composer.stats()
    assert stats["timeouts/hang"] == stats["failures/hang"] == 1.0
    assert stats["timeouts/ok"] == stats["failures/ok"] == 0.0
    assert stats["worker_restarts"] == 1.0
    gone = before - set(composer._pool.worker_pids())
    assert len(gone) == 1 and not any(_alive(pid) for pid in gone)
    assert composer(**SAMPLE) == (1.5, {"hang": 1.0, "ok": 0.5})  # the replacement works


def test_sys_exit_in_a_reward_does_not_end_training(composers):
    composer = RewardComposer([("exit", rf.leaves, 1.0, {})])
    composers.append(composer)
    with pytest.warns(RuntimeWarning, match=r"reward 'exit' failed on a sample \(SystemExit: 3\)"):
        assert composer(**SAMPLE) == (0.0, {"exit": 0.0})
    with pytest.warns(RuntimeWarning, match="reward 'in' failed"):
        assert RewardComposer([("in", rf.leaves, 1.0, {})], timeout_s=None)(**SAMPLE) == (0.0, {"in": 0.0})


def test_inline_mode_without_timeout():
    caller = threading.get_ident()
    seen = []

    def where(**_):
        seen.append(threading.get_ident())
        return 1.0

    assert RewardComposer([("w", where, 1.0, {})], timeout_s=None)(**SAMPLE)[0] == 1.0
    assert seen == [caller]


def test_functions_may_omit_sample_fields_they_do_not_use(composers):
    composer = RewardComposer([("len", rf.only_response, 1.0, {"bonus": 1.0})])
    composers.append(composer)
    assert composer(**SAMPLE)[0] == len(SAMPLE["response"]) + 1.0


@pytest.mark.parametrize(
    "specs, kwargs, message",
    [
        ([("m", math_answer, 1.0, {"flexibel": True})], {}, r"reward 'm' has no argument\(s\) \['flexibel'\]. Valid args: flexible, format_score, rel_tol"),
        ([("m", math_answer, 1.0, {"response": "x"})], {}, r"reward 'm': argument\(s\) \['response'\] are filled in for every sample"),
        ([("n", lambda *, response, k: 0.0, 1.0, {})], {}, r"reward 'n' needs argument\(s\) \['k'\]"),
        ([("m", math_answer, 1.0, {}), ("m", math_answer, 1.0, {})], {}, r"reward 'm' appears twice"),
        ([("m", math_answer, float("nan"), {})], {}, r"reward 'm': weight must be a finite number"),
        ([("m", math_answer, 1.0, {})], {"timeout_s": 0}, r"timeout_s must be a positive number of seconds or None"),
        ([("m", math_answer, 1.0, {})], {"workers": 0}, r"reward.workers must be an integer >= 1 \(worker processes for rewards not marked bounded\), got 0"),
        ([("m", math_answer, 1.0, {})], {"fallback": "low"}, r"fallback must be a finite number, got 'low'"),
        ([], {}, r"needs at least one reward function"),
    ],
)
def test_construction_errors_name_the_reward(specs, kwargs, message):
    with pytest.raises(ValueError, match=message):
        RewardComposer(specs, **kwargs)


def test_kwargs_functions_accept_any_argument(composers):
    composer = RewardComposer([("k", rf.scaled, 1.0, {"scale": 3})])
    composers.append(composer)
    assert composer(**SAMPLE)[0] == 3.0


# ----------------------------------------------------------------- build_reward_composer


def test_build_from_registered_names_with_weights_and_args():
    composer = build_reward_composer(
        ["math_answer", "format_tags"], weights=[1.0, 0.1], args={"format_tags": {"tags": ["answer"]}},
        fallback=-0.5, timeout_s=1.0, workers=3,
    )
    assert [s.fn for s in composer.specs] == [rltk.get_component("reward_fn", "math_answer"), format_tags]
    assert composer.fallback == -0.5 and composer.timeout_s == 1.0 and composer.workers == 3
    assert composer.in_process == ["math_answer", "format_tags"]  # builtins: no worker process
    assert composer(**SAMPLE) == (pytest.approx(1.1), {"math_answer": 1.0, "format_tags": 1.0})


def test_build_from_a_single_name_and_weight_mapping():
    composer = build_reward_composer("exact_match", weights={"exact_match": 2.0})
    assert composer(prompt="", response="7", ground_truth="7", extras={}) == (2.0, {"exact_match": 1.0})


def test_build_from_mappings_registers_one_function_twice():
    composer = build_reward_composer([
        {"fn": "format_tags", "name": "strict", "args": {"tags": ["think", "answer"]}},
        {"fn": "format_tags", "name": "loose", "weight": 0.5, "args": {"tags": ["answer"]}},
    ])
    assert composer(**SAMPLE) == (0.5, {"strict": 0.0, "loose": 1.0})


def test_build_accepts_omegaconf_containers():
    cfg = OmegaConf.create({"fns": ["math_answer"], "weights": {"math_answer": 3.0},
                            "args": {"math_answer": {"flexible": True}}})
    composer = build_reward_composer(cfg.fns, cfg.weights, cfg.args)
    assert composer(prompt="", response="it is 7", ground_truth="7", extras={})[0] == 3.0


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: build_reward_composer(["math_answr"]), rltk.RegistryError, r"unknown reward_fn 'math_answr'.*Did you mean: 'math_answer'"),
        (lambda: build_reward_composer(["math_answer", "countdown"], weights=[1.0]), ValueError, r"reward.weights has 1 entries for 2 reward functions"),
        (lambda: build_reward_composer(["math_answer"], weights={"fmt": 1.0}), ValueError, r"reward.weights names unknown reward\(s\) \['fmt'\]. Valid: math_answer"),
        (lambda: build_reward_composer(["math_answer"], args={"fmt": {}}), ValueError, r"reward.args names unknown reward\(s\) \['fmt'\]"),
        (lambda: build_reward_composer(["countdown"], args={"countdown": {"rules": "x"}}), ValueError, r"reward 'countdown' has no argument\(s\) \['rules'\]. Valid args: format_score, rule"),
        (lambda: build_reward_composer([{"fn": "countdown", "wieght": 2}]), ValueError, r"reward.fns\[0\] has unknown key\(s\) \['wieght'\]"),
        (lambda: build_reward_composer([3]), TypeError, r"reward.fns\[0\] must be a name or a mapping, got int"),
    ],
)
def test_build_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
