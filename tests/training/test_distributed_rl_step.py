"""The recipes' RL step under two processes (torchrun, gloo) must equal one process holding every rollout.

The split is uneven (three groups on rank 0, one on rank 1, with narrower
responses and fewer micro-batches) and the estimators whiten over the batch,
so advantages taken per rank, metrics that are one rank's share, or ranks
running different numbers of forwards (a hang under ZeRO-3 and FSDP2) all fail
here, for DDP, FSDP2 and ZeRO-3. The same holds with token-budget micro-batches
and packed rows (``+budget``, ``+pack`` phases) against the one padded process:
the global normalisers make the plan irrelevant to the gradient. See rl_step_worker.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.isolated import load_worker
from tests.waits import scaled

WORKER_PATH = Path(__file__).with_name("rl_step_worker.py")
PHASES = ["ddp", "fsdp", "zero3", "ddp+budget", "fsdp+budget+pack", "zero3+budget+pack"]


worker = load_worker(WORKER_PATH, "rltk_tests_rl_step_worker")


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("rl_step")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLTK_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "rltk" / "torch_extensions"))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(WORKER_PATH), str(out_dir), *PHASES]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=scaled(300))
    if proc.returncode != 0:
        pytest.fail(f"torchrun worker failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return {path.stem: torch.load(path, weights_only=True) for path in out_dir.glob("*.pt")}


@pytest.fixture(scope="module")
def one_process_reference():
    from rltk.strategies.accelerate_strategy import AccelerateStrategy

    strategy = AccelerateStrategy(cpu=True)
    strategy.setup(worker.shared.tiny_qwen2(seed=0), **worker.SETUP)
    return worker.run_steps(strategy)


def _global_rows(rank0: torch.Tensor, rank1: torch.Tensor, width: int) -> torch.Tensor:
    """Rank 0's rows then rank 1's, right-padded to ``width``: the one-process row order."""
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))  # noqa: E731
    return torch.cat([pad(rank0), pad(rank1)])


@pytest.mark.distributed
@pytest.mark.parametrize("phase", PHASES)
def test_advantages_are_those_of_the_global_batch(two_process_results, one_process_reference, phase):
    rank0, rank1 = two_process_results[f"{phase}_rank0"], two_process_results[f"{phase}_rank1"]
    for step, expected in enumerate(one_process_reference["advantages"]):
        got = _global_rows(rank0["advantages"][step], rank1["advantages"][step], expected.shape[1])
        assert rank1["advantages"][step].shape[1] < expected.shape[1], "rank 1 should hold the narrower batch"
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5,
                                   msg=f"step {step} ({worker.ESTIMATORS[step]})")


@pytest.mark.distributed
@pytest.mark.parametrize("phase", PHASES)
def test_update_metrics_and_weights_match_one_process(two_process_results, one_process_reference, phase):
    rank0, rank1 = two_process_results[f"{phase}_rank0"], two_process_results[f"{phase}_rank1"]
    reference = one_process_reference
    for step, expected in enumerate(reference["metrics"]):
        assert rank0["metrics"][step] == rank1["metrics"][step], "ranks must log the same (global) numbers"
        assert rank0["metrics"][step].keys() == expected.keys()
        for key, value in expected.items():
            assert rank0["metrics"][step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)
    for name, value in reference["weights"].items():
        torch.testing.assert_close(rank0["weights"][name], value, atol=1e-6, rtol=0, msg=name)
        torch.testing.assert_close(rank1["weights"][name], rank0["weights"][name], atol=0, rtol=0, msg=name)
