"""``reward_model``: a tiny Qwen2ForSequenceClassification scores like a direct forward pass, locally and through
``rltk serve-reward``, alone and beside a rule reward in the composer."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from rltk.commands.cli import main
from rltk.models.tiny import build_char_tokenizer, build_tiny_reward_model, save_pretrained_dir
from rltk.rewards.compose import build_reward_composer
from rltk.rewards.judges.reward_model import load_scorer, reward_model
from tests.rewards.slow_http import SlowServer, timed
from tests.waits import scaled

REPO = Path(__file__).resolve().parents[2]
SIZES = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
PROMPTS = ["<|user|>1+2=<|eos|><|assistant|>", "<|user|>12+30=<|eos|><|assistant|>", "<|user|>7+8=<|eos|><|assistant|>",
           "<|user|>99+1=<|eos|><|assistant|>", "<|user|>5+5=<|eos|><|assistant|>"]
RESPONSES = ["3", "42 is the answer", "15", "one hundred, I think", ""]


@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory):
    tokenizer = build_char_tokenizer()
    model = build_tiny_reward_model(tokenizer, seed=3, **SIZES)
    return save_pretrained_dir(model, tokenizer, tmp_path_factory.mktemp("rm") / "model"), tokenizer, model.eval()


def direct(model, tokenizer, text: str) -> float:
    """The model's own forward on one unpadded text: its output at the last token."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return float(model(input_ids=ids).logits[0, 0])


def raws(results):
    return [r["raw"] for r in results]


def test_scores_equal_a_direct_forward_and_do_not_depend_on_batching_or_padding(rm_folder):
    folder, tokenizer, model = rm_folder
    expected = [direct(model, tokenizer, p + r) for p, r in zip(PROMPTS, RESPONSES)]
    assert len(set(round(e, 5) for e in expected)) == len(expected)  # the texts are told apart
    one_by_one = raws(reward_model(prompt=PROMPTS, response=RESPONSES, path=str(folder), micro_batch_size=1))
    batched = raws(reward_model(prompt=PROMPTS, response=RESPONSES, path=str(folder), micro_batch_size=3))
    assert one_by_one == pytest.approx(expected, abs=1e-5)
    assert batched == pytest.approx(expected, abs=1e-5)
    # the model's own pooling over a padded batch, either side, gives the same numbers: padding is invisible
    texts = [p + r for p, r in zip(PROMPTS, RESPONSES)]
    for side in ("left", "right"):
        tokenizer.padding_side = side
        enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
        position_ids = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(**enc, position_ids=position_ids).logits[:, 0]
        assert logits.tolist() == pytest.approx(expected, abs=1e-5)
    tokenizer.padding_side = "right"


def test_truncation_keeps_the_configured_side_and_sigmoid_scale_offset_by_hand(rm_folder):
    folder, tokenizer, model = rm_folder
    text = PROMPTS[1] + RESPONSES[1]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 6
    left = raws(reward_model(prompt=[PROMPTS[1]], response=[RESPONSES[1]], path=str(folder), max_length=6))
    right = raws(reward_model(prompt=[PROMPTS[1]], response=[RESPONSES[1]], path=str(folder), max_length=6,
                              truncation_side="right"))
    assert left[0] == pytest.approx(direct(model, tokenizer, tokenizer.decode(ids[-6:])), abs=1e-5)
    assert tokenizer.decode(ids[-6:]) == "answer"
    assert right[0] == pytest.approx(direct(model, tokenizer, tokenizer.decode(ids[:6])), abs=1e-5)
    raw = direct(model, tokenizer, text)
    [out] = reward_model(prompt=[PROMPTS[1]], response=[RESPONSES[1]], path=str(folder), sigmoid=True, scale=2.0,
                         offset=-1.0)
    assert out == pytest.approx({"score": 2.0 / (1.0 + math.exp(-raw)) - 1.0, "raw": raw}, abs=1e-5)


def test_the_model_is_loaded_once_per_process(rm_folder):
    folder, _, _ = rm_folder
    first = load_scorer(str(folder), max_length=1024)
    reward_model(prompt=PROMPTS[:2], response=RESPONSES[:2], path=str(folder), micro_batch_size=16)
    assert load_scorer(str(folder), max_length=1024) is first


def test_combines_with_exact_match_through_the_composer_with_weights(rm_folder):
    folder, tokenizer, model = rm_folder
    composer = build_reward_composer(
        ["exact_match", "reward_model"], weights={"exact_match": 1.0, "reward_model": 0.5},
        args={"reward_model": {"path": str(folder), "scale": 2.0}})
    samples = [{"prompt": p, "response": r, "ground_truth": gt, "extras": {}}
               for p, r, gt in zip(PROMPTS[:3], RESPONSES[:3], ["3", "42", "16"])]
    with composer:
        assert "reward_model" in composer.in_process  # batched: no worker process, no pickling of the model
        results = composer.score_batch(samples)
        stats = composer.stats()
    for sample, (total, details), em in zip(samples, results, [1.0, 0.0, 0.0]):
        raw = direct(model, tokenizer, sample["prompt"] + sample["response"])
        assert details["exact_match"] == em
        assert details["reward_model/raw"] == pytest.approx(raw, abs=1e-5)
        assert details["reward_model"] == pytest.approx(2.0 * raw, abs=1e-5)
        assert total == pytest.approx(em + 0.5 * 2.0 * raw, abs=1e-5)
    assert stats["failures/reward_model"] == 0 and stats["calls"] == 3


def start_reward_server(folder, *extra, timeout_s: float = 120):
    """`rltk serve-reward FOLDER --port 0` in a subprocess; returns it and the /score URL it printed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "rltk.commands.cli", "serve-reward", str(folder), "--port", "0", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "serving reward model" in line:
            return proc, line.split(" at ")[1].strip()
        if proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"rltk serve-reward did not start: {proc.stderr.read()[-3000:]}")


def post(url, body: bytes):
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=scaled(30)) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_url_form_scores_like_the_local_model_through_rltk_serve_reward(rm_folder):
    folder, tokenizer, model = rm_folder
    proc, url = start_reward_server(folder, "--micro-batch-size", "2")
    try:
        local = reward_model(prompt=PROMPTS, response=RESPONSES, path=str(folder))
        remote = reward_model(prompt=PROMPTS, response=RESPONSES, url=url, micro_batch_size=3, sigmoid=True)
        assert raws(remote) == pytest.approx(raws(local), abs=1e-5)
        assert [r["score"] for r in remote] == pytest.approx([1 / (1 + math.exp(-r)) for r in raws(local)], abs=1e-5)
        # the protocol by hand: whole texts, and a malformed body answered 400 with what is wrong
        status, answer = post(url, json.dumps({"texts": [PROMPTS[0] + RESPONSES[0]]}).encode())
        assert status == 200 and answer["scores"] == pytest.approx([direct(model, tokenizer, PROMPTS[0] + "3")],
                                                                  abs=1e-5)
        status, answer = post(url, json.dumps({"prompts": ["a"], "responses": ["b", "c"]}).encode())
        assert status == 400 and "same length" in answer["error"]
        status, answer = post(url, b"{not json")
        assert status == 400
    finally:
        proc.terminate()
        proc.wait(timeout=scaled(30))


def test_a_reward_server_that_is_down_gives_the_counted_fallback_quickly(monkeypatch):
    # a long backoff, so that one round of retries and four differ by far more than a loaded machine's delays
    monkeypatch.setattr("rltk.rewards.judges.reward_model.RETRY_BACKOFF_S", 3.0)
    with socket.socket() as sock:  # a port nothing listens on: bound, then closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    composer = build_reward_composer(
        ["exact_match", "reward_model"], args={"reward_model": {"url": f"http://127.0.0.1:{port}/score",
                                                                "retries": 1}}, fallback=-1.0)
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="reward 'reward_model' failed on a sample \\(ConnectionError"):
        results = composer.score_batch([{"prompt": "1+1=", "response": "2", "ground_truth": "2"}] * 200)
    # 13 requests of 16: the first round of 4 spends one 3 s backoff, the other 9 are not sent (4 rounds: 12 s)
    assert time.monotonic() - start < scaled(8.0)
    assert [r[1]["reward_model"] for r in results] == [-1.0] * 200 and [r[0] for r in results] == [0.0] * 200
    assert composer.stats()["failures/reward_model"] == 200


@pytest.mark.parametrize("byte_every_s", [0.2, None], ids=["trickles", "never-answers"])
def test_a_reward_server_that_trickles_or_never_answers_costs_timeout_s_a_try_and_the_fallback(monkeypatch,
                                                                                                byte_every_s):
    # a trickle of a byte every 0.2 s, under any socket timeout over 0.2 s, used to hold a request as long as
    # the answer (24 bytes: ~5 s of body here) and then score it; each try now ends at its timeout_s
    monkeypatch.setattr("rltk.rewards.judges.reward_model.RETRY_BACKOFF_S", 0.1)
    with SlowServer({"scores": [3.0, 3.0]}, byte_every_s=byte_every_s) as server:
        composer = build_reward_composer(["reward_model"], args={"reward_model": {
            "url": server.url + "/score", "timeout_s": 1, "retries": 1}}, fallback=-1.0)
        with pytest.warns(RuntimeWarning, match="TimeoutError: .* did not answer within 1 s"):
            results, elapsed = timed(lambda: composer.score_batch([{"prompt": "p", "response": "r",
                                                                    "ground_truth": "g"}] * 2))
        assert 2.1 <= elapsed < scaled(2.1 + 1.0), elapsed  # (retries + 1) * timeout_s + backoff
        assert server.accepted == 2
    assert [score for score, _ in results] == [-1.0, -1.0]
    assert composer.stats()["failures/reward_model"] == 2 and composer.stats()["timeouts/reward_model"] == 2


def test_config_errors_name_the_key_and_what_is_valid(rm_folder, capsys):
    folder, _, _ = rm_folder
    base = ["validate", "grpo", "reward.reward_fn=[exact_match,reward_model]"]
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "'reward.reward_fn_args.reward_model': reward_fn 'reward_model': set exactly one of path" in err
    assert "got neither" in err and "Traceback" not in err
    assert main([*base, f"reward.reward_fn_args.reward_model.path={folder}",
                 "reward.reward_fn_args.reward_model.url=http://h:1/score"]) == 2
    assert "got both" in capsys.readouterr().err
    assert main([*base, f"reward.reward_fn_args.reward_model.path={folder.parent}"]) == 2
    assert "is not a Hugging Face model folder (no config.json)" in capsys.readouterr().err
    assert main([*base, "reward.reward_fn_args.reward_model.url=http://h:1/score",
                 "reward.reward_fn_args.reward_model.max_length=64"]) == 2
    assert "rltk serve-reward flags: max_length -> --max-length" in capsys.readouterr().err
    assert main([*base, f"reward.reward_fn_args.reward_model.path={folder}",
                 "reward.reward_fn_args.reward_model.truncation_side=middle"]) == 2
    assert "truncation_side must be one of left, right, got 'middle'" in capsys.readouterr().err
    assert main([*base, f"reward.reward_fn_args.reward_model.path={folder}",
                 "reward.reward_fn_args.reward_model.max_lenght=64"]) == 2
    err = capsys.readouterr().err
    assert "'reward.reward_fn_args.reward_model.max_lenght': reward_fn 'reward_model' has no argument" in err
    assert "max_length" in err and "Traceback" not in err
    assert main([*base, f"reward.reward_fn_args.reward_model.path={folder}"]) == 0
    # the Python API says the same, under the reward's name
    with pytest.raises(ValueError, match="reward 'reward_model': set exactly one of path"):
        build_reward_composer(["reward_model"])


def test_serve_reward_refuses_a_folder_that_is_no_model(tmp_path, capsys):
    assert main(["serve-reward", str(tmp_path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "is not a Hugging Face model folder (no config.json)" in err and "Traceback" not in err


@pytest.mark.slow  # a 2-step SFT + 3-step GRPO run of the embedded default (~30 s here)
def test_a_grpo_run_scores_with_the_reward_model_beside_exact_match(rm_folder, tmp_path):
    folder, _, _ = rm_folder
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", "logging.logger=[jsonl]", "logging.plot=false",
                 "trainer.total_steps=3", "trainer.warmup_steps=0", "sft.steps=2", "sft.warmup_steps=0",
                 "sft.stop_at_accuracy=null", "trainer.eval_every=0", "data.train_size=40", "data.eval_size=8",
                 "reward.reward_fn=[exact_match,reward_model]", "reward.weights.reward_model=0.5",
                 f"reward.reward_fn_args.reward_model.path={folder}"]) == 0
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if "reward/reward_model" in m]
    assert len(steps) == 3
    for m in steps:
        # the step's mean reward is the weighted sum of the components' means (every sample has both)
        assert m["rollout/reward"] == pytest.approx(m["reward/exact_match"] + 0.5 * m["reward/reward_model"], abs=1e-6)
        assert m["reward/reward_model/raw"] == pytest.approx(m["reward/reward_model"])
        assert m["reward_fn/failures/reward_model"] == 0
