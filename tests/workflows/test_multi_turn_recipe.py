"""The grpo recipe trains on multi-turn episodes from config alone (rollout.workflow=multi_turn, env.*)."""

from __future__ import annotations

import json
import types

import pytest

import rltk
from rltk.commands.cli import main
from tests.builtin_plugins import ensure_registered
from tests.workflows.multi_turn_helpers import CountingEnv

TINY = ["sft.steps=2", "sft.warmup_steps=0", "sft.stop_at_accuracy=null", "trainer.total_steps=2",
        "trainer.warmup_steps=0", "trainer.eval_every=0", "data.train_size=16", "data.eval_size=4",
        "trainer.prompts_per_step=4", "rollout.n=2", "checkpoint.resume=never", "checkpoint.every=0",
        "logging.logger=[jsonl]", "logging.plot=false"]


@pytest.fixture
def counting_env():
    ensure_registered("tools", "tool_parsers", "multi_turn")
    module = types.ModuleType("recipe_test_envs")
    module.rltk_environments = lambda: {"counting": CountingEnv}
    rltk.register_plugin(module, "recipe_test_envs")
    yield
    rltk.unregister_plugin("recipe_test_envs")


@pytest.mark.slow  # two warm-up steps and two GRPO steps of the tiny model on 3-turn episodes (~10 s)
def test_grpo_trains_on_multi_turn_episodes(tmp_path, batches, counting_env):
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", *TINY, "rollout.workflow=multi_turn",
                 "env.environment=counting", "env.environment_args.turns=3", "env.environment_args.reward=0.25",
                 "env.max_total_tokens=40", "rollout.max_new_tokens=4"]) == 0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl_lines = [m for m in lines if "rollout/turns_mean" in m]
    assert len(rl_lines) == 2 and len(batches) == 2
    for m, batch in zip(rl_lines, batches):
        assert m["rollout/turns_mean"] == 3.0 and m["rollout/env_errors"] == 0.0 and m["rollout/engine_calls"] == 3.0
        assert m["rollout/env_reward_mean"] == 0.75
        mask = batch["response_mask"]
        lengths = batch["response_lengths"]
        for row in range(mask.shape[0]):
            live = mask[row, : lengths[row]]
            assert live[0] == 1 and live[-1] == 1 and (live == 0).sum() > 0  # observations inside, masked
        # token rewards sum to the scores: 3 x 0.25 from the environment plus exact match
        assert batch["token_rewards"].sum(-1).sub(batch["scores"]).abs().max() < 1e-5
        assert (batch["advantages"] * (1 - batch["response_mask"])).abs().max() == 0
