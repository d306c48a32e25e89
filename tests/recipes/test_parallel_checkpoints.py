"""Checkpoints of runs whose layers or sequences are split over processes: a run killed after a checkpoint and
resumed at its own layout logs every number the uninterrupted run logs, bit for bit, and the same checkpoint
resumed at another layout (weights and Adam state whole by name, the optimizer's groups regrouped by
:mod:`rltk.strategies.regroup`, each data rank's RNG found by its data rank) goes on as the uninterrupted run did.

Slow (launched as the scale-out page says, with torchrun on gloo): each test is four or five runs of a tiny model
with a 40-step SFT warm-up (which earns the rewards that give the GRPO steps a gradient), three of them on two or
four processes: 75-135 s each at load 2-6 on the 2-core machine, ~3.5 min each at load 6-7.

Tolerances. A resumed run at another layout differs from the uninterrupted one in two GRPO steps only (the split
matmuls sum in another order): its numbers within 1e-4 relative, its Adam moments' norms within 1e-4 (measured:
5.6e-7 and 7.5e-7; a fresh optimizer would hold two steps of moments, not 44). Two whole runs of different layouts
differ over 44 Adam steps, which turn log-prob differences of 5e-7 into steps of the learning rate's size
(tests/recipes/test_tensor_parallel_recipe.py): 1e-2 relative as there (measured: 1.5e-4 for SP=2 x FSDP2 against
one process, 2.8e-3 for TP=2 x FSDP2=2 against two data-parallel processes).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.crash import CRASH_DRIVER
from tests.isolated import run_isolated

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SFT_STEPS, RL_STEPS, CRASH = 40, 4, 43  # checkpoints at 42 and 44; killed after step 43's metrics
ARGS = [
    "data.task_args.max_digits=1", "data.train_size=70", "data.eval_size=20", f"sft.steps={SFT_STEPS}",
    "sft.lr=3e-3", "sft.stop_at_accuracy=null", "sft.warmup_steps=2", f"trainer.total_steps={RL_STEPS}",
    "trainer.warmup_steps=1", "trainer.eval_every=2", "checkpoint.every=2", "logging.logger=[jsonl]",
    "logging.plot=false",
    f"stages=[{{name: warmup, type: sft, overrides: {{checkpoint.every: {SFT_STEPS}}}}}, {{name: rl, type: rl}}]",
]
ENV = {"RLTK_DISABLE_PLUGIN_AUTOLOAD": "1"}
TIMINGS = ("time", "per_s", "memory", "throughput")


def _launch(processes: int, program: list[str], *, expect: int = 0):
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
                if processes > 1 else [sys.executable])
    return run_isolated([*launcher, *program], expect=expect, extra_env=ENV, timeout=900)


def _run(processes: int, run_dir: Path, layout: list[str]):
    return _launch(processes, ["-m", "rltk.commands.cli", "run", "grpo", f"output_dir={run_dir}", *layout, *ARGS])


def _numbers(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not any(word in k for word in TIMINGS)} for row in rows]


def _adam_state(run_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    return torch.load(run_dir / "checkpoints" / f"step_{SFT_STEPS + RL_STEPS:06d}" / "optimizer.pt",
                      weights_only=True)["state"]


def _crash_and_resume(tmp_path: Path, processes: int, layout: list[str], other_processes: int,
                      other_layout: list[str]) -> tuple[Path, Path, Path]:
    """The uninterrupted run, the crashed one resumed at its layout, and a copy of the crashed one resumed at
    the other layout."""
    straight, crashing, elsewhere = tmp_path / "straight", tmp_path / "crashing", tmp_path / "elsewhere"
    _run(processes, straight, layout)
    driver = tmp_path / "crash_driver.py"
    driver.write_text(CRASH_DRIVER)
    _launch(processes, [str(driver), str(CRASH), "run", "grpo", f"output_dir={crashing}", *layout, *ARGS],
            expect=1 if processes > 1 else 3)
    assert sorted(p.name for p in (crashing / "checkpoints").glob("step_*"))[-1] == f"step_{CRASH - 1:06d}"
    shutil.copytree(crashing, elsewhere)
    out = _run(processes, crashing, layout)
    assert f"step_{CRASH - 1:06d}" in out.stdout
    _run(other_processes, elsewhere, other_layout)
    return straight, crashing, elsewhere


def _assert_resumed_exactly(resumed: Path, straight: Path) -> None:
    ours, theirs = _numbers(resumed), _numbers(straight)
    assert [r["step"] for r in ours] == [r["step"] for r in theirs]
    for a, b in zip(ours, theirs):
        assert a == b, (a["step"], {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)})
    after = [r for r in theirs if r["step"] >= CRASH and "kl" in r]
    assert len(after) == 2 and any(r["pg_loss"] != 0.0 for r in after)  # steps that moved the weights


def _assert_went_on_alike(resumed: Path, straight: Path) -> None:
    ours, theirs = _numbers(resumed), _numbers(straight)
    assert [r["step"] for r in ours] == [r["step"] for r in theirs]
    compared = 0
    for a, b in zip(ours, theirs):
        if a["step"] < CRASH:
            assert a == b  # the rows before the checkpoint, kept from the crashed run
            continue
        for key, value in b.items():
            if isinstance(value, float):
                assert a[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (a["step"], key)
                compared += 1
    assert compared > 20
    # the Adam moments went on from the checkpoint's: a fresh optimizer would hold two steps of moments, not 44
    ours_state, theirs_state = _adam_state(resumed), _adam_state(straight)
    assert ours_state.keys() == theirs_state.keys()
    for name, state in theirs_state.items():
        assert float(ours_state[name]["step"]) == float(state["step"]) == RL_STEPS
        for moment in ("exp_avg", "exp_avg_sq"):
            assert float(ours_state[name][moment].norm()) == pytest.approx(float(state[moment].norm()), rel=1e-4,
                                                                          abs=1e-9), name


def test_a_tensor_parallel_run_resumes_exactly_and_resumes_in_one_process(tmp_path):
    straight, crashing, elsewhere = _crash_and_resume(
        tmp_path, 2, ["strategy_args.tensor_parallel_size=2"], 1, [])
    _assert_resumed_exactly(crashing, straight)
    # the checkpoint's optimizer has one group per device mesh; one process has the decay/no-decay pair
    _assert_went_on_alike(elsewhere, straight)


def _assert_alike(ours: Path, theirs: Path, rel: float) -> None:
    """Every row of two runs of different layouts alike: the same rewards, the rest within ``rel``."""
    a_rows, b_rows = _numbers(ours), _numbers(theirs)
    assert [r["step"] for r in a_rows] == [r["step"] for r in b_rows]
    assert max(r["reward"] for r in b_rows if "kl" in r) > 0  # the GRPO steps have a gradient
    for a, b in zip(a_rows, b_rows):
        assert a.keys() == b.keys()
        for key, value in b.items():
            if isinstance(value, float):
                assert a[key] == pytest.approx(value, rel=rel, abs=1e-4), (a["step"], key)


def test_sequence_parallel_by_fsdp2_matches_one_process_and_resumes_exactly_and_in_one_process(tmp_path):
    # FSDP2 shards the parameters over the sequence group's two ranks (per-token log-probs and gradients:
    # tests/strategies/test_sequence_parallel.py)
    layout = ["strategy_args.sequence_parallel_size=2", "strategy_args.fsdp=true"]
    straight, crashing, elsewhere = _crash_and_resume(tmp_path, 2, layout, 1, [])
    _assert_resumed_exactly(crashing, straight)
    _assert_went_on_alike(elsewhere, straight)
    _run(1, tmp_path / "one", [])
    _assert_alike(straight, tmp_path / "one", rel=1e-2)


def test_tensor_parallel_by_fsdp2_on_four_ranks_matches_two_data_ranks_and_resumes_their_checkpoint(tmp_path):
    # TP=2 x FSDP2=2 on the 2-D mesh has the data layout of two data-parallel ranks (each its share of the rows,
    # its own sampling), so that run is the reference; its checkpoint, killed after step 43, resumes on the mesh
    data_parallel = ["strategy_args.fsdp=true"]
    mesh = ["strategy_args.tensor_parallel_size=2", "strategy_args.fsdp=true"]
    straight, crashing = tmp_path / "straight", tmp_path / "crashing"
    _run(2, straight, data_parallel)
    driver = tmp_path / "crash_driver.py"
    driver.write_text(CRASH_DRIVER)
    _launch(2, [str(driver), str(CRASH), "run", "grpo", f"output_dir={crashing}", *data_parallel, *ARGS], expect=1)
    out = _run(4, crashing, mesh)
    assert f"step_{CRASH - 1:06d}" in out.stdout
    _assert_went_on_alike(crashing, straight)
    _run(4, tmp_path / "mesh", mesh)
    _assert_alike(tmp_path / "mesh", straight, rel=1e-2)
