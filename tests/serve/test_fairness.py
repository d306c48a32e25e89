"""One request cannot hold the engine for everyone (issue 28, item 4): completions generated in slices
continue exactly; a client that hangs up stops costing engine calls; a small request is answered
between the slices of a large one. Against a real server on loopback where a server is the point."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from rltk.rollout.base import Completion, RolloutEngine, SamplingParams
from rltk.serve.app import BackgroundServer, create_app
from rltk.serve.batcher import Batcher
from tests.serve.helpers import tiny_chat_model
from tests.waits import scaled, wait_until

STOP = 99


class CountUpEngine(RolloutEngine):
    """Continues each prompt with last+1, last+2, ... (stop token ``STOP``); the log-prob of token t is -t/100.

    The next token depends only on the text so far, as a model's does, so a completion made in slices
    (each slice's prompt = the prompt + the tokens so far) must equal one made in one call.
    """

    def __init__(self, delay_s: float = 0.0):
        self.calls: list[tuple[int, int]] = []  # (rows, max_new_tokens)
        self.lasts: list[list[int]] = []  # each call's prompts' last tokens
        self.delay_s = delay_s

    def generate(self, prompt_ids, params):
        self.calls.append((len(prompt_ids), params.max_new_tokens))
        self.lasts.append([p[-1] for p in prompt_ids])
        time.sleep(self.delay_s)
        out = []
        for index, prompt in enumerate(prompt_ids):
            tokens, last = [], prompt[-1]
            while len(tokens) < params.max_new_tokens:
                last += 1
                tokens.append(last)
                if last == STOP:
                    break
            finish = "stop" if tokens and tokens[-1] == STOP else "length"
            out.append([Completion(index, tokens, [-t / 100 for t in tokens], finish, "")])
        return out

    def update_weights(self, state_dict_or_model):
        pass


@pytest.mark.parametrize("slice_tokens", [1, 3, 7, 50])
def test_a_completion_made_in_slices_equals_one_made_in_one_call(slice_tokens):
    prompts = [[10], [80, 90], [1, 2, 3]]  # 90 reaches the stop token 99 after 9 tokens
    whole = Batcher(CountUpEngine(), window_s=0.0)
    sliced = Batcher(CountUpEngine(), window_s=0.0, slice_tokens=slice_tokens, max_batch_tokens=10**6)
    try:
        expected = whole.submit(prompts, SamplingParams(max_new_tokens=20, n=2)).result(timeout=scaled(10))
        got = sliced.submit(prompts, SamplingParams(max_new_tokens=20, n=2)).result(timeout=scaled(10))
    finally:
        whole.close()
        sliced.close()
    assert [[(c.token_ids, c.logprobs, c.finish_reason, c.prompt_index) for c in g] for g in got] == \
        [[(c.token_ids, c.logprobs, c.finish_reason, c.prompt_index) for c in g] for g in expected]
    assert got[1][0].token_ids == list(range(91, 100)) and got[1][0].finish_reason == "stop"
    assert got[0][0].token_ids == list(range(11, 31)) and got[0][0].finish_reason == "length"
    assert sliced.stats()["engine_calls"] == -(-20 // slice_tokens)  # the longest row's slices, no more


def test_rows_are_shared_round_robin_between_requesters_within_the_work_cap():
    engine = CountUpEngine(delay_s=0.05)
    batcher = Batcher(engine, window_s=0.0, max_batch=64, slice_tokens=4, max_batch_tokens=5 * 10)
    try:
        big = batcher.submit([[1]] * 40, SamplingParams(max_new_tokens=8), requester="big")
        time.sleep(0.02)  # the big one's first call is running
        small = batcher.submit([[50]], SamplingParams(max_new_tokens=4), requester="small")
        assert small.result(timeout=scaled(10))[0][0].token_ids == [51, 52, 53, 54]
        assert not big.done()
        big.result(timeout=scaled(30))
    finally:
        batcher.close()
    # a row costs its prompt + tokens so far + 4: 10 fresh rows fit in 50; the second call takes the small one
    # first (served least recently; 1 + 0 + 4), then the big one's first rows again (1 + 4 + 4 each): 5 of them
    assert engine.calls[0] == (10, 4) and engine.calls[1] == (6, 4)
    assert 50 in engine.lasts[1] and all(50 not in lasts for lasts in engine.lasts[2:])


@pytest.fixture
def slow_server():
    """The tiny model's tokenizer over a count-up engine that takes 0.1 s a call, in 2-token slices."""
    tokenizer, _ = tiny_chat_model()
    engine = CountUpEngine(delay_s=0.1)
    app = create_app(engine, tokenizer, model_name="tiny", defaults=SamplingParams(max_new_tokens=40),
                     max_model_len=None, window_s=0.0, slice_tokens=2, max_batch_tokens=10**6)
    with BackgroundServer(app) as server:
        yield server, engine


def test_a_request_whose_client_hung_up_is_dropped_before_its_next_engine_call(slow_server):
    server, engine = slow_server
    with pytest.raises(httpx.ReadTimeout):  # 40 tokens in 2-token slices of 0.1 s: 2 s; the client leaves at 0.35 s
        httpx.post(server.base_url + "/completions", timeout=0.35,
                   json={"model": "tiny", "prompt": [[5]] * 8, "max_tokens": 40})
    # the server notices within its 0.05 s poll (a loaded machine: later); the call running then finishes
    wait_until(lambda: server.app.state.rltk.batcher.stats()["cancelled"] == 1, "the server to drop the request", 30)
    time.sleep(scaled(0.2))
    calls = len(engine.calls)
    assert calls <= min(19, scaled(8)), engine.calls  # not the 20 slices the request asked for
    time.sleep(scaled(0.5))
    assert len(engine.calls) == calls  # nothing more for it
    assert server.app.state.rltk.counters["cancelled"] == 1
    start = time.monotonic()
    reply = httpx.post(server.base_url + "/completions", timeout=scaled(10),
                       json={"model": "tiny", "prompt": [[5]], "max_tokens": 2}).json()
    assert reply["choices"][0]["finish_reason"] == "length" and time.monotonic() - start < scaled(1.0)


def test_a_small_request_is_answered_between_the_slices_of_a_large_one(slow_server):
    server, engine = slow_server
    result = {}

    def large():
        result["large"] = httpx.post(server.base_url + "/completions", timeout=scaled(30),
                                     json={"model": "tiny", "prompt": [[5]] * 16, "max_tokens": 40})
        result["large_done"] = time.monotonic()

    thread = threading.Thread(target=large)
    thread.start()
    time.sleep(0.3)
    start = time.monotonic()
    small = httpx.post(server.base_url + "/completions", timeout=scaled(30), json={"model": "tiny", "prompt": [[5]],
                                                                            "max_tokens": 2})
    small_done = time.monotonic()
    thread.join()
    assert small.status_code == 200 and result["large"].status_code == 200
    assert small_done - start < 0.6  # the running slice, then one shared with the large request's rows
    assert result["large_done"] - small_done > 1.0  # the large one had most of its 2 s still to go
    assert len(result["large"].json()["choices"]) == 16


def test_many_small_requesters_share_one_call_while_a_large_one_gets_its_share():
    engine = CountUpEngine()
    batcher = Batcher(engine, window_s=0.3, slice_tokens=4, max_batch_tokens=10**6, max_share_tokens=20)
    try:
        big = batcher.submit([[1]] * 40, SamplingParams(max_new_tokens=4), requester="big")
        small = [batcher.submit([[50 + k]], SamplingParams(max_new_tokens=4), requester=f"s{k}") for k in range(10)]
        for future in small + [big]:
            future.result(timeout=scaled(10))
    finally:
        batcher.close()
    # every row costs 1 + 0 + 4 = 5: the large requester's share of 20 is 4 rows a call, the ten small ones all go
    # in the first call beside them; then the large one's 36 rows left, 4 a call
    assert engine.calls[0] == (14, 4)
    assert sorted(engine.lasts[0]) == [1] * 4 + list(range(50, 60))
    assert engine.calls[1:] == [(4, 4)] * 9
