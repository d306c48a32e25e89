"""Every registered algorithm preset runs a few RL steps on the tiny default, and what defines it reaches the loop.

The presets come from the registry at collection time, so a preset another plugin or module
adds is covered without touching this file. Each runs the recipe that can serve it (``ppo``
when its estimator needs a critic's ``values``, else ``grpo``) with the shipped YAML, a two-step
warm-up and three RL steps. The test wraps the shared training functions the recipe calls and
checks, from the resolved config, that each setting of the preset took effect: the estimator and
its arguments, the policy loss and aggregation (Dr. GRPO's constant is the generation budget), the
KL placement (in the rewards it really changes them), ReMax's greedy baseline and DAPO's dynamic
sampling (only groups whose scores differ are trained on).
"""

from __future__ import annotations

import inspect
import json
import math
import types

import pytest
import torch
from omegaconf import OmegaConf

import rltk
from rltk.commands.cli import main
from rltk.config.recipe_capabilities import required_batch_fields
from rltk.registry import get_registry

PRESETS = sorted(get_registry().entries["algorithm"])

TINY = ["sft.steps=2", "sft.warmup_steps=0", "sft.stop_at_accuracy=null", "trainer.total_steps=3",
        "trainer.warmup_steps=0", "trainer.eval_every=0", "data.train_size=48", "data.eval_size=4",
        "trainer.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=6", "checkpoint.resume=never",
        "checkpoint.every=0", "critic.warmup_steps=0", "logging.logger=[jsonl]", "logging.plot=false", "reward.reward_fn=[length_parity]"]


def length_parity(*, prompt: str, response: str) -> float:
    """0 for every response to a prompt of odd length (an all-equal group, which dynamic sampling drops);
    otherwise 1.0 for a response of even length, so the random tiny model's groups differ and
    group-relative estimators see signal."""
    if len(prompt) % 2:
        return 0.0
    return float(len(response) % 2 == 0)


@pytest.fixture
def parity_reward():
    plugin = types.ModuleType("length_parity_reward")
    plugin.rltk_reward_fns = rltk.hookimpl(lambda: {"length_parity": length_parity})
    rltk.register_plugin(plugin, name="length_parity_reward")
    yield
    rltk.unregister_plugin("length_parity_reward")


@pytest.fixture
def calls(monkeypatch):
    """What the recipe hands the shared training functions, step by step."""
    import rltk.training.step.estimator as estimator
    import rltk.training.stages.grpo_stage as grpo_stage
    import rltk.training.stages.ppo_stage as ppo_stage
    import rltk.training.updates.rl as rl

    seen = {"advantages": [], "updates": []}
    estimate, policy_update = estimator.Estimator.__call__, rl.policy_update

    def recording_advantages(self, batch, strategy=None):
        before = {k: v.clone() for k, v in batch.items()}
        advantages, returns = estimate(self, batch, strategy)
        seen["advantages"].append({"fn": self.fn, "args": dict(self.args), "batch": before,
                                   "advantages": advantages.clone(), "returns": returns.clone()})
        return advantages, returns

    def recording_update(strategy, batch, loss, settings, **kwargs):
        update = policy_update(strategy, batch, loss, settings, **kwargs)
        seen["updates"].append({"loss": loss, "kl_coef": kwargs["kl_coef"], "metrics": update.metrics})
        return update

    # The stage modules bind policy_update when first imported (by an earlier test, perhaps): patch their names.
    monkeypatch.setattr(estimator.Estimator, "__call__", recording_advantages)
    for stage in (grpo_stage, ppo_stage):
        monkeypatch.setattr(stage, "policy_update", recording_update)
    return seen


def recipe_for(preset: dict) -> str:
    estimator = get_registry().entries["advantage_fn"][preset.get("advantage_fn", "grpo")].obj
    return "ppo" if "values" in required_batch_fields(estimator) else "grpo"


@pytest.mark.slow  # a two-step warm-up and three RL steps of the tiny model, a few seconds per preset
@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_runs_and_its_defining_switches_are_active(name, tmp_path, parity_reward, calls):
    preset = get_registry().entries["algorithm"][name].obj
    run_dir = tmp_path / name
    assert main(["run", recipe_for(preset), f"output_dir={run_dir}", f"algorithm.name={name}", *TINY]) == 0
    cfg = OmegaConf.load(run_dir / "config.yaml")
    a = cfg.algorithm
    for key, value in preset.items():  # the YAML may set what the preset leaves at the schema default
        if key != "description" and key != "kl_coef":
            assert OmegaConf.to_container(a)[key] == value, f"preset {name}: algorithm.{key}"

    # finite numbers every step; the RL steps trained
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl_lines = [m for m in lines if m["step"] > 2 and "reward" in m]
    assert len(rl_lines) == 3, f"{name}: an RL step was skipped: {lines}"
    for m in lines:
        bad = {k: v for k, v in m.items() if not math.isfinite(v)}
        assert not bad, f"{name}: non-finite metrics at step {m['step']}: {bad}"
    assert len(calls["advantages"]) == len(calls["updates"]) == 3

    registry = get_registry().entries
    for adv, update in zip(calls["advantages"], calls["updates"]):
        # the estimator and its arguments
        assert adv["fn"] is registry["advantage_fn"][a.advantage_fn].obj
        assert adv["args"] == OmegaConf.to_container(a.advantage_fn_args)
        assert torch.isfinite(adv["advantages"]).all()
        # the policy loss, its arguments and the aggregation
        loss = update["loss"]
        assert loss.policy_loss is registry["policy_loss"][a.policy_loss].obj
        assert loss.policy_loss_args == OmegaConf.to_container(a.policy_loss_args)
        assert loss.loss_agg is registry["loss_agg"][a.loss_agg].obj
        if "norm_constant" in inspect.signature(loss.loss_agg).parameters:  # Dr. GRPO: the generation budget
            assert loss.loss_agg_args["norm_constant"] == cfg.rollout.max_new_tokens
        assert math.isfinite(update["metrics"]["pg_loss"])

    # the KL: none without a coefficient; in the loss, a logged term; in the reward, changed rewards
    batches = [adv["batch"] for adv in calls["advantages"]]
    if a.kl_coef == 0:
        assert all("ref_logprobs" not in b for b in batches)
        assert all("kl_loss" not in u["metrics"] for u in calls["updates"])
    elif a.kl_in == "loss":
        assert all("kl_loss" in u["metrics"] for u in calls["updates"])
        assert all(torch.equal(b["token_rewards"].sum(-1), b["scores"]) for b in batches)
    else:
        assert all("kl_loss" not in u["metrics"] for u in calls["updates"])
        # The first step's policy is the reference (KL 0); after an update the penalty moves the rewards.
        shifted = [(b["token_rewards"].sum(-1) - b["scores"]).abs().max().item() for b in batches[1:]]
        assert max(shifted) > 1e-6, f"{name}: kl_in=reward left the rewards unchanged: {shifted}"

    # ReMax: a greedy response per prompt scores the baseline the estimator subtracts
    if "baseline_scores" in required_batch_fields(registry["advantage_fn"][a.advantage_fn].obj):
        for adv in calls["advantages"]:
            b = adv["batch"]
            assert set(b["baseline_scores"].tolist()) <= {0.0, 1.0}
            for gid in b["group_ids"].unique():  # one greedy response, so one baseline, per prompt
                assert b["baseline_scores"][b["group_ids"] == gid].unique().numel() == 1
        assert all("rollout/greedy_baseline_score" in m for m in rl_lines)
    else:
        assert all("baseline_scores" not in b for b in batches)

    # DAPO's dynamic sampling: only groups whose scores differ, as many as a step has prompts
    if a.dynamic_sampling:
        for b, m in zip(batches, rl_lines):
            for gid in b["group_ids"].unique():
                scores = b["scores"][b["group_ids"] == gid]
                assert scores.max() > scores.min(), f"{name}: an all-equal group was trained on"
            assert m["dynamic_sampling/groups"] == m["dynamic_sampling/groups_target"] or \
                m["dynamic_sampling/cap_reached"] == 1.0
            assert 1 <= m["dynamic_sampling/rounds"] <= a.dynamic_sampling_max_rounds
        # half the prompts give all-equal groups: some were dropped and more prompts drawn
        assert sum(m["dynamic_sampling/groups_dropped"] for m in rl_lines) > 0
        assert max(m["dynamic_sampling/rounds"] for m in rl_lines) > 1
    else:
        assert all("dynamic_sampling/rounds" not in m for m in rl_lines)
