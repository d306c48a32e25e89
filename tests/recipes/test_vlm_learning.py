"""The shipped VLM config (recipes/configs/vlm.yaml) learns its visual task on every CPU kernel level (slow; CI).

The tiny Qwen2.5-VL default names the colour of a shape drawn in code (``shape_colour``). Every prompt is the
same text and the colours are equally frequent, so a policy that does not look at the picture scores at most
the text-only chance level, 1/3. Each run's greedy policy must be well above it after the warm-up and at the
end (the picture reaches the model and is read), and the sampling policy, which GRPO trains, must gain held-out
accuracy over the GRPO stage and end above chance too. The measured ranges are in
docs/tutorials/own-model-and-data.md (benchmarks/vlm.py); each run here is one seed at one ``ATEN_CPU_CAPABILITY`` level.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rltk.commands.cli import main
from tests.isolated import run_isolated
from tests.recipes.test_grpo_recipe import read_metrics, rl_evals
from tests.waits import scaled

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "vlm.yaml"
TEXT_ONLY_CHANCE = 1 / 3
# benchmarks/vlm.py over seeds 0-2 at the levels default, avx2 and avx512: the smallest held-out sampled-accuracy
# gain of any run over its 40 GRPO steps (accuracy at the end minus after the warm-up). The test asks for half.
MIN_BENCHMARK_GAIN = 0.133  # seed 0 at the default level: sampled 0.580 -> 0.713 (the median +0.207)
RL_STEPS = 40
ARGS = ["logging.logger=[jsonl]", "logging.plot=false", "checkpoint.resume=never"]


def assert_learned(run_dir: Path) -> None:
    metrics = read_metrics(run_dir)
    greedy = rl_evals(metrics)
    sampled = [m["eval/sampled_accuracy"] for m in metrics if "eval/sampled_accuracy" in m]
    assert len(greedy) == 1 + RL_STEPS // 20, greedy  # when GRPO starts, then every 20 steps
    assert min(greedy[0], greedy[-1]) > TEXT_ONLY_CHANCE + 0.2, f"the picture is not read: greedy {greedy}"
    assert sampled[-1] > sampled[0] + MIN_BENCHMARK_GAIN / 2, f"sampled accuracy did not rise over GRPO: {sampled}"
    assert sampled[-1] > TEXT_ONLY_CHANCE, sampled


def test_the_vlm_default_learns_at_this_machines_kernel_level(tmp_path):
    assert main(["run", "grpo", "--config", str(CONFIG), f"output_dir={tmp_path}", *ARGS]) == 0
    assert_learned(tmp_path)


@pytest.mark.parametrize("level, seed", [("avx2", 1), ("default", 2)])
def test_the_vlm_default_learns_at_another_kernel_level(tmp_path, level, seed):
    # the level is fixed when torch loads: a new process
    if level == torch.backends.cpu.get_cpu_capability().lower():
        pytest.skip(f"{level} is this machine's own level, run in-process above")
    run_isolated([sys.executable, "-m", "rltk.commands.cli", "run", "grpo", "--config", str(CONFIG),
                  f"seed={seed}", f"output_dir={tmp_path}", *ARGS],
                 timeout=scaled(600), extra_env={"ATEN_CPU_CAPABILITY": level})
    assert_learned(tmp_path)
