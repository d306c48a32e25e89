"""A run whose reward needs worker processes: scored there every step, and the workers gone at the end."""

from __future__ import annotations

import json

import pytest

import rltk
from rltk.commands.cli import main
from rltk.rewards import pool
from tests.rewards import reward_fns as rf

TINY_RUN = ["sft.steps=2", "sft.warmup_steps=0", "trainer.total_steps=3", "trainer.warmup_steps=0",
            "data.train_size=40", "data.eval_size=8", "trainer.prompts_per_step=4", "rollout.n=2",
            "checkpoint.resume=never", "checkpoint.every=0", "logging.logger=[jsonl]", "logging.plot=false"]


@pytest.mark.slow  # trains a tiny model for 5 steps (~10 s on a quiet machine)
def test_a_run_scores_an_unmarked_reward_in_workers_and_stops_them(tmp_path, fresh_registry):
    rltk.register_plugin(rf.UserPlugin(), name="user-rewards")
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", *TINY_RUN, "reward.reward_fn=[exact_match,user_exact]",
                 "reward.workers=2"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if "reward_fn/calls" in r]
    assert len(rl) == 3
    calls = [r["reward_fn/calls"] for r in rl]  # cumulative; a step scores 4 prompts x 2 samples
    assert all(later - earlier >= 8 for earlier, later in zip(calls, calls[1:]))
    assert all(r["reward_fn/failures/user_exact"] == 0.0 and r["reward_fn/worker_restarts"] == 0.0 for r in rl)
    assert all(0.0 <= r["reward/user_exact"] <= 1.0 for r in rl)
    # finish_run closed the reward: no worker process is left
    assert all(not p._workers for p in pool._LIVE_POOLS)
