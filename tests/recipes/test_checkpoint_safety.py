"""Issue 12, items 1 and 5, end to end: `rltk run` refuses a planted checkpoint and skips a damaged one."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from rltk.commands.cli import main
from tests.isolated import run_isolated
from tests.test_serialization import plant
from tests.waits import scaled

pytestmark = pytest.mark.slow

# Two SFT and two RL steps of a tiny model, a checkpoint after each: step_000003 and step_000004 are kept, and
# step_000002, the warm-up's last, whatever keep_last.
TINY = ["data.train_size=40", "data.eval_size=8", "sft.steps=2", "sft.warmup_steps=0", "trainer.total_steps=2",
        "trainer.warmup_steps=0", "trainer.prompts_per_step=2", "rollout.n=2", "trainer.eval_every=0",
        "logging.logger=[jsonl]", "logging.plot=false", "model.tiny.hidden_size=16", "model.tiny.num_layers=1",
        "model.tiny.intermediate_size=32", "checkpoint.every=1", "checkpoint.keep_last=2"]


def step_folders(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_a_damaged_final_checkpoint_is_skipped_extras_are_pruned_and_a_planted_one_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", *TINY]) == 0
    assert step_folders(run_dir) == ["step_000002", "step_000003", "step_000004"]

    # A cut-off copy damaged the last checkpoint: the run resumes from the one before and trains step 4 again.
    weights = run_dir / "checkpoints" / "step_000004" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    capsys.readouterr()
    with pytest.warns(UserWarning, match=r"step_000004' is damaged: model/model.safetensors \(it is not a complete "
                                         r"safetensors file.*Resuming from the newest intact checkpoint, "
                                         r"'.*step_000003'"):
        assert main(["run", "grpo", f"output_dir={run_dir}", *TINY]) == 0
    assert f"rltk: resuming from {run_dir / 'checkpoints' / 'step_000003'} (stage 1, step 1)" in capsys.readouterr().out
    # Step 4 was saved whole again; the damaged copy waits beside it for a look.
    assert step_folders(run_dir) == ["damaged-step_000004", "step_000002", "step_000003", "step_000004"]

    # Runs killed between a save and its prune left checkpoints beyond keep_last: pruned as the run starts.
    for extra in ("step_000001",):
        shutil.copytree(run_dir / "checkpoints" / "step_000003", run_dir / "checkpoints" / extra)
    assert main(["run", "grpo", f"output_dir={run_dir}", *TINY]) == 0
    out = capsys.readouterr().out
    assert "rltk: removed step_000001 from" in out and "already finished" in out
    assert step_folders(run_dir) == ["damaged-step_000004", "step_000002", "step_000003", "step_000004"]

    marker = tmp_path / "MARKER"
    plant(run_dir / "checkpoints" / "step_000004" / "optimizer.pt", marker)
    assert main(["run", "grpo", f"output_dir={run_dir}", *TINY]) == 1
    err = capsys.readouterr().err
    assert f"rltk: error: refusing to load '{run_dir / 'checkpoints' / 'step_000004' / 'optimizer.pt'}'" in err
    assert not marker.exists()


def test_the_reported_deepspeed_case_a_planted_model_states_file_is_refused_on_resume(tmp_path):
    """The report: a pickle in checkpoints/step_N/deepspeed/state/mp_rank_00_model_states.pt ran a shell
    command when the same `rltk run` started again with checkpoint.resume=auto."""
    run_dir = tmp_path / "ds"
    command = [sys.executable, "-m", "rltk.commands.cli", "run", "grpo", f"output_dir={run_dir}", "strategy=deepspeed",
               "strategy_args.zero_stage=2", *TINY]
    run_isolated(command, timeout=scaled(900))
    shard = run_dir / "checkpoints" / "step_000004" / "deepspeed" / "state" / "mp_rank_00_model_states.pt"
    marker = tmp_path / "MARKER"
    plant(shard, marker)
    # The same run again, and a longer one that would load DeepSpeed's states to train on.
    for again in (command, [*command, "trainer.total_steps=3"]):
        out = run_isolated(again, expect=1, timeout=scaled(900))
        assert f"rltk: error: refusing to load '{shard}': it asks the unpickler for posix.system" in out.stderr
    assert not marker.exists()
