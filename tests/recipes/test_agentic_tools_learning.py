"""The shipped tool-using agent config (recipes/configs/agentic_tools.yaml) learns: its warm-up and its
first 20 GRPO steps (slow; run in CI).

The builtin `arithmetic_tools` agent asks each three-digit sum through the `openai` client with the
`calculator` tool offered; the warm-up teaches the call, the tool's result and the answer from the
task's demonstrations (rendered with env.tools, as every request is), then GRPO. The learning rate is
constant after 5 warm-up steps and evaluations are seeded (trainer.eval_seed), so 20 steps are the run
the benchmark's evaluation at RL step 20 measured (`benchmarks/learning.py --recipes agentic_tools
--at-step 20`).
"""

import json
from pathlib import Path

import pytest

from rltk.cli import main
from tests.serve.helpers import ensure_serve_builtins

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RL_STEPS = 20
# What `benchmarks/learning.py --recipes agentic_tools --seeds 0 1 2 --levels default --at-step 20`
# measured (README, "Learning, measured"): after 20 GRPO steps every run's held-out sampled accuracy
# had gained at least MIN_BENCHMARK_SAMPLED_GAIN (+0.07 / +0.11 / +0.22). The test asks for half of it. Its
# own run (2 threads, AVX-512; 1.9 min on a quiet 2-core machine, 4.5 min loaded) went 0.26 -> 0.35 sampled,
# 0.73 -> 0.94 greedy.
MIN_BENCHMARK_SAMPLED_GAIN = 0.07


def test_grpo_through_the_openai_endpoint_raises_the_tool_agents_sampled_accuracy(tmp_path):
    ensure_serve_builtins()
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", "--config", str(REPO / "recipes" / "configs" / "agentic_tools.yaml"),
                 f"output_dir={run_dir}", f"trainer.total_steps={RL_STEPS}", "logging.logger=[jsonl]",
                 "logging.plot=false", "checkpoint.every=0"]) == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    probes = [m for m in metrics if "sft/train_accuracy" in m]
    assert probes[-1]["sft/train_accuracy"] >= 0.4, probes[-1]
    assert probes[-1]["sft/probe_truncated_fraction"] == 0, probes[-1]
    steps = [m for m in metrics if "reward" in m]
    assert len(steps) == RL_STEPS
    for step in steps:  # the agent's tools reached the warm-up's prompt, and it calls them
        assert step["agentic/opening_mismatch"] == 0 and step["rollout/tool_call_fraction"] > 0.3
    evals = [m for m in metrics if "eval/sampled_accuracy" in m]
    assert evals[0]["eval/accuracy"] >= 0.3  # the warm-up's skill carries over to held-out sums
    gain = evals[-1]["eval/sampled_accuracy"] - evals[0]["eval/sampled_accuracy"]
    assert gain > MIN_BENCHMARK_SAMPLED_GAIN / 2, [m["eval/sampled_accuracy"] for m in evals]
