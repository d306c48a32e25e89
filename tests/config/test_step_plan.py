"""The step plan (issue 55, item 3): one place says which pass of an RL step fills which batch field, built from
the config, the stage's ``provides`` and the components' signatures, and ``rltk validate`` prints it."""

from __future__ import annotations

import types

import pytest

import rltk
from rltk.commands.cli import main
from rltk.config import load_config
from rltk.config.recipe_capabilities import (
    ENGINE_LOGPROBS, FIELD_PASSES, UPDATE_FORWARD, StepPlan, update_may_take_old_logprobs,
)
from rltk.registration.stage_spec import RL_STEP_FIELDS, StageSpec, rl_provides


def plan_of(stage: str, *overrides: str) -> StepPlan:
    return StepPlan.build(load_config([], list(overrides)), rltk.get_component("stage", stage).provides, stage)


def test_grpo_with_kl_fills_the_reference_and_takes_the_old_logprobs_from_its_update():
    plan = plan_of("grpo", "algorithm.name=grpo", "algorithm.kl_coef=0.05")
    assert plan.filler("ref_logprobs") == "reference pass"
    assert plan.filler("old_logprobs") == UPDATE_FORWARD and plan.old_logprobs_from_update
    assert plan.filler("advantages") == plan.filler("returns") == "advantage_fn 'grpo'"
    assert all(plan.filler(f) == "rollout" for f in RL_STEP_FIELDS if f != "old_logprobs")
    # nothing on demand: no greedy rollout, no reward columns, no sum_pi_squared, no critic
    assert not (plan.greedy_baseline or plan.reward_components or plan.sum_pi_squared)
    assert plan.filler("values") is None and plan.unfilled == ()
    assert dict(plan.reads)["kl_penalty_fn 'k3' (in the loss)"] == ("logprobs", "ref_logprobs")
    text = plan.describe()
    assert "reference pass" in text and "fills ref_logprobs" in text and "advantage_fn 'grpo' reads group_ids" in text


def test_grpo_without_kl_has_no_reference_and_a_second_mini_batch_brings_the_old_pass_back():
    plan = plan_of("grpo", "algorithm.name=grpo", "algorithm.kl_coef=0")
    assert plan.filler("ref_logprobs") is None and plan.old_logprobs_from_update
    assert not any(component.startswith("kl_penalty_fn") for component, _ in plan.reads)
    assert plan_of("grpo", "algorithm.name=grpo", "algorithm.kl_coef=0",
                   "trainer.mini_batches=2").filler("old_logprobs") == "old-log-prob pass"
    assert plan_of("grpo", "algorithm.kl_coef=0", "algorithm.use_rollout_logprobs=true").filler(
        "old_logprobs") == ENGINE_LOGPROBS
    # a KL penalty folded into the rewards needs the old log-probs before the advantages
    folded = plan_of("grpo", "algorithm.kl_coef=0.05", "algorithm.kl_in=reward")
    assert folded.filler("old_logprobs") == "old-log-prob pass" and not folded.old_logprobs_from_update
    assert folded.filler("token_rewards") == "rollout, then the KL penalty (algorithm.kl_in=reward)"


def test_ppo_fills_values_by_its_critic_and_always_runs_the_old_pass():
    # one epoch, one mini-batch, no KL: grpo's update would take the old log-probs; ppo's loop declares it does not
    plan = plan_of("ppo", "algorithm.name=ppo", "algorithm.kl_coef=0", "trainer.ppo_epochs=1", "trainer.mini_batches=1")
    assert plan.filler("values") == "critic pass" and plan.filler("old_logprobs") == "old-log-prob pass"
    assert not plan.old_logprobs_from_update
    assert dict(plan.reads)["advantage_fn 'gae'"] == ("response_mask", "token_rewards", "values")
    assert dict(plan.reads)["the critic's value loss"] == ("response_mask", "returns", "values")


def test_the_estimators_that_ask_for_a_pass_get_it():
    assert plan_of("grpo", "algorithm.name=remax").filler("baseline_scores") == FIELD_PASSES["baseline_scores"]
    assert plan_of("grpo", "algorithm.advantage_fn=gdpo").reward_components
    otb = plan_of("grpo", "algorithm.advantage_fn=optimal_token_baseline", "algorithm.kl_coef=0")
    # it names old_logprobs and sum_pi_squared: both from the pass before the advantages, not from the update
    assert otb.filler("sum_pi_squared") == otb.filler("old_logprobs") == "old-log-prob pass"
    assert otb.sum_pi_squared and not otb.old_logprobs_from_update


def needs_pi_squared_and_values(*, sum_pi_squared, values, response_mask, token_rewards, clip: float = 1.0):
    """A plugin estimator: ``A_t = clip(values_t * sum_pi_squared_t)`` (a test's, no paper)."""
    advantages = (values * sum_pi_squared).clamp(-clip, clip) * response_mask
    return advantages, advantages + token_rewards * 0


@pytest.fixture
def plugin_estimator():
    module = types.ModuleType("rltk_plugin_needs_fields")
    module.rltk_advantage_fns = rltk.hookimpl(lambda: {"needs_fields": needs_pi_squared_and_values})
    module.rltk_stages = rltk.hookimpl(lambda: {"own_critic": StageSpec(
        "rltk.training.stages.ppo_stage:run_ppo_stage", "a plugin loop with a critic of its own",
        provides=rl_provides("values", "sum_pi_squared", "routed_experts", on_policy_update=False), rl=True)})
    rltk.register_plugin(module, name="rltk_plugin_needs_fields")
    yield "needs_fields"
    rltk.unregister_plugin("rltk_plugin_needs_fields")


def test_a_plugin_estimator_s_fields_are_named_with_who_fills_them(plugin_estimator):
    for stage in ("ppo", "own_critic"):
        plan = plan_of(stage, f"algorithm.advantage_fn={plugin_estimator}")
        assert plan.filler("sum_pi_squared") == "old-log-prob pass" and plan.sum_pi_squared
        assert plan.filler("values") == "critic pass" and plan.unfilled == ()
        assert dict(plan.reads)[f"advantage_fn '{plugin_estimator}'"] == (
            "response_mask", "sum_pi_squared", "token_rewards", "values")
    # a field a plugin stage declares beyond rltk's passes is its loop's
    assert plan_of("own_critic", f"algorithm.advantage_fn={plugin_estimator}").filler(
        "routed_experts") == "stage 'own_critic' loop"
    assert plan_of("ppo", f"algorithm.advantage_fn={plugin_estimator}").filler("routed_experts") is None
    # under grpo nothing fills values: the plan names the field and the component that needs it
    plan = plan_of("grpo", f"algorithm.advantage_fn={plugin_estimator}")
    assert plan.unfilled == (("values", f"'algorithm.advantage_fn'='{plugin_estimator}'"),)
    assert f"nothing fills values, which 'algorithm.advantage_fn'='{plugin_estimator}' needs" in plan.describe()


def test_a_field_nothing_fills_is_exit_2_from_validate_naming_the_component_and_key(plugin_estimator, capsys):
    assert main(["validate", "grpo", f"algorithm.advantage_fn={plugin_estimator}"]) == 2
    err = capsys.readouterr().err
    assert f"rltk: error: 'algorithm.advantage_fn'='{plugin_estimator}' needs batch field(s) 'values'" in err
    assert "recipe 'grpo' does not provide" in err and "Traceback" not in err
    assert main(["validate", "ppo", f"algorithm.advantage_fn={plugin_estimator}"]) == 0
    out = capsys.readouterr().out
    assert "step plan of stage 'ppo' (rl):" in out
    assert [line.split() for line in out.splitlines() if " fills " in line and "sum_pi_squared" in line] == [
        ["old-log-prob", "pass", "fills", "old_logprobs,", "sum_pi_squared"]]


def test_validate_prints_who_fills_what_for_each_rl_stage(capsys):
    assert main(["validate", "grpo", "algorithm.kl_coef=0.05"]) == 0
    out = capsys.readouterr().out.splitlines()
    start = out.index("step plan of stage 'grpo' (rl):")
    fills = {line.split(" fills ")[0].strip(): line.split(" fills ")[1] for line in out[start + 1:] if " fills " in line}
    assert fills["reference pass"] == "ref_logprobs"
    assert fills["the update's own forward (on-policy)"] == "old_logprobs"
    assert fills["advantage_fn 'grpo'"] == "advantages, returns"


@pytest.mark.parametrize("overrides", [
    [], ["trainer.mini_batches=2"], ["trainer.ppo_epochs=2"], ["algorithm.use_rollout_logprobs=true"],
    ["algorithm.kl_coef=0.1", "algorithm.kl_in=reward"], ["algorithm.kl_coef=0.1"],
    ["algorithm.rollout_correction.tis=token"], ["algorithm.rollout_correction.log_metrics=true"],
    ["algorithm.advantage_fn=optimal_token_baseline"], ["algorithm.advantage_fn=on_policy_distill"],
])
def test_the_plan_s_on_policy_and_the_rule_on_built_components_agree(overrides):
    from rltk.training.step.estimator import Estimator
    from rltk.training.step.loss_components import LossComponents
    from rltk.training.updates.rl import old_logprobs_from_update

    cfg = load_config([], ["algorithm.name=grpo", "algorithm.kl_coef=0", *overrides])
    plan = StepPlan.build(cfg, rltk.get_component("stage", "grpo").provides, "grpo")
    a, t = cfg.algorithm, cfg.trainer
    built = old_logprobs_from_update(LossComponents.from_config(cfg), Estimator.from_config(cfg),
                                     ppo_epochs=t.ppo_epochs, mini_batches=t.mini_batches,
                                     use_rollout_logprobs=a.use_rollout_logprobs, kl_coef=a.kl_coef)
    # only these two keep the update's own forward: KL in the loss is computed inside the update
    assert plan.old_logprobs_from_update == built == (overrides in ([], ["algorithm.kl_coef=0.1"]))


def test_the_rule_by_hand():
    base = dict(ppo_epochs=1, mini_batches=1, use_rollout_logprobs=False, rollout_correction={}, kl_coef=0.0,
                kl_in="loss")
    assert update_may_take_old_logprobs(frozenset({"scores"}), **base)
    assert not update_may_take_old_logprobs(None, **base)  # an unreadable estimator may want the field
    assert not update_may_take_old_logprobs(frozenset({"old_logprobs"}), **base)
    assert not update_may_take_old_logprobs(frozenset(), **{**base, "rollout_correction": {"mis": "token"}})
    assert update_may_take_old_logprobs(frozenset(), **{**base, "rollout_correction": {"mis": None}})
    assert update_may_take_old_logprobs(frozenset(), **{**base, "kl_coef": 0.1})  # KL in the loss is the update's
