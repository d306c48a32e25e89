"""The server pool (:mod:`rltk.rollout.server_pool`) under a plugin's server engine: ``rltk_plugin_example``'s
``rltk_serve`` against real ``rltk serve`` endpoints it launches, and against endpoints served in this process.

The asynchronous GRPO run on it is ``tests/recipes/test_async_server_engine.py``."""

from __future__ import annotations

import importlib.util
import socket
import threading

import pytest

from rltk.rollout.base import SamplingParams
from rltk.rollout.hf import HFRolloutEngine
from rltk.rollout.server_pool import ServerError
from rltk.training.rollouts.engine_weights import write_weights_file

from tests.waits import scaled

from .conftest import build_model, build_tokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("fastapi") is None or
                                importlib.util.find_spec("rltk_plugin_example") is None,
                                reason="needs the serve extra and rltk-plugin-example")

PROMPTS = ["1+2=", "33+4=", "abc", "9*9="]
GREEDY = SamplingParams(greedy=True, max_new_tokens=6, stop_token_ids=[])


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _ids(tok, prompts):
    return [tok.encode(p, add_special_tokens=False) for p in prompts]


@pytest.mark.slow
def test_a_plugin_server_engine_samples_as_hf_spread_within_the_bound_and_follows_every_weight_version(
        tok, tmp_path, monkeypatch):
    """Two launched endpoints: greedy completions and their log-probs are the hf engine's on the same weights,
    requests go round-robin with at most max_in_flight on each, and both a weights copy (update_weights) and
    a trainer's file with its tied head stored once (load_weights_file) reach every endpoint, labelled."""
    import httpx

    from rltk_plugin_example.serve_engine import RltkServeEngine

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the endpoints' torch: two of them on a small machine
    model, other = build_model(len(tok), seed=0), build_model(len(tok), seed=1)
    engine = RltkServeEngine(model, tok, launch=2, max_in_flight=2, timeout_s=scaled(120),
                            start_timeout_s=scaled(600))
    processes = [server.process for server in engine._servers]
    try:
        prompts = _ids(tok, PROMPTS) * 2
        want = HFRolloutEngine(model, tok).generate(prompts, GREEDY)
        got = engine.generate(prompts, GREEDY)
        assert [g[0].token_ids for g in got] == [w[0].token_ids for w in want]
        for g, w in zip(got, want):
            assert g[0].logprobs == pytest.approx(w[0].logprobs, abs=1e-5) and g[0].finish_reason == "length"
        stats = engine.server_stats()
        assert [s["requests"] for s in stats] == [4, 4]  # round-robin
        assert all(1 <= s["peak_in_flight"] <= 2 for s in stats)  # max_in_flight=2
        seeded = SamplingParams(n=3, temperature=0.8, max_new_tokens=5, stop_token_ids=[], seed=7)
        assert engine.generate(prompts[:1], seeded) == engine.generate(prompts[:1], seeded)  # a seed per sample

        engine.track_versions = True
        engine.update_weights(other)
        assert [httpx.get(url + "/rltk/weights").json()["weight_version"] for url in engine.servers] == [1, 1]
        want_other = HFRolloutEngine(other, tok).generate(prompts, GREEDY)
        got = engine.generate(prompts, GREEDY)
        assert [g[0].token_ids for g in got] == [w[0].token_ids for w in want_other] != [w[0].token_ids for w in want]
        assert all(g[0].versions == [1] * 6 for g in got)  # labelled by the endpoints

        path = tmp_path / "policy.safetensors"
        write_weights_file(model, path, 5)  # as an asynchronous run's trainer writes it: tied tensors once
        assert engine.load_weights_file(str(path), 5, interrupt=True)
        assert [httpx.get(url + "/rltk/weights").json()["weight_version"] for url in engine.servers] == [5, 5]
        got = engine.generate(prompts, GREEDY)
        assert [g[0].token_ids for g in got] == [w[0].token_ids for w in want]
        assert all(g[0].versions == [5] * 6 for g in got) and engine.weight_version == 5
    finally:
        engine.close()
    assert engine.servers == [] and all(p.poll() is not None for p in processes)  # close() stopped them


def test_an_endpoint_that_takes_no_weights_is_refused_at_once_naming_the_flag(tok):
    from rltk.serve.app import BackgroundServer, create_app
    from rltk_plugin_example.serve_engine import RltkServeEngine

    model = build_model(len(tok), seed=0)
    with BackgroundServer(create_app(HFRolloutEngine(model, tok), tok)) as server:
        url = server.base_url.removesuffix("/v1")
        with pytest.raises(ServerError, match=rf"rltk serve endpoint {url} answered /rltk/weights with HTTP 404: "
                                              r".*start rltk serve with --accept-weights"):
            RltkServeEngine(model, tok, servers=[url], timeout_s=scaled(30))


def test_the_weights_route_names_a_file_it_cannot_load_and_loads_between_engine_calls(tok, tmp_path):
    import httpx

    from rltk.serve.app import BackgroundServer, create_app

    model = build_model(len(tok), seed=0)
    app = create_app(HFRolloutEngine(model, tok), tok, accept_weights=True)
    with BackgroundServer(app) as server:
        url = server.base_url.removesuffix("/v1")
        missing = tmp_path / "none.safetensors"
        answer = httpx.post(url + "/rltk/weights", json={"path": str(missing), "version": 3})
        assert answer.status_code == 400 and str(missing) in answer.json()["error"]["message"]
        assert httpx.get(url + "/rltk/weights").json() == {"weight_version": 0}  # nothing loaded, no new label
        path = tmp_path / "other.safetensors"
        write_weights_file(build_model(len(tok), seed=1), path, 3)
        # the file stores the tied head once; without its alias the model misses a name
        answer = httpx.post(url + "/rltk/weights", json={"path": str(path), "version": 3, "aliases": {
            "model.embed_tokens.weight": "lm_head.weight"}})
        assert answer.status_code == 200 and answer.json() == {"weight_version": 3}
        body = {"model": "rltk", "prompt": _ids(tok, PROMPTS[:1])[0], "max_tokens": 4, "temperature": 0,
                "logprobs": 0, "return_token_ids": True, "stop_token_ids": []}
        [choice] = httpx.post(url + "/v1/completions", json=body).json()["choices"]
        [[want]] = HFRolloutEngine(build_model(len(tok), seed=1), tok).generate(
            _ids(tok, PROMPTS[:1]), SamplingParams(greedy=True, max_new_tokens=4, stop_token_ids=[]))
        assert choice["token_ids"] == want.token_ids and choice["token_versions"] == [3] * 4


def test_a_server_that_hangs_is_a_timeout_naming_it(tok):
    """A socket that accepts and never answers: the engine's first call times out, naming the address."""
    from rltk_plugin_example.serve_engine import RltkServeEngine

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    held = []
    threading.Thread(target=lambda: held.append(listener.accept()), daemon=True).start()
    try:
        with pytest.raises(ServerError, match=rf"rltk serve endpoint http://127.0.0.1:{port} did not answer "
                                              r"/rltk/weights within 1 s \(rollout\.engine_args\.timeout_s\)"):
            RltkServeEngine(build_model(len(tok)), tok, servers=[f"http://127.0.0.1:{port}"], timeout_s=1)
    finally:
        listener.close()
