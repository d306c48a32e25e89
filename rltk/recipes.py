"""What a recipe script imports: one face over the library, so a script names no internal module.

A recipe is ``main()``: parse the config against the stages it may run, open the run, run its stages (each
a registered loop, or one the script defines itself), finish::

    from rltk.recipes import finish_run, open_run, parse_recipe_args, recipe_stages, run_stages

    STAGES = recipe_stages("grpo")  # every registered stage, and `type: rl` = the grpo loop

    def main():
        cfg = parse_recipe_args(STAGES)
        run = open_run(cfg)
        run_stages(run, STAGES)
        finish_run(run)

A script with a loop of its own writes it on the names below (the builtin loops in
``rltk/training/stages/*_stage.py`` are worked examples) and hands it over as
``recipe_stages("grpo", rl=StageSpec(my_loop, "my loop", provides=rl_provides("values")))``; a loop
worth sharing is registered by a plugin instead (``rltk_stages``, CONTRIBUTING.md).

Names are imported when first used: ``import rltk.recipes`` itself loads no torch.
"""

from __future__ import annotations

import importlib

#: name -> the module that defines it.
_FACE = {
    # the run and its stages
    **dict.fromkeys(("parse_recipe_args", "recipe_stages", "registered_stages"), "rltk.recipe_tools.validation"),
    **dict.fromkeys(("StageSpec", "rl_provides", "RL_STEP_FIELDS"), "rltk.registration.stage_spec"),
    **dict.fromkeys(("Run", "Stage", "open_run", "run_stages", "finish_run", "build_stage_strategy",
                     "build_rl_strategy", "require_rows_per_rank"), "rltk.training.stages.run"),
    # an RL loop's pieces, in the order a step uses them
    **dict.fromkeys(("LoopState", "RLParts", "StageContext", "open_rl_stage", "start_rl_stage", "rl_steps",
                     "kl_to_reference"), "rltk.training.stages.loop_state"),
    "StepPlan": "rltk.config.recipe_capabilities",
    "open_rollout_source": "rltk.training.rollouts.rollout_source",
    **dict.fromkeys(("RolloutPlan", "collect_experiences"), "rltk.training.rollouts.collect"),
    "RowSampler": "rltk.data.sampler",
    **dict.fromkeys(("sft_batch", "sft_step"), "rltk.training.updates.sft"),
    "old_logprobs_pass": "rltk.training.step.forward",
    "ForwardSettings": "rltk.training.step.forward",
    "moe_step_metrics": "rltk.training.step.moe_metrics",
    **dict.fromkeys(("global_masked_mean", "rows_in", "any_rank"), "rltk.training.step.ranks"),
    "apply_kl_penalty": "rltk.algorithms.kl",
    "policy_update": "rltk.training.updates.rl",
    "rollout_metrics": "rltk.training.step.batch_metrics",
    **dict.fromkeys(("end_step", "evaluate_at_start"), "rltk.training.stages.step_end"),
    # what the builtin loops are, to call from a script or wrap
    "run_sft_stage": "rltk.training.stages.sft_stage",
    "run_grpo_stage": "rltk.training.stages.grpo_stage",
    "run_ppo_stage": "rltk.training.stages.ppo_stage",
    "run_dpo_stage": "rltk.training.stages.dpo_stage",
    "run_distill_stage": "rltk.training.stages.distill_stage",
    **dict.fromkeys(("train_reward_model", "refuse_unsupported"), "rltk.training.stages.reward_model_stage"),
    "teacher_folders": "rltk.training.updates.distill",
}

__all__ = sorted(_FACE)


def __getattr__(name: str):
    if name not in _FACE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_FACE[name]), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__():
    return __all__
