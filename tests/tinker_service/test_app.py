"""``rltk serve-tinker`` driven by the official ``tinker`` SDK: a real server in a subprocess, real clients.

One server for the module, over a tiny model folder written here (so the test can run rltk's own
forward on the same weights), with two API keys and a short session timeout.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
from tinker import types  # noqa: E402

from tests.waits import scaled

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KEY_A, KEY_B = "tml-key-a", "tml-key-b"
SESSION_TIMEOUT_S = 15  # the SDK sends a heartbeat every 10 s
SUMS = [("3+4=", "7"), ("5+7=", "12"), ("2+2=", "4"), ("9+1=", "10")]


def _benchmark():
    spec = importlib.util.spec_from_file_location("tinker_rl_benchmark", ROOT / "benchmarks" / "tinker_rl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from rltk.commands.serve_tinker import TINY_EMBEDDING_SCALE
    from rltk.models.tiny import build_char_tokenizer, build_tiny_model, save_pretrained_dir

    os.environ["TINKER_TELEMETRY"] = "0"
    root = tmp_path_factory.mktemp("tinker")
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=3)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(TINY_EMBEDDING_SCALE)
    folder = save_pretrained_dir(model, tokenizer, root / "tiny-folder")
    proc, url = _benchmark().start_server(str(folder), "--api-key", KEY_A, "--api-key", KEY_B, "--state-dir",
                                          str(root / "state"), "--session-timeout", str(SESSION_TIMEOUT_S),
                                          "--max-samplers", "2", "--threads", "1")
    try:
        yield {"url": url, "folder": folder, "state": root / "state", "tokenizer": tokenizer}
    finally:
        proc.terminate()
        proc.wait(scaled(30))


def _client(server, key=KEY_A):
    return tinker.ServiceClient(base_url=server["url"], api_key=key)


def _sft_data(tokenizer):
    return [_benchmark().sft_datum(tokenizer, prompt, answer) for prompt, answer in SUMS]


def _status(server, key=KEY_A) -> dict:
    import httpx

    return httpx.get(f"{server['url']}/rltk/status", headers={"X-API-Key": key}, timeout=scaled(60)).json()


def _train(client, data, steps, lr=1e-2):
    losses = []
    for _ in range(steps):
        fwd = client.forward_backward(data, "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=lr)).result()
        losses.append(fwd.result().metrics["loss:sum"])
    return losses


def _trained(server, *, rank: int, seed: int, steps: int):
    """A session, a training client trained ``steps`` times on the sums, and the sums' datums."""
    service = _client(server)
    client = service.create_lora_training_client(base_model="tiny-folder", rank=rank, seed=seed).result()
    data = _sft_data(server["tokenizer"])
    return service, client, data, _train(client, data, steps)


def test_supervised_loss_falls(server):
    service, _, _, losses = _trained(server, rank=8, seed=0, steps=15)
    # 4 sums, 2-3 answer tokens + eos each: ~12 tokens at ~ln(104) = 4.6 nats before training
    assert losses[0] > 30
    assert losses[-1] < 0.3 * losses[0], losses
    service.close("success").result()


def test_forward_logprobs_equal_rltks_forward_on_the_saved_adapter(server):
    import peft

    from rltk.models.loading import load_model
    from rltk.models.logprobs import response_logprobs

    service, client, data, _ = _trained(server, rank=4, seed=1, steps=3)
    path = client.save_state("lp").result().path
    served = client.forward(data, "cross_entropy").result().loss_fn_outputs
    model_id = path.split("/")[2]
    adapter = server["state"] / next(p.name for p in server["state"].iterdir()) / model_id / "weights" / "lp"
    model = peft.PeftModel.from_pretrained(load_model(server["folder"]), str(adapter))
    for datum, out in zip(data, served):
        tokens = list(datum.model_input.to_ints()) + [int(datum.loss_fn_inputs["target_tokens"].to_numpy()[-1])]
        ids = torch.tensor([tokens])
        with torch.no_grad():
            ours = response_logprobs(model, ids, torch.ones_like(ids), len(tokens) - 1)[0][0]
        np.testing.assert_allclose(out["logprobs"].to_numpy(), ours.numpy(), atol=1e-5, rtol=0)
    service.close("success").result()


def test_save_state_and_load_state_round_trip_to_identical_logprobs(server):
    service, client, data, _ = _trained(server, rank=8, seed=2, steps=2)
    path = client.save_state("round-trip").result().path

    def logprobs(c):
        return np.concatenate([o["logprobs"].to_numpy() for o in c.forward(data, "cross_entropy").result()
                               .loss_fn_outputs])

    saved = logprobs(client)
    _train(client, data, 2)
    assert np.abs(logprobs(client) - saved).max() > 1e-3  # training moved them
    client.load_state_with_optimizer(path).result()
    np.testing.assert_array_equal(logprobs(client), saved)
    restored = service.create_training_client_from_state(path).result()
    np.testing.assert_array_equal(logprobs(restored), saved)
    # the optimizer state came back too: one more identical step on both keeps them identical
    _train(client, data, 1)
    restored_with_adam = service.create_training_client_from_state_with_optimizer(path).result()
    _train(restored_with_adam, data, 1)
    np.testing.assert_allclose(logprobs(restored_with_adam), logprobs(client), atol=1e-6)
    service.close("success").result()


def test_a_custom_loss_computed_in_the_client_trains_like_the_same_builtin_loss(server):
    service = _client(server)
    data = _sft_data(server["tokenizer"])
    twins = [service.create_lora_training_client(base_model="tiny-folder", rank=4, seed=5).result() for _ in range(2)]

    def weighted_nll(batch, logprobs_list):  # cross_entropy, written as a custom loss
        loss = sum(-(d.loss_fn_inputs["weights"].to_torch() * lp).sum() for d, lp in zip(batch, logprobs_list))
        return loss, {}

    twins[0].forward_backward_custom(data, weighted_nll).result()
    twins[0].optim_step(types.AdamParams(learning_rate=1e-2)).result()
    _train(twins[1], data, 1)
    after = [np.concatenate([o["logprobs"].to_numpy() for o in c.forward(data, "cross_entropy").result()
                             .loss_fn_outputs]) for c in twins]
    np.testing.assert_allclose(after[0], after[1], atol=1e-5)
    service.close("success").result()


def test_sampling_returns_n_completions_with_their_logprobs(server):
    tokenizer = server["tokenizer"]
    service, client, _, _ = _trained(server, rank=8, seed=0, steps=15)
    sampler = client.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("3+4=", add_special_tokens=False))
    result = sampler.sample(prompt, num_samples=5, sampling_params=types.SamplingParams(max_tokens=4, seed=7)).result()
    assert len(result.sequences) == 5
    for seq in result.sequences:
        assert 1 <= len(seq.tokens) <= 4 and len(seq.logprobs) == len(seq.tokens)
        assert (seq.stop_reason == "stop") == (seq.tokens[-1] == tokenizer.eos_token_id)
        assert all(lp <= 0 for lp in seq.logprobs)
    # the trained sum is what it says, greedily
    greedy = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0)).result().sequences[0]
    assert tokenizer.decode(greedy.tokens, skip_special_tokens=True) == "7"
    # prompt log-probs equal the training forward's on the same weights
    full = tokenizer.encode("3+4=7", add_special_tokens=False)
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(full[1:]), "weights": np.ones(len(full) - 1)})
    forward = client.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert scored[0] is None
    np.testing.assert_allclose(scored[1:], forward, atol=1e-5)
    # a sampler from named sampler weights scores like the snapshot taken at the same weights
    named = service.create_sampling_client(model_path=client.save_weights_for_sampler("named").result().path).result()
    np.testing.assert_allclose(named.compute_logprobs(types.ModelInput.from_ints(full)).result()[1:], scored[1:],
                               atol=1e-6)
    # a stop token id ends the completion at it
    stop = tokenizer.encode("+", add_special_tokens=False)
    seq = sampler.sample(types.ModelInput.from_ints(tokenizer.encode("3", add_special_tokens=False)), 1,
                         types.SamplingParams(max_tokens=8, stop=stop, temperature=0.0)).result().sequences[0]
    assert seq.stop_reason == "length" or seq.tokens[-1] == stop[0]
    service.close("success").result()


def test_one_keys_clients_are_invisible_to_another(server):
    import httpx

    service = _client(server, KEY_A)
    client = service.create_lora_training_client(base_model="tiny-folder", rank=4).result()
    path = client.save_state("private").result().path
    sampler = client.save_weights_and_get_sampling_client().result()
    url = server["url"]
    other = {"X-API-Key": KEY_B}
    info = httpx.post(f"{url}/api/v1/get_info", json={"model_id": client.model_id, "type": "get_info"},
                      headers=other, timeout=scaled(60))
    assert info.status_code == 404 and "model_id" in info.json()["error"]["message"]
    assert httpx.get(f"{url}/api/v1/samplers/{sampler._sampling_session_id}", headers=other,
                     timeout=scaled(60)).status_code == 404
    mine = httpx.get(f"{url}/api/v1/samplers/{sampler._sampling_session_id}", headers={"X-API-Key": KEY_A},
                     timeout=scaled(60))
    assert mine.status_code == 200
    assert httpx.post(f"{url}/api/v1/create_session", json={}, headers={"X-API-Key": "tml-wrong"},
                      timeout=scaled(60)).status_code == 401
    service_b = _client(server, KEY_B)
    with pytest.raises(Exception, match=r"no checkpoint .*private"):
        service_b.create_training_client_from_state(path).result()
    assert _status(server, KEY_B)["training_clients"] == 0
    service.close("success").result()
    service_b.close("success").result()


def test_bad_input_is_a_400_naming_the_field(server):
    tokenizer = server["tokenizer"]
    service = _client(server)
    with pytest.raises(tinker.BadRequestError, match=r"base_model: this service serves only 'tiny-folder'"):
        service.create_lora_training_client(base_model="Qwen/Qwen3-8B").result()
    client = service.create_lora_training_client(base_model="tiny-folder", rank=4).result()
    tokens = tokenizer.encode("1+1=2", add_special_tokens=False)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(tokens[1:]),
                                        "logprobs": np.zeros(len(tokens) - 1, dtype=np.float32)})
    with pytest.raises(Exception, match=r"data\[0\]\.loss_fn_inputs\.advantages: missing"):
        client.forward_backward([datum], "importance_sampling").result()
    service.close("success").result()
    service = _client(server)
    client = service.create_lora_training_client(base_model="tiny-folder", rank=4).result()
    sampler = client.save_weights_and_get_sampling_client().result()
    with pytest.raises(Exception, match=r"sampling_params\.max_tokens: .* exceed the model's context of 256"):
        sampler.sample(types.ModelInput.from_ints(tokens), 1, types.SamplingParams(max_tokens=1000)).result()
    long_prompt = types.ModelInput.from_ints((tokens * 64)[:256])
    with pytest.raises(Exception, match=r"prompt: 256 tokens, over this model's limit of 255 prompt tokens"):
        sampler.sample(long_prompt, 1, types.SamplingParams(max_tokens=4)).result()
    service.close("success").result()


def test_image_chunks_are_refused_naming_what_the_service_lacks(server):
    """A text model's service: the SDK's ImageChunk and ImageAssetPointerChunk (sampling) and ImageChunk
    (forward_backward, protobuf) come back as tinker.BadRequestError naming the chunk and what reading images
    needs (a vision-language folder served, tests/tinker_service/test_vision.py), before any work."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (56, 56), (255, 0, 0)).save(buffer, format="PNG")
    image = types.ImageChunk(data=buffer.getvalue(), format="png", expected_tokens=4)
    tokens = server["tokenizer"].encode("1+1=", add_special_tokens=False)
    service = _client(server)
    client = service.create_lora_training_client(base_model="tiny-folder", rank=4).result()
    sampler = client.save_weights_and_get_sampling_client().result()
    missing = {"image": r"the served model is a text model, which cannot read images: serve a vision-language model folder",
               "image_asset_pointer": r"fetches no image addresses"}
    pointer = types.ImageAssetPointerChunk(format="png", location="/tmp/x.png", expected_tokens=4)
    for chunk, kind in ((image, "image"), (pointer, "image_asset_pointer")):
        prompt = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=tokens), chunk])
        with pytest.raises(tinker.BadRequestError, match=rf"prompt\.chunks\[1\]: an {kind} chunk; .*" + missing[kind]):
            sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
    # forward_backward's protobuf carries ImageChunk (the SDK cannot send an asset pointer there)
    datum = types.Datum(model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=tokens[:2]), image]),
                        loss_fn_inputs={"target_tokens": np.array(tokens[1:3] + [0] * 4)})
    with pytest.raises(tinker.BadRequestError, match=r"data\[0\]\.model_input\[1\]: an image chunk; " + missing["image"]):
        client.forward_backward([datum], "cross_entropy").result()
    # the refusals left the client working
    text = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:])})
    assert len(client.forward_backward([text], "cross_entropy").result().loss_fn_outputs) == 1
    service.close("success").result()


CHILD = textwrap.dedent("""
    import os, sys
    import tinker
    service = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
    client = service.create_lora_training_client(base_model="tiny-folder", rank=4).result()
    client.save_weights_and_get_sampling_client().result()
    print("ready", flush=True)
    os._exit(0)  # gone without finishing its session: no more heartbeats
""")


TOKENIZER_CHILD = textwrap.dedent("""
    import json, sys
    import tinker
    service = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
    texts = json.loads(sys.argv[3])
    training = service.create_lora_training_client(base_model="tiny-folder", rank=4).result().get_tokenizer()
    sampling = service.create_sampling_client(base_model="tiny-folder").get_tokenizer()
    print(json.dumps({"training": [training.encode(t, add_special_tokens=False) for t in texts],
                      "sampling": [sampling.encode(t, add_special_tokens=False) for t in texts],
                      "decoded": [sampling.decode(training.encode(t, add_special_tokens=False)) for t in texts]}))
""")


def test_clients_elsewhere_get_the_served_tokenizer_exactly(server, tmp_path):
    import json
    import shutil

    # the served files are read at start and given over HTTP: the folder can go, the client has no path to it
    shutil.rmtree(server["state"] / "served-tokenizer")
    texts = ["next a", "1 + 2 = 3", "a\tb\nc  d"]
    env = {**os.environ, "HF_ENDPOINT": f"{server['url']}/hub", "HF_TOKEN": KEY_A, "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "TINKER_TELEMETRY": "0"}
    out = subprocess.run([sys.executable, "-c", TOKENIZER_CHILD, server["url"], KEY_A, json.dumps(texts)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    expected = [server["tokenizer"].encode(t, add_special_tokens=False) for t in texts]
    assert got["training"] == expected and got["sampling"] == expected
    assert got["decoded"] == texts


def test_nothing_is_held_after_a_client_disconnects(server):
    key = "tml-key-a"
    # earlier tests' clients that ended without closing expire on the session timeout: let them go first, or
    # one expiring during this test's wait would read as this client's session going twice
    settle = time.monotonic() + scaled(3 * SESSION_TIMEOUT_S)
    while time.monotonic() < settle and _status(server, key)["sessions"] > 0:
        time.sleep(1)
    before = _status(server, key)
    subprocess.run([sys.executable, "-c", CHILD, server["url"], key], check=True, timeout=scaled(180),
                   env={**os.environ, "TINKER_TELEMETRY": "0"}, capture_output=True)
    held = _status(server, key)
    assert held["training_clients"] == before["training_clients"] + 1
    assert held["adapters_loaded"] == before["adapters_loaded"] + 2  # its adapter and its sampler's copy
    deadline = time.monotonic() + scaled(60)
    def still_held(now):  # a released session's adapters go after its training clients
        return (now["training_clients"] > before["training_clients"]
                or now["adapters_loaded"] > before["adapters_loaded"])
    while time.monotonic() < deadline and still_held(_status(server, key)):
        time.sleep(1)
    after = _status(server, key)
    assert after["sessions"] == before["sessions"] and after["training_clients"] == before["training_clients"]
    assert after["samplers"] == before["samplers"]
    assert after["adapters_loaded"] == before["adapters_loaded"]
