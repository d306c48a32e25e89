"""Recovering after a warm-up: each stage's last checkpoint outlives keep_last, and a new run can start
its RL stage from another run's finished warm-up (checkpoint.start_from; issue 29, item 5)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rltk.checkpoint import CheckpointManager
from rltk.commands.cli import main
from rltk.training.scaffold.resume import is_stage_end

TINY = ["sft.steps=2", "sft.warmup_steps=0", "sft.stop_at_accuracy=null", "trainer.total_steps=2",
        "trainer.warmup_steps=0", "data.train_size=40", "data.eval_size=8", "trainer.prompts_per_step=4",
        "rollout.n=2", "logging.logger=[jsonl]", "logging.plot=false", "checkpoint.every=1",
        "checkpoint.keep_last=1"]


def test_keep_last_spares_the_checkpoints_that_end_a_stage(tmp_path):
    ckpt = CheckpointManager(tmp_path, keep_last=1, keep=is_stage_end)
    for step, done in [(1, False), (2, True), (3, False), (4, False), (5, True), (6, False)]:
        ckpt.save(step, None, {"stage_done": done})
    # the two stage ends stay and do not count towards keep_last; of the others only the newest is left
    assert [step for step, _ in ckpt.checkpoints()] == [2, 5, 6]
    plain = CheckpointManager(tmp_path / "plain", keep_last=1)
    for step in (1, 2):
        plain.save(step, None, {"stage_done": True})
    assert [step for step, _ in plain.checkpoints()] == [2]


@pytest.mark.slow  # two tiny runs of 2 warm-up + 2 GRPO steps, and a refused one (~30 s)
def test_a_run_starts_its_rl_stage_from_another_runs_finished_warm_up(tmp_path, capsys):
    first = tmp_path / "first"
    assert main(["run", "grpo", f"output_dir={first}", *TINY]) == 0
    # keep_last=1, yet the warm-up's last checkpoint (global step 2) is still there
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    warm = first / "checkpoints" / "step_000002"

    second = tmp_path / "second"
    assert main(["run", "grpo", f"output_dir={second}", *TINY, f"checkpoint.start_from={warm}",
                 "trainer.lr=2e-6"]) == 0
    assert "starting after stage 0 ('warmup') from the weights of" in capsys.readouterr().out
    rows = [json.loads(line) for line in (second / "metrics.jsonl").read_text().splitlines()]
    assert not any("sft/sft_loss" in r for r in rows)  # the warm-up was not trained again
    assert sorted({r["step"] for r in rows if "pg_loss" in r}) == [3, 4]  # RL keeps its step numbers
    # the RL stage started from the first run's warm-up weights: its frozen reference is exactly them
    reference = load_file(str(second / "stage_weights" / "stage_1_reference.safetensors"))
    warm_weights = load_file(str(warm / "model" / "model.safetensors"))
    assert reference.keys() == warm_weights.keys()
    assert all(torch.equal(reference[k], warm_weights[k]) for k in reference)

    # a checkpoint from the middle of a stage is refused, naming the way out
    middle = tmp_path / "middle"
    assert main(["run", "grpo", f"output_dir={middle}", *TINY, "checkpoint.keep_last=5"]) == 0
    code = main(["run", "grpo", f"output_dir={tmp_path / 'third'}", *TINY,
                 f"checkpoint.start_from={middle / 'checkpoints' / 'step_000001'}"])
    assert code == 2 and "saved in the middle of its run's stage 0 (step 1)" in capsys.readouterr().err
