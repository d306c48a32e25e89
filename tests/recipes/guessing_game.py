"""What the learning tests of the guessing-game configs (multi_turn.yaml, agentic.yaml) check alike."""

import json
from pathlib import Path

#: Warm-up stop step measured by benchmarks/learning.py was 60-70 (probe every 10 steps); the tests allow 200.
MAX_WARMUP_STEPS = 200
EVAL_EVERY = 25
EVAL_EPISODES = 310  # every secret in 1-31, 10 times


def assert_the_game_was_learned(run_dir: Path, *, rl_steps: int, min_reward_rise: float,
                                min_sampled_gain: float) -> list[dict]:
    """Assert what a learning run of a guessing-game config must show; returns its RL steps' metrics.

    The warm-up reached a 0.4 win rate in time and carried it over to held-out play; the mean
    training reward of the last 25 RL steps beat the first 25 by ``min_reward_rise``; the held-out
    sampled win rate at the end beat the one at the RL start by ``min_sampled_gain``.
    """
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    probes = [m for m in metrics if "sft/train_accuracy" in m]
    assert probes[-1]["sft/train_accuracy"] >= 0.4 and probes[-1]["step"] <= MAX_WARMUP_STEPS

    steps = [m for m in metrics if "reward" in m]
    assert len(steps) == rl_steps
    rewards = [m["reward"] for m in steps]
    first, last = sum(rewards[:25]) / 25, sum(rewards[-25:]) / 25
    assert last > first + min_reward_rise, f"training reward did not rise: {first:.3f} -> {last:.3f}"

    evals = [m for m in metrics if "eval/accuracy" in m]
    assert len(evals) == rl_steps // EVAL_EVERY + 1  # the RL start, then every EVAL_EVERY steps
    assert all(m["eval/num_responses"] == EVAL_EPISODES for m in evals)
    assert evals[0]["eval/accuracy"] >= 0.4  # the warm-up's greedy win rate carries over to held-out play
    sampled = [m["eval/sampled_accuracy"] for m in evals]
    assert sampled[-1] > sampled[0] + min_sampled_gain, f"held-out sampled win rate: {sampled}"
    return steps
