"""The shipped agentic config (recipes/configs/agentic.yaml) learns: its first 100 GRPO steps (slow; run in CI).

The game of multi_turn.yaml (find a secret in 1-31 from "higher"/"lower" within 5 guesses), but the
loop is the `guess_number` agent's own code: every guess is a request of its `openai` client to the
endpoint rltk serves in the training process, and each episode's requests are stitched into one
trajectory. A step is ~5 s (640 requests), so the test runs the config's first 100 of its 200 steps:
the learning rate is constant after 5 warm-up steps, so that is the run the benchmark's evaluation at
step 100 measured (`benchmarks/learning.py --recipes agentic --at-step 100`).
"""

from pathlib import Path

import pytest

from rltk.commands.cli import main
from tests.recipes.guessing_game import assert_the_game_was_learned
from tests.serve.helpers import ensure_serve_builtins

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RL_STEPS = 100
# What `benchmarks/learning.py --recipes agentic --seeds 0 1 2 --levels default avx2 --at-step 100`
# measured (docs/measurements.md): after 100 GRPO steps every run's held-out sampled win rate
# had gained at least MIN_BENCHMARK_SAMPLED_GAIN and its training reward (steps 76-100 vs 1-25) had
# risen by at least MIN_BENCHMARK_REWARD_RISE. The test asks for half of each. Its own seeded run (it
# repeats itself: the batcher samples in session order) rose +0.120 / +0.125 in training reward and
# +0.184 / +0.139 in sampled win rate at ATEN_CPU_CAPABILITY avx512 and avx2 (the same numbers) / default.
MIN_BENCHMARK_SAMPLED_GAIN = 0.052
MIN_BENCHMARK_REWARD_RISE = 0.045


def test_grpo_through_the_openai_endpoint_raises_the_agents_win_rate(tmp_path):
    ensure_serve_builtins()
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", "--config", str(REPO / "recipes" / "configs" / "agentic.yaml"),
                 f"output_dir={run_dir}", f"trainer.total_steps={RL_STEPS}", "logging.logger=[jsonl]",
                 "logging.plot=false"]) == 0
    steps = assert_the_game_was_learned(run_dir, rl_steps=RL_STEPS, min_reward_rise=MIN_BENCHMARK_REWARD_RISE / 2,
                                        min_sampled_gain=MIN_BENCHMARK_SAMPLED_GAIN / 2)
    for step in steps:  # every episode an agent's requests, none dropped, the feedback masked out
        assert step["agentic/episodes"] == 128 and step["agentic/agent_errors"] == 0
        assert 1 <= step["agentic/requests_per_episode"] <= 5
        assert 0 < step["rollout/policy_tokens"]
