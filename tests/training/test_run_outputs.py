"""What a short run leaves behind and prints: checkpoints only when asked for, files with the usual
mode, stage-labelled progress lines, no transformers progress bars and no DeepSpeed import."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rltk.commands.cli import main
from rltk.training.scaffold.export import export_checkpoint
from rltk.training.stages.stage_checkpoint import should_checkpoint

from tests.waits import scaled

TINY_RUN = ["sft.steps=2", "sft.warmup_steps=0", "trainer.total_steps=2", "trainer.warmup_steps=0",
            "data.train_size=40", "data.eval_size=8", "trainer.prompts_per_step=4", "rollout.n=2",
            "checkpoint.resume=never"]


def modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("every, last, saved", [(0, 5, []), (2, 5, [2, 4, 5]), (5, 5, [5])])
def test_should_checkpoint(every, last, saved):
    cfg = OmegaConf.create({"checkpoint": {"every": every}})
    assert [s for s in range(1, last + 1) if should_checkpoint(cfg, s, last)] == saved


@pytest.mark.slow  # trains a tiny model for 4 steps (~10 s)
def test_checkpoint_every_zero_writes_no_checkpoint_and_the_run_still_finishes(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", *TINY_RUN, "checkpoint.every=0",
                 "logging.logger=[jsonl]"]) == 0
    assert not list(run_dir.glob("checkpoints/*")), "checkpoint.every=0 must not write even the final checkpoint"
    steps = sorted({json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()})
    assert steps == [1, 2, 3, 4]  # 2 warm-up and 2 RL steps
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and 0.0 <= summary["final"]["eval/accuracy"] <= 1.0
    assert (run_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # a fresh process training a tiny model for 4 steps (~20 s)
def test_a_run_prints_stage_lines_and_writes_checkpoints_and_exports_with_the_usual_mode(tmp_path):
    from rltk.models.tiny import build_char_tokenizer, build_tiny_model, save_pretrained_dir

    tokenizer = build_char_tokenizer()
    model_dir = save_pretrained_dir(build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2,
                                                     num_kv_heads=1, intermediate_size=64), tokenizer,
                                    tmp_path / "tiny")
    run_dir = tmp_path / "run"
    # A fresh process: DeepSpeed, once imported by another test, stays in sys.modules.
    code = ("import sys; from rltk.commands.cli import main; rc = main(sys.argv[1:]); "
            "print('deepspeed imported:', 'deepspeed' in sys.modules); sys.exit(rc)")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run(
        [sys.executable, "-c", code, "run", "grpo", f"output_dir={run_dir}", f"model.path={model_dir}", *TINY_RUN,
         "checkpoint.every=1", "logging.logger=[console,jsonl]", "logging.plot=false"],
        capture_output=True, text=True, timeout=scaled(600), umask=0o022, env={**env, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    printed = out.stdout + out.stderr

    # progress: the stage on each line, the warm-up loss, held-out apart from training numbers
    lines = [line for line in out.stderr.splitlines() if line.startswith("[")]
    assert [line.split(" |")[0] for line in lines] == [
        "[warmup 1/2] step 1/4 (25%)", "[warmup 2/2] step 2/4 (50%)", "[grpo 1/2] step 3/4 (75%)",
        "[grpo 2/2] step 4/4 (100%)"]
    assert "| sft loss " in lines[0] and lines[0].endswith(", then grpo ?")
    assert "| train reward " in lines[2] and "| held-out greedy " in lines[2] and "sft loss" not in lines[2]
    # no bar per model load or save, and DeepSpeed stays out of an accelerate run
    for noise in ("Loading weights", "Writing model shards", "Setting accelerator"):
        assert noise not in printed
    assert "deepspeed imported: False" in out.stdout

    # every file a checkpoint holds follows the umask (022 -> 0644), the weights included
    checkpoints = sorted(run_dir.glob("checkpoints/step_*"))
    # keep_last=2, and the warm-up's last checkpoint (step 2) stays whatever keep_last
    assert [c.name for c in checkpoints] == ["step_000002", "step_000003", "step_000004"]
    for checkpoint in checkpoints:
        found = modes(checkpoint)
        assert "model/model.safetensors" in found
        assert found == {name: 0o644 for name in found}

    # and so does an export, also of a checkpoint written with 0600 weights (before this was fixed)
    (checkpoints[-1] / "model" / "model.safetensors").chmod(0o600)
    previous = os.umask(0o022)
    try:
        exported = export_checkpoint(checkpoints[-1], tmp_path / "export")
    finally:
        os.umask(previous)
    found = modes(exported)
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(found)
    assert found == {name: 0o644 for name in found}
    # the standard loader reads the exported tokenizer token for token (not Qwen2Tokenizer's byte-level rebuild)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(exported)("a b")["input_ids"] == tokenizer("a b")["input_ids"] == [25, 17, 26]
