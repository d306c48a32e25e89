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


def numbers(run_dir: Path) -> list[dict]:
    """Every logged row without the wall-clock timings no two runs repeat."""
    return [{k: v for k, v in row.items() if not (k.startswith("time/") or k.endswith("_per_s"))}
            for row in read_metrics(run_dir)]


@pytest.mark.slow  # trains a tiny model for 8 steps (~10 s)
def test_warmup_stops_at_the_first_probe_and_the_rl_steps_follow_it(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", *RUN]) == 0
    metrics = read_metrics(run_dir)
    sft_steps = [m["step"] for m in metrics if "sft/sft_loss" in m]
    assert sft_steps == [1, 2, 3, 4, 5]
    probes = [m for m in metrics if "sft/train_accuracy" in m]
    assert [m["step"] for m in probes] == [5] and 0.0 <= probes[0]["sft/train_accuracy"] <= 1.0
    # The RL stage numbers its steps on from the warm-up's last (5), not from its cap (40): no gap of 35
    # empty steps on a logger's x-axis. Its opening evaluation is logged at step 5, the boundary.
    assert [m["step"] for m in metrics if "reward" in m] == [6, 7, 8]
    assert sorted({m["step"] for m in metrics}) == list(range(1, 9))
    assert [m["step"] for m in metrics if "eval/accuracy" in m and "reward" not in m] == [5]
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    # keep_last=2 keeps the two newest (RL stage steps 2 and 3), and the warm-up's last checkpoint (step_000005,
    # saved on stopping) stays too: a stage's end outlives keep_last, so a later run can start from it
    assert checkpoints == ["step_000005", "step_000007", "step_000008"]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 8


@pytest.mark.slow
def test_a_run_resumed_after_an_early_stop_skips_the_warmup(tmp_path):
    run_dir = tmp_path / "run"
    with crash_at_step(6):  # the first RL step, after the warm-up's stopping checkpoint at step 5
        main(["run", "grpo", f"output_dir={run_dir}", *RUN])
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*")] == ["step_000004", "step_000005"]

    assert main(["run", "grpo", f"output_dir={run_dir}", *RUN]) == 0
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics if "sft/sft_loss" in m] == [1, 2, 3, 4, 5]  # not trained again
    assert [m["step"] for m in metrics if "reward" in m] == [6, 7, 8]
    assert sorted({m["step"] for m in metrics}) == list(range(1, 9))


@pytest.mark.slow  # three tiny runs (~30 s)
def test_a_run_resumed_in_the_rl_stage_after_an_early_stop_logs_what_the_whole_run_logs(tmp_path):
    whole = tmp_path / "whole"
    assert main(["run", "grpo", f"output_dir={whole}", *RUN, "checkpoint.keep_last=5"]) == 0
    resumed = tmp_path / "resumed"
    with crash_at_step(8):  # RL stage step 3, after its checkpoint at stage step 2 (global 7)
        main(["run", "grpo", f"output_dir={resumed}", *RUN, "checkpoint.keep_last=5"])
    assert sorted(p.name for p in (resumed / "checkpoints").glob("step_*")) == [
        "step_000002", "step_000004", "step_000005", "step_000007"]
    assert main(["run", "grpo", f"output_dir={resumed}", *RUN, "checkpoint.keep_last=5"]) == 0
    # the resumed stage found its checkpoint at global step 7 and went on at 8, every number as the whole run's
    assert numbers(resumed) == numbers(whole)
    assert [m["step"] for m in read_metrics(resumed) if "reward" in m] == [6, 7, 8]
    assert sorted(p.name for p in (resumed / "checkpoints").glob("step_*")) == [
        "step_000002", "step_000004", "step_000005", "step_000007", "step_000008"]


@pytest.mark.slow  # two tiny runs (~20 s)
def test_a_run_started_from_an_early_stopped_warm_up_keeps_the_rl_step_numbers(tmp_path):
    first = tmp_path / "first"
    assert main(["run", "grpo", f"output_dir={first}", *RUN]) == 0
    second = tmp_path / "second"
    assert main(["run", "grpo", f"output_dir={second}", *RUN,
                 f"checkpoint.start_from={first / 'checkpoints' / 'step_000005'}"]) == 0
    metrics = read_metrics(second)
    assert not any("sft/sft_loss" in m for m in metrics)
    assert [m["step"] for m in metrics if "reward" in m] == [6, 7, 8]  # as in the run whose warm-up it took


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


def test_stage_ends_come_from_the_checkpoint_or_for_an_older_one_from_the_stage_lengths():
    from rltk.training.scaffold.resume import STAGE_ENDS_KEY, stage_ends

    lengths = [6000, 200, 50]  # a capped warm-up, then two RL stages
    assert stage_ends(None, lengths) == []
    # this rltk's checkpoints: the warm-up stopped at 1100, the next stage numbered from there
    mid = {"stage": 1, "stage_done": False, "global_step": 1150, "stage_step": 50, STAGE_ENDS_KEY: [1100]}
    assert stage_ends(mid, lengths) == [1100]
    done = {"stage": 1, "stage_done": True, "global_step": 1300, "stage_step": 200, STAGE_ENDS_KEY: [1100, 1300]}
    assert stage_ends(done, lengths) == [1100, 1300]
    # an older rltk's: each finished stage had its whole length reserved (RL steps 6001..), and a stage that
    # ends at the checkpoint ends at its step
    assert stage_ends({"stage": 1, "stage_done": False, "global_step": 6050, "stage_step": 50}, lengths) == [6000]
    assert stage_ends({"stage": 0, "stage_done": True, "global_step": 1100, "stage_step": 1100}, lengths) == [1100]
    assert stage_ends({"stage": 1, "stage_done": True, "global_step": 6200, "stage_step": 200}, lengths) == [
        6000, 6200]


def test_a_stage_that_ends_before_its_cap_moves_the_later_spans_up():
    from rltk.loggers.base import StageSpan, stage_ended, stage_spans

    spans = stage_spans([("warmup", "sft", 6000, True), ("grpo", "rl", 200), ("ppo", "rl", 50)])
    assert stage_ended(spans, 0, 1100) == [StageSpan("warmup", "sft", 0, 1100), StageSpan("grpo", "rl", 1100, 200),
                                           StageSpan("ppo", "rl", 1300, 50)]
    assert stage_ended(spans, 0, 6000) == [StageSpan("warmup", "sft", 0, 6000), *spans[1:]]  # ran to its cap
