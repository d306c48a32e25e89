"""The shipped tool-using agent config (recipes/configs/agentic_tools.yaml) learns: its warm-up and its
60 GRPO steps, run unchanged (slow; run in CI).

The builtin `arithmetic_tools` agent asks each three-digit sum through the `openai` client with the
`calculator` tool offered; the warm-up teaches the call, the tool's result and the answer from the
task's demonstrations (rendered with env.tools, as every request is), then GRPO.
"""

import json
from pathlib import Path

import pytest

from rltk.commands.cli import main
from tests.serve.helpers import ensure_serve_builtins

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RL_STEPS = 60
# What `benchmarks/learning.py --recipes agentic_tools --seeds 0 1 2` measured (docs/measurements.md),
# with the warm-up stopping on a sampled probe at 0.3: the test's own run is seed 0, one thread, at the
# machine's kernel level, and seed 0's runs at the `default`, `avx2` and `avx512` levels raised the training
# reward (the mean of the last 15 RL steps against the first 15, 960 episodes each) by +0.080, +0.030 and
# +0.024. The test asks for half the smallest. Over seeds all 9 runs rose, by +0.024 to +0.180. Held-out
# sampled accuracy moved by -0.027 to +0.293 (seed 0 at avx512 the one fall, within the noise of 300 sums),
# so it is not asserted.
MIN_BENCHMARK_REWARD_RISE = 0.024


def test_grpo_through_the_openai_endpoint_raises_the_tool_agents_reward(tmp_path):
    ensure_serve_builtins()
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", "--config", str(REPO / "recipes" / "configs" / "agentic_tools.yaml"),
                 f"output_dir={run_dir}", "logging.logger=[jsonl]", "logging.plot=false",
                 "checkpoint.every=0"]) == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    probes = [m for m in metrics if "sft/train_accuracy" in m]
    assert probes[-1]["sft/train_accuracy"] >= 0.3, probes[-1]  # the sampled probe's stop
    # a sampled probe may ramble past the per-turn cap now and then (2 of 64 episodes in CI); a cap shorter
    # than the demonstrations would cut nearly every episode
    assert probes[-1]["sft/probe_truncated_fraction"] < 0.1, probes[-1]
    steps = [m for m in metrics if "reward" in m]
    assert len(steps) == RL_STEPS
    for step in steps:  # the agent's tools reached the warm-up's prompt, and it calls them
        assert step["agentic/opening_mismatch"] == 0 and step["rollout/tool_call_fraction"] > 0.3
    evals = [m for m in metrics if "eval/sampled_accuracy" in m]
    assert evals[0]["eval/accuracy"] >= 0.3  # the warm-up's skill carries over to held-out sums
    window = RL_STEPS // 4  # benchmarks/learning.py's window for a run this long
    first = sum(s["reward"] for s in steps[:window]) / window
    last = sum(s["reward"] for s in steps[-window:]) / window
    assert last > first + MIN_BENCHMARK_REWARD_RISE / 2, f"training reward did not rise: {first:.3f} -> {last:.3f}"
