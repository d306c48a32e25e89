"""rltk's own training loops, registered as stages (kind ``stage``) through rltk's entry points like a plugin's.

Each spec names its loop as ``"module:function"``, imported the first time the stage runs, and says what the
loop provides its components (see :class:`rltk.StageSpec`), so ``rltk validate`` and ``rltk list stage`` read
this module without importing torch or any training code (the layers' ground floor: config validation loads
it). ``type: grpo`` in any run's ``stages`` runs :mod:`rltk.training.stages.grpo_stage`'s loop;
``type: rl`` in ``rltk run grpo`` runs the same loop (:func:`rltk.recipes.recipe_stages`).
"""

from __future__ import annotations

import rltk
from rltk.errors import ConfigError
from rltk.registration.stage_spec import StageSpec, rl_provides

_HERE = "rltk.training.stages"

STAGES = rltk.ComponentTable("stage")
STAGES["sft"] = StageSpec(
    f"{_HERE}.sft_stage:run_sft_stage",
    "Supervised fine-tuning: cross-entropy on demonstrations (a warm-up before RL, or a run of its own).")
# baseline_scores come from one greedy response per prompt (ReMax), reward_components (gdpo) and
# sum_pi_squared (optimal_token_baseline) from the old-log-prob pass, each only when the estimator names them;
# expert experiences from buffer.expert.path (for buffer.sample_strategy=mix_expert); its update takes the old
# log-probs from its own forward when the step plan allows (rltk.config.recipe_capabilities.StepPlan).
STAGES["grpo"] = StageSpec(
    f"{_HERE}.grpo_stage:run_grpo_stage",
    "GRPO and its relatives (Dr. GRPO, DAPO, RLOO, REINFORCE++, GSPO, CISPO, ReMax): critic-free RL.",
    provides=rl_provides("baseline_scores", "reward_components", "sum_pi_squared", "ref_logprobs", expert_data=True),
    rl=True)
# as grpo, and the critic's values; the old-log-prob pass runs every step
STAGES["ppo"] = StageSpec(
    f"{_HERE}.ppo_stage:run_ppo_stage",
    "PPO with a learned critic: GAE advantages, clipped policy and value losses, KL in the reward.",
    provides=rl_provides("values", "baseline_scores", "reward_components", "sum_pi_squared", "ref_logprobs",
                         expert_data=True, on_policy_update=False),
    rl=True)
# the teacher's log-probs (the old-log-prob pass runs every step); no KL reference, no greedy baseline, no expert data
STAGES["distill"] = StageSpec(
    f"{_HERE}.distill_stage:run_distill_stage",
    "On-policy distillation: the student samples, a frozen teacher scores every sampled token.",
    provides=rl_provides("teacher_logprobs", on_policy_update=False), rl=True)
# DPO trains on pairs, not advantages: the algorithm.* components are not used, nothing of theirs to check
STAGES["dpo"] = StageSpec(
    f"{_HERE}.dpo_stage:run_dpo_stage",
    "DPO and its variants (IPO, SLiC hinge, cDPO), offline from preference pairs or online from samples.",
    check=f"{__name__}:check_dpo_stage")
STAGES["reward_model"] = StageSpec(
    f"{_HERE}.reward_model_stage:run_reward_model_stage",
    "Reward-model training (Bradley-Terry on preference pairs), after the stages of `rltk run reward_model`.",
    chainable=False)


def check_dpo_stage(cfg) -> None:
    """What the DPO loop refuses in its stage's config, checked before any stage runs (a chained DPO stage
    would otherwise fail only after the stages before it): a reference pass precomputed over fixed pairs
    while ``dpo.online`` samples new pairs every step."""
    if cfg.dpo.online and cfg.dpo.precompute_reference:
        raise ConfigError("dpo.precompute_reference=true needs fixed pairs, but dpo.online=true samples new ones "
                          "every step: set one of them to false")


@rltk.hookimpl
def rltk_stages():
    return STAGES
