"""A run folder is resumed only by a compatible config; `never` starts over and says so (issue 10)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rltk.checkpoint import CheckpointManager
from rltk.config import load_config
from rltk.errors import ConfigError
from rltk.training.scaffold.resume import config_differences, resume_or_start_over
from rltk.training.scaffold.run_outputs import prepare_run_dir

from tests.waits import scaled

REPO = Path(__file__).resolve().parents[2]
GRPO_YAML = REPO / "recipes" / "configs" / "grpo.yaml"


def finished_run(run_dir: Path, *overrides: str):
    """A run folder as a finished default GRPO run leaves it (config, metrics, summary, last checkpoint)."""
    cfg = load_config([GRPO_YAML], [f"output_dir={run_dir}", *overrides], warn=False)
    prepare_run_dir(cfg)
    steps = cfg.sft.steps + cfg.trainer.total_steps
    CheckpointManager(run_dir / "checkpoints").save(steps, None, {
        "stage": 1, "stage_step": cfg.trainer.total_steps, "stage_done": True})
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": steps, "reward": 0.5}) + "\n")
    (run_dir / "summary.json").write_text("{}\n")
    return cfg


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_differences_skip_safe_keys_and_fill_missing_keys_from_the_schema():
    saved = {"name": "a", "trainer": {"lr": 1e-4, "total_steps": 200, "eval_every": 25},
             "logging": {"logger": ["console"]}, "algorithm": {"name": "grpo"}}
    new = {"name": "b", "trainer": {"lr": 3e-4, "total_steps": 400, "eval_every": 5, "micro_batch_size": 8},
           "logging": {"logger": ["jsonl"]}, "algorithm": {"name": "rloo", "kl_coef": 0.0},
           "stages": [{"name": "warmup", "type": "sft"}, {"name": "rl", "type": "rl"}]}
    # A key the saved config lacks counts as its schema default: kl_coef 0.0 agrees, the schema's one
    # `rl` stage does not; stages are compared entry by entry.
    assert config_differences(saved, new) == [
        ("algorithm.name", "grpo", "rloo"),
        ("stages.length", 1, 2),
        ("stages[0].name", "rl", "warmup"),
        ("stages[0].type", "rl", "sft"),
        ("stages[1].name", "(unset)", "rl"),
        ("stages[1].type", "(unset)", "rl"),
        ("trainer.lr", 1e-4, 3e-4),
    ]


def test_an_incompatible_config_is_refused_before_anything_is_written(tmp_path):
    run_dir = tmp_path / "run"
    finished_run(run_dir)
    before = snapshot(run_dir)
    cfg = load_config([GRPO_YAML], [f"output_dir={run_dir}", "algorithm.name=rloo", "trainer.lr=3e-4"], warn=False)
    with pytest.raises(ConfigError) as info:
        resume_or_start_over(cfg, CheckpointManager(run_dir / "checkpoints"))
    msg = str(info.value)
    assert f"the run folder {run_dir} holds a run with a different config" in msg
    assert "algorithm.name: 'grpo' -> 'rloo'" in msg and "trainer.lr: 0.0001 -> 0.0003" in msg
    assert "name=<new name>" in msg and "checkpoint.resume=never" in msg
    assert snapshot(run_dir) == before


def test_safe_keys_may_change_on_resume(tmp_path):
    run_dir = tmp_path / "run"
    finished_run(run_dir)
    cfg = load_config([GRPO_YAML], [f"output_dir={run_dir}", "trainer.total_steps=300", "trainer.eval_every=5",
                                    "checkpoint.keep_last=5", "logging.logger=[jsonl]", "trainer.micro_batch_size=8",
                                    "buffer.queue_resume=fresh"],
                      warn=False)
    resume = resume_or_start_over(cfg, CheckpointManager(run_dir / "checkpoints"))
    assert resume is not None and resume["stage_done"] and resume["stage"] == 1


def test_never_starts_over_and_says_what_it_removed(tmp_path, capsys):
    run_dir = tmp_path / "run"
    finished_run(run_dir)
    (run_dir / "notes.txt").write_text("mine")
    cfg = load_config([GRPO_YAML], [f"output_dir={run_dir}", "algorithm.name=rloo", "checkpoint.resume=never"],
                      warn=False)
    assert resume_or_start_over(cfg, CheckpointManager(run_dir / "checkpoints")) is None
    out = capsys.readouterr().out
    assert f"checkpoint.resume=never: starting over in {run_dir}" in out
    assert "checkpoints, metrics.jsonl, summary.json" in out
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "notes.txt"]  # files not rltk's stay
    # A run that crashed before its first checkpoint has nothing to resume: its metrics would be
    # appended to, so they go too.
    (run_dir / "metrics.jsonl").write_text("{}\n")
    same = load_config([GRPO_YAML], [f"output_dir={run_dir}"], warn=False)
    assert resume_or_start_over(same, CheckpointManager(run_dir / "checkpoints")) is None
    assert not (run_dir / "metrics.jsonl").exists()
    # One that finished without checkpoints (checkpoint.every=0) keeps its results.
    (run_dir / "summary.json").write_text("{}\n")
    with pytest.raises(ConfigError, match="finished run that kept no checkpoint.*checkpoint.resume=never"):
        resume_or_start_over(same, CheckpointManager(run_dir / "checkpoints"))
    assert (run_dir / "summary.json").exists()


def test_a_folder_that_holds_no_run_is_left_alone(tmp_path):
    (tmp_path / "summary.json").write_text("the user's own")
    cfg = load_config([GRPO_YAML], [f"output_dir={tmp_path}", "checkpoint.resume=never"], warn=False)
    assert resume_or_start_over(cfg, CheckpointManager(tmp_path / "checkpoints")) is None
    assert (tmp_path / "summary.json").read_text() == "the user's own"


def test_an_explicit_checkpoint_is_checked_against_the_run_that_wrote_it(tmp_path):
    finished_run(tmp_path / "a")
    checkpoint = CheckpointManager(tmp_path / "a" / "checkpoints").latest()
    cfg = load_config([GRPO_YAML], [f"output_dir={tmp_path / 'b'}", f"checkpoint.resume={checkpoint}",
                                    "model.tiny.hidden_size=32"], warn=False)
    with pytest.raises(ConfigError, match=r"checkpoint.resume=.* holds a run with a different config.*"
                                          r"model.tiny.hidden_size: 64 -> 32"):
        resume_or_start_over(cfg, CheckpointManager(tmp_path / "b" / "checkpoints"))


def test_rltk_run_with_another_config_in_a_finished_run_folder_exits_2(tmp_path):
    run_dir = tmp_path / "run"
    finished_run(run_dir)
    before = snapshot(run_dir)
    out = subprocess.run([sys.executable, "-m", "rltk.commands.cli", "run", "grpo", f"output_dir={run_dir}",
                          "algorithm.name=rloo"], capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 2, out.stderr
    lines = [l for l in out.stderr.splitlines() if l.startswith("rltk: error:")]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "algorithm.name: 'grpo' -> 'rloo'" in lines[0] and "algorithm.advantage_fn: 'grpo' -> 'rloo'" in lines[0]
    assert "name=<new name>" in lines[0] and "checkpoint.resume=never" in lines[0]
    assert snapshot(run_dir) == before  # config.yaml, checkpoints and results untouched


TINY = ["data.train_size=40", "data.eval_size=8", "sft.steps=2", "sft.warmup_steps=0", "trainer.total_steps=2",
        "trainer.warmup_steps=0", "trainer.prompts_per_step=2", "rollout.n=2", "trainer.eval_every=0",
        "logging.logger=[jsonl]", "logging.plot=false", "model.tiny.hidden_size=16", "model.tiny.num_layers=1",
        "model.tiny.intermediate_size=32"]


def test_running_a_finished_run_again_reports_it_and_rewrites_nothing(tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "rltk.commands.cli", "run", "grpo", f"output_dir={run_dir}", *TINY]
    first = subprocess.run(command, capture_output=True, text=True, timeout=scaled(300))
    assert first.returncode == 0, first.stderr
    before = snapshot(run_dir)
    again = subprocess.run([*command, "trainer.eval_size=4"], capture_output=True, text=True, timeout=scaled(300))
    assert again.returncode == 0, again.stderr
    assert f"rltk: {run_dir} already finished" in again.stdout and "final held-out" in again.stdout
    assert snapshot(run_dir) == before


def test_the_split_over_processes_may_change_on_resume_but_not_the_engine():
    # the accelerate strategy's checkpoints resume at any layout (tests/recipes/test_parallel_checkpoints.py)
    saved = {"strategy": "accelerate", "strategy_args": {"tensor_parallel_size": 2, "fsdp": True}}
    new = {"strategy": "accelerate", "strategy_args": {"sequence_parallel_size": 2}}
    assert config_differences(saved, new) == []
    assert config_differences(saved, {"strategy": "deepspeed", "strategy_args": {"zero_stage": 3}}) == [
        ("strategy", "accelerate", "deepspeed"), ("strategy_args.zero_stage", "(unset)", 3)]
