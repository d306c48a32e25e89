"""The warm-up that ends on a target accuracy: where it stops, what it logs, and that a resumed
run continues after it instead of training the warm-up again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rltk.commands.cli import main
from tests.crash import crash_at_step

# sft.stop_at_accuracy=0 is reached at the first probe whatever the model, so the stop step is known.
RUN = ["sft.steps=40", "sft.stop_at_accuracy=0.0", "sft.probe_every=5", "sft.probe_size=8", "sft.warmup_steps=0",
       "trainer.total_steps=3", "trainer.warmup_steps=0", "data.train_size=40", "data.eval_size=8",
       "trainer.prompts_per_step=4", "rollout.n=2", "checkpoint.every=2", "trainer.eval_every=0",
       "logging.logger=[jsonl]", "logging.plot=false"]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # trains a tiny model for 8 steps (~10 s)
def test_warmup_stops_at_the_first_probe_that_reaches_the_target(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", *RUN]) == 0
    metrics = read_metrics(run_dir)
    sft_steps = [m["step"] for m in metrics if "sft/sft_loss" in m]
    assert sft_steps == [1, 2, 3, 4, 5]
    probes = [m for m in metrics if "sft/train_accuracy" in m]
    assert [m["step"] for m in probes] == [5] and 0.0 <= probes[0]["sft/train_accuracy"] <= 1.0
    # The RL stage keeps the global step numbers of a warm-up that ran to its cap (40).
    assert [m["step"] for m in metrics if "reward" in m] == [41, 42, 43]
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    # keep_last=2 keeps the two newest, and the warm-up's last checkpoint (step_000005, saved on stopping)
    # stays too: a stage's end outlives keep_last, so a later run can start from it (checkpoint.start_from)
    assert checkpoints == ["step_000005", "step_000042", "step_000043"]


@pytest.mark.slow
def test_a_run_resumed_after_an_early_stop_skips_the_warmup(tmp_path):
    run_dir = tmp_path / "run"
    with crash_at_step(41):  # the first RL step, after the warm-up's stopping checkpoint at step 5
        main(["run", "grpo", f"output_dir={run_dir}", *RUN])
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*")] == ["step_000004", "step_000005"]

    assert main(["run", "grpo", f"output_dir={run_dir}", *RUN]) == 0
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics if "sft/sft_loss" in m] == [1, 2, 3, 4, 5]  # not trained again
    assert [m["step"] for m in metrics if "reward" in m] == [41, 42, 43]


@pytest.mark.slow
def test_a_sampled_probe_stops_the_warmup_and_leaves_the_training_draws_alone(tmp_path):
    """sft.probe=sampled samples its answers under trainer.eval_seed inside a forked random stream, so the
    warm-up's losses are those of a run whose probe is greedy: only the probe's numbers differ."""
    runs = {}
    for kind in ("greedy", "sampled"):
        run_dir = tmp_path / kind
        assert main(["run", "grpo", f"output_dir={run_dir}", *RUN, f"sft.probe={kind}", "trainer.total_steps=1",
                     "rollout.temperature=1.0", "trainer.eval_seed=0"]) == 0
        runs[kind] = read_metrics(run_dir)
    for metrics in runs.values():
        assert [m["step"] for m in metrics if "sft/train_accuracy" in m] == [5]
    losses = {kind: [m["sft/sft_loss"] for m in metrics if "sft/sft_loss" in m] for kind, metrics in runs.items()}
    assert losses["greedy"] == losses["sampled"]


def test_an_unknown_probe_kind_is_refused_with_the_choices(capsys):
    assert main(["validate", "grpo", "sft.probe=beam"]) == 2
    err = capsys.readouterr().err
    assert "sft.probe" in err and "greedy" in err and "sampled" in err
