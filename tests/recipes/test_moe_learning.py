"""The shipped GRPO default on the tiny mixture-of-experts model learns, with and without routing replay
(slow; run in CI). The measured ranges are in docs/tutorials/moe.md (benchmarks/moe.py)."""

from __future__ import annotations

import sys

import pytest

from rltk.commands.cli import main
from tests.isolated import run_isolated
from tests.recipes.test_grpo_recipe import read_metrics, rl_evals
from tests.waits import scaled

pytestmark = pytest.mark.slow

MOE = ["model.tiny.moe.num_experts=8", "logging.logger=[jsonl]", "logging.plot=false"]

# benchmarks/moe.py over seeds 0-2 at this machine's best kernel level (AVX-512) and seed 0 under avx2 and
# default, each with routing_replay none and rollout: every run gained at least this much held-out greedy
# accuracy over its 200 RL steps (+0.160, default level; the median +0.215). The tests ask for half.
MIN_BENCHMARK_GAIN = 0.16


def assert_learned(run_dir):
    metrics = read_metrics(run_dir)
    evals = rl_evals(metrics)
    assert len(evals) == 9  # start of the RL stage, then every 25 steps
    assert evals[-1] > evals[0] + MIN_BENCHMARK_GAIN / 2, f"held-out accuracy did not rise: {evals}"
    return [m for m in metrics if "moe/topk_mismatch" in m]


def test_the_moe_default_learns_with_routing_replay(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", *MOE, "algorithm.routing_replay=rollout"]) == 0
    steps = assert_learned(run_dir)
    assert len(steps) == 200
    # the hf engine samples with the trainer's own module and kernels: the same experts on (nearly) every
    # token, and with replay the trainer's log-probs are the engine's to float rounding
    assert max(m["moe/topk_mismatch"] for m in steps) <= 0.01
    assert max(m["moe/logprob_gap_replay"] for m in steps) < 1e-4
    assert all(0 < m["moe/load_entropy"] <= 1 for m in steps)


def test_the_moe_default_learns_with_the_avx2_kernels(tmp_path):
    # another kernel level, another trajectory (the level is fixed when torch loads: a new process)
    run_dir = tmp_path / "run"
    run_isolated([sys.executable, "-m", "rltk.commands.cli", "run", "grpo", f"output_dir={run_dir}", *MOE],
                 timeout=scaled(1200), extra_env={"ATEN_CPU_CAPABILITY": "avx2"})
    assert_learned(run_dir)


def test_routing_travels_from_a_producer_process_through_the_queue(tmp_path):
    # one_step_off: a producer process samples with the weights one step behind and puts the experiences,
    # routing included, into the SQLite queue; the trainer replays it. A short run: this checks the path,
    # not learning.
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", *MOE, "algorithm.routing_replay=rollout",
                 "trainer.mode=one_step_off", "trainer.total_steps=4", "trainer.warmup_steps=0", "sft.steps=50",
                 "sft.stop_at_accuracy=null", "trainer.eval_every=100", "data.eval_size=20"]) == 0
    steps = [m for m in read_metrics(run_dir) if "moe/topk_mismatch" in m]
    assert len(steps) == 4 and [m["staleness/mean"] for m in steps] == [0.0, 1.0, 1.0, 1.0]
    # step 1 was sampled by the weights it trains: replayed or not, the engine's log-probs to rounding
    assert steps[0]["moe/topk_mismatch"] == 0.0 and steps[0]["moe/logprob_gap_replay"] < 1e-4
