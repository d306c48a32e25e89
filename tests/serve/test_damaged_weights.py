"""Damaged weights (issue 28, item 6): refused at load with the file named, in one line; a run folder
falls back to its newest intact checkpoint and serves it."""

from __future__ import annotations

import openai
import pytest

from rltk.commands.cli import main
from tests.serve.test_cli_serve import start_serving, stop


def tiny_folder(path):
    from rltk.models.tiny import build_char_tokenizer, build_tiny_model, save_pretrained_dir

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64)
    return save_pretrained_dir(model, tokenizer, path)


def overwrite_data(file, byte: int) -> None:
    """Every byte after the safetensors header set to ``byte``; the size stays (the header says where data starts)."""
    import struct

    raw = bytearray(file.read_bytes())
    start = 8 + struct.unpack("<Q", bytes(raw[:8]))[0]
    raw[start:] = bytes([byte]) * (len(raw) - start)
    file.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage, expected", [
    ("truncate", "does not open as safetensors"),
    ("ff", "NaN/inf values"),  # 0xFF bytes are NaN in float32
    ("zeros", "every byte of its tensor data is 0x00"),
])
def test_a_damaged_model_folder_is_refused_in_one_line_naming_the_file(tmp_path, capsys, damage, expected):
    folder = tiny_folder(tmp_path / "m")
    weights = folder / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        overwrite_data(weights, 0xFF if damage == "ff" else 0x00)
    assert main(["serve", str(folder), "--port", "0"]) == 1  # damaged data, as rltk export answers it
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert str(weights) in err and expected in err


def test_an_intact_model_folder_passes_the_check(tmp_path):
    from rltk.models.integrity import check_weights

    check_weights(tiny_folder(tmp_path / "m"))


@pytest.mark.slow  # a 2-step warm-up writing two checkpoints, then a server process (~20-40 s)
def test_a_run_folder_falls_back_to_its_newest_intact_checkpoint_and_a_wiped_one_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", "sft.steps=2", "sft.warmup_steps=0",
                 "sft.stop_at_accuracy=null", "data.train_size=40", "data.eval_size=8", "checkpoint.every=1",
                 "checkpoint.resume=never", "checkpoint.keep_last=2", "logging.logger=[jsonl]", "logging.plot=false",
                 "stages=[{name: warmup, type: sft}]"]) == 0
    newest = run_dir / "checkpoints" / "step_000002"
    overwrite_data(newest / "model" / "model.safetensors", 0xFF)  # same size: the manifest check passes
    capsys.readouterr()
    assert main(["serve", str(newest), "--port", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(newest / "model" / "model.safetensors") in err and "NaN/inf" in err

    proc, url = start_serving(run_dir, "--max-tokens", "4")
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        reply = client.completions.create(model="run", prompt="1+2=", max_tokens=4, temperature=0, logprobs=0)
        assert all(lp <= 0 for lp in reply.choices[0].logprobs.token_logprobs)  # finite: the intact weights
    finally:
        stop(proc)
    warning = proc.stderr.read()
    assert "skipping damaged checkpoint step_000002" in warning and "newest intact checkpoint, step_000001" in warning
    assert newest.is_dir()  # serving reads the run; it moves nothing
