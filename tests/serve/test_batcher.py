"""The batcher: concurrent jobs coalesce into fewer engine calls, grouped by sampling parameters, on one thread."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rltk.rollout.base import Completion, RolloutEngine, SamplingParams
from rltk.serve.batcher import Batcher

from tests.waits import scaled


class CountingEngine(RolloutEngine):
    """Completion of prompt p is [sum(p), call number]; remembers each call's prompts, params and thread."""

    def __init__(self, delay_s=0.02, fail_on=None):
        self.calls = []
        self.delay_s = delay_s
        self.fail_on = fail_on

    def generate(self, prompt_ids, params):
        self.calls.append((prompt_ids, params, threading.current_thread().name))
        time.sleep(self.delay_s)
        if self.fail_on is not None and any(p == self.fail_on for p in prompt_ids):
            raise RuntimeError("engine exploded")
        number = len(self.calls)
        return [[Completion(i, [sum(p), number], [-0.1, -0.2], "length")] for i, p in enumerate(prompt_ids)]

    def update_weights(self, state_dict_or_model):
        pass


def test_concurrent_jobs_share_engine_calls_and_each_gets_its_own_completions():
    engine = CountingEngine()
    batcher = Batcher(engine, window_s=0.05, max_batch=64)
    params = SamplingParams(max_new_tokens=2)
    try:
        with ThreadPoolExecutor(16) as pool:
            futures = list(pool.map(lambda k: batcher.submit([[k, 1], [k, 2]], params), range(16)))
        results = [f.result(timeout=scaled(10)) for f in futures]
    finally:
        batcher.close()
    assert len(engine.calls) < 16
    for k, result in enumerate(results):
        assert [[c.token_ids[0] for c in samples] for samples in result] == [[k + 1], [k + 2]]
        assert [samples[0].prompt_index for samples in result] == [0, 1]
    assert {thread for *_, thread in engine.calls} == {"rltk-serve-batcher"}
    assert batcher.stats() == {"jobs": 16, "engine_calls": len(engine.calls), "sequences": 32, "cancelled": 0}


def test_n_is_expanded_into_repeated_prompts_so_different_n_share_a_call():
    engine = CountingEngine(delay_s=0.0)
    batcher = Batcher(engine, window_s=0.2)
    try:
        a = batcher.submit([[1]], SamplingParams(n=3))
        b = batcher.submit([[2], [3]], SamplingParams(n=1))
        out_a, out_b = a.result(timeout=scaled(10)), b.result(timeout=scaled(10))
    finally:
        batcher.close()
    [(prompts, params, _)] = engine.calls
    assert prompts == [[1], [1], [1], [2], [3]] and params.n == 1
    assert [len(group) for group in out_a] == [3] and [len(group) for group in out_b] == [1, 1]


def test_jobs_with_different_sampling_params_or_a_seed_get_separate_calls():
    engine = CountingEngine(delay_s=0.0)
    batcher = Batcher(engine, window_s=0.2)
    try:
        futures = [
            batcher.submit([[1]], SamplingParams(temperature=1.0)),
            batcher.submit([[2]], SamplingParams(temperature=0.5)),
            batcher.submit([[3]], SamplingParams(temperature=1.0)),
            batcher.submit([[4]], SamplingParams(temperature=1.0, seed=7)),
            batcher.submit([[5]], SamplingParams(temperature=1.0, seed=7)),
        ]
        for f in futures:
            f.result(timeout=scaled(10))
    finally:
        batcher.close()
    assert sorted(sorted(p[0] for p in prompts) for prompts, _, _ in engine.calls) == [[1, 3], [2], [4], [5]]


def test_max_batch_splits_a_round_at_job_boundaries():
    engine = CountingEngine(delay_s=0.0)
    batcher = Batcher(engine, window_s=0.3, max_batch=4)
    try:
        futures = [batcher.submit([[k]], SamplingParams(n=2)) for k in range(4)]  # 8 sequences
        for f in futures:
            f.result(timeout=scaled(10))
    finally:
        batcher.close()
    assert [len(prompts) for prompts, _, _ in engine.calls] == [4, 4]


def test_an_engine_failure_reaches_every_job_of_that_call_and_the_worker_keeps_serving():
    engine = CountingEngine(delay_s=0.0, fail_on=[13])
    batcher = Batcher(engine, window_s=0.2)
    try:
        bad, sibling = batcher.submit([[13]], SamplingParams()), batcher.submit([[1]], SamplingParams())
        with pytest.raises(RuntimeError, match="engine exploded"):
            bad.result(timeout=scaled(10))
        with pytest.raises(RuntimeError, match="engine exploded"):
            sibling.result(timeout=scaled(10))
        assert batcher.submit([[2]], SamplingParams()).result(timeout=scaled(10))[0][0].token_ids[0] == 2
    finally:
        batcher.close()
    with pytest.raises(RuntimeError, match="after close"):
        batcher.submit([[1]], SamplingParams())


@pytest.mark.parametrize("kwargs, match", [({"window_s": -1}, "window_s"), ({"max_batch": 0}, "max_batch")])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Batcher(CountingEngine(), **kwargs)


def test_a_round_keeps_collecting_while_jobs_keep_arriving_but_no_longer_than_max_wait_s():
    engine = CountingEngine(delay_s=0.0)
    batcher = Batcher(engine, window_s=0.4, max_wait_s=1.5)
    try:
        futures = []
        for k in range(3):  # gaps of ~0.1 s, each inside the 0.4 s window of the one before
            futures.append(batcher.submit([[k]], SamplingParams()))
            time.sleep(0.1)
        for f in futures:
            f.result(timeout=scaled(10))
        assert [len(prompts) for prompts, _, _ in engine.calls] == [3]
        start = time.monotonic()
        late = []
        while time.monotonic() - start < 2.5:  # a job every 0.1 s for 2.5 s: rounds end at max_wait_s
            late.append(batcher.submit([[9]], SamplingParams()))
            time.sleep(0.1)
        for f in late:
            f.result(timeout=scaled(10))
    finally:
        batcher.close()
    assert len(engine.calls) - 1 >= 2
    with pytest.raises(ValueError, match="max_wait_s"):
        Batcher(CountingEngine(), window_s=0.5, max_wait_s=0.1)


def test_expect_closes_a_round_as_soon_as_every_live_requester_has_a_job_in_it():
    engine = CountingEngine(delay_s=0.0)
    window_s = scaled(2.0)  # the bounds below tell a round that waited it from one that did not: they scale with it
    batcher = Batcher(engine, window_s=window_s, max_wait_s=5 * window_s)  # without expect(), it waits >= window_s
    try:
        batcher.expect(4)
        start = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            futures = list(pool.map(lambda k: batcher.submit([[k]], SamplingParams()), range(4)))
        for f in futures:
            f.result(timeout=scaled(10))
        assert time.monotonic() - start < window_s / 2
        assert [len(prompts) for prompts, _, _ in engine.calls] == [4]  # all four in one call, no window wait

        # Three of four live requesters asked; the fourth finished instead (expect(3)): the round goes at once.
        futures = [batcher.submit([[k]], SamplingParams()) for k in range(3)]
        time.sleep(0.2)
        assert len(engine.calls) == 1  # still collecting: the fourth could yet ask
        start = time.monotonic()
        batcher.expect(3)
        for f in futures:
            f.result(timeout=scaled(10))
        assert time.monotonic() - start < window_s / 2
        assert [len(prompts) for prompts, _, _ in engine.calls] == [4, 3]

        batcher.expect(None)  # off again: the window applies
        start = time.monotonic()
        batcher.submit([[7]], SamplingParams()).result(timeout=scaled(10))
        assert time.monotonic() - start >= window_s - 0.1
    finally:
        batcher.close()
    with pytest.raises(ValueError, match="expect"):
        batcher.expect(-1)


def test_with_expect_a_round_waits_past_the_window_for_the_requesters_just_answered():
    """No gap closes the round while a count is set: those answered by the last call get to send again."""
    unit = scaled(1.0)  # the whole choreography stretches alike on a slow machine
    engine = CountingEngine(delay_s=1.0 * unit)
    batcher = Batcher(engine, window_s=0.1 * unit, max_wait_s=0.6 * unit)
    try:
        batcher.expect(4)
        first = [batcher.submit([[k]], SamplingParams()) for k in range(2)]  # 2 of 4: closes by max_wait_s
        time.sleep(0.8 * unit)  # the engine is busy with those two
        backlog = [batcher.submit([[k]], SamplingParams()) for k in (2, 3)]
        for f in first:
            f.result(timeout=scaled(10))
        time.sleep(0.3 * unit)  # the two answered think for 3x the window before asking again
        again = [batcher.submit([[k]], SamplingParams()) for k in (0, 1)]
        for f in backlog + again:
            f.result(timeout=scaled(10))
    finally:
        batcher.close()
    assert [len(prompts) for prompts, _, _ in engine.calls] == [2, 4]


def test_a_round_samples_its_jobs_in_requester_order_whatever_order_they_arrived_in():
    engine = CountingEngine()
    batcher = Batcher(engine, window_s=0.05, max_batch=64)
    params = SamplingParams(max_new_tokens=2)
    try:
        batcher.expect(4)
        # arrival order: c, unnamed, a, b -> sampled a, b, c, then the unnamed one
        futures = {name: batcher.submit([[ord(name[0])]], params, order=name if name != "?" else None)
                   for name in ("c", "?", "a", "b")}
        answers = {name: future.result(timeout=scaled(5))[0][0].token_ids[0] for name, future in futures.items()}
    finally:
        batcher.close()
    assert len(engine.calls) == 1
    assert engine.calls[0][0] == [[ord("a")], [ord("b")], [ord("c")], [ord("?")]]
    assert answers == {name: ord(name[0]) for name in futures}  # each job still gets its own completion
