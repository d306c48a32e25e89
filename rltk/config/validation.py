"""Validate a merged run config before anything heavy is built.

:func:`validate_config` runs every check in turn and raises a
:class:`~rltk.config.errors.ConfigError` on the first problem: component
names and arguments (:mod:`rltk.config.components`), choices and value
ranges (here), the seed and local paths (:mod:`rltk.config.run_checks`),
the divergence guard's keys (:mod:`rltk.config.guard_checks`), the ``env``
section of multi-turn episodes (:mod:`rltk.config.env_checks`),
what the recipe serves (:mod:`rltk.config.recipe_capabilities`), the critic
section (:mod:`rltk.config.critic_checks`), the rollout correction
(:mod:`rltk.config.rollout_correction_checks`), each reward's own score where
the estimator reads it (:mod:`rltk.config.reward_component_checks`), each
stage's overrides, and interpolations.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rltk.config.components import check_components, check_task
from rltk.config.critic_checks import check_critic_config
from rltk.config.env_checks import check_agent_tools, check_env
from rltk.config.errors import ConfigError
from rltk.config.guard_checks import check_guard
from rltk.config.lora_checks import check_lora_fits_model, check_lora_values, check_no_stage_lora
from rltk.config.merge import apply_overrides
from rltk.config.recipe_capabilities import (
    RecipeSpec, check_recipe_serves, check_workflow_serves, required_batch_fields,
)
from rltk.config.reward_component_checks import check_reward_components
from rltk.config.rollout_correction_checks import check_rollout_correction_config
from rltk.config.run_checks import check_paths, check_prompt_template, check_seed
from rltk.config.schema import CHOICES, STAGE_TYPES
from rltk.registry import did_you_mean, get_registry


def validate_config(cfg: DictConfig, recipe: RecipeSpec | None = None) -> None:
    """Check names, arguments and choices of a merged config; raise ConfigError on the first problem.

    Also checks what can be checked without loading anything: the seed's range,
    that configured paths exist (model folders are folders), and, when the
    ``recipe`` is known, that it serves the chosen components (an advantage
    estimator's batch fields, a sample strategy's buffer sources).
    """
    registry = get_registry()
    check_components(cfg, registry)
    check_env(cfg, registry)
    check_agent_tools(cfg, registry)
    for key, choices in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in choices:
            raise ConfigError(
                f"bad value {value!r} for '{key}'.{did_you_mean(value, list(choices))} Valid: {', '.join(choices)}"
            )
    _check_positive(cfg)
    check_rollout_correction_config(cfg)
    check_seed(cfg)
    check_paths(cfg)
    check_lora_values(cfg)
    check_lora_fits_model(cfg)
    check_guard(cfg)
    check_prompt_template(cfg)
    check_task(cfg)
    needs = required_batch_fields(registry.entries["advantage_fn"][cfg.algorithm.advantage_fn].obj)
    check_workflow_serves(cfg, needs)
    check_reward_components(cfg, needs)
    if recipe is not None:
        check_recipe_serves(cfg, recipe, needs)
    has_critic = recipe is not None and recipe.batch_fields is not None and "values" in recipe.batch_fields
    if "values" in needs or has_critic:  # a critic-based run: check its section too
        check_critic_config(cfg)
    for i, stage in enumerate(cfg.stages):
        if stage.type not in STAGE_TYPES:
            raise ConfigError(
                f"bad value {stage.type!r} for 'stages[{i}].type' (stage '{stage.name}'). "
                f"Valid: {', '.join(STAGE_TYPES)}"
            )
        if stage.overrides:
            check_no_stage_lora(i, stage.name, stage.overrides)
            staged = apply_overrides(cfg, dict(stage.overrides), f"stages[{i}].overrides (stage '{stage.name}')")
            staged.stages = []
            validate_config(staged, recipe)
    try:
        OmegaConf.resolve(OmegaConf.create(OmegaConf.to_container(cfg, resolve=False)))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"config interpolation failed at '{getattr(exc, 'full_key', '')}': {exc}") from exc


def _check_positive(cfg: DictConfig) -> None:
    rules = {
        "trainer.prompts_per_step": 1, "trainer.micro_batch_size": 1, "trainer.mini_batches": 1,
        "trainer.ppo_epochs": 1, "rollout.n": 1, "rollout.max_new_tokens": 1, "sft.batch_size": 1,
        "algorithm.dynamic_sampling_max_rounds": 1,
        "reward.workers": 1,
    }
    for key, minimum in rules.items():
        value = OmegaConf.select(cfg, key)
        if value < minimum:
            raise ConfigError(f"bad value {value!r} for '{key}': must be >= {minimum}")
    for section, total in (("trainer", "total_steps"), ("sft", "steps")):
        warmup, steps = OmegaConf.select(cfg, f"{section}.warmup_steps"), OmegaConf.select(cfg, f"{section}.{total}")
        if not 0 <= warmup <= steps:
            raise ConfigError(
                f"bad value {warmup!r} for '{section}.warmup_steps': must be in [0, {section}.{total}={steps}]"
            )
    if cfg.reward.timeout_s is not None and cfg.reward.timeout_s <= 0:
        raise ConfigError(
            f"bad value {cfg.reward.timeout_s!r} for 'reward.timeout_s': must be > 0 seconds, or null to run every "
            f"reward function in-process without a timeout"
        )
    if cfg.trainer.lr <= 0:
        raise ConfigError(f"bad value {cfg.trainer.lr!r} for 'trainer.lr': must be > 0")
    if cfg.rollout.temperature <= 0:
        raise ConfigError(
            f"bad value {cfg.rollout.temperature!r} for 'rollout.temperature': must be > 0 "
            f"(greedy decoding is used for evaluation automatically)"
        )
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"bad value {cfg.rollout.top_p!r} for 'rollout.top_p': must be in (0, 1]")
    if cfg.buffer.expert.source == "policy":
        raise ConfigError(
            "bad value 'policy' for 'buffer.expert.source': that is the source of the policy's own rollouts; "
            "name another one (default 'expert')"
        )
    budget = cfg.trainer.max_tokens_per_micro_batch
    if budget is not None and budget <= cfg.rollout.max_new_tokens:
        raise ConfigError(
            f"bad value {budget!r} for 'trainer.max_tokens_per_micro_batch': must be null (micro-batches of "
            f"trainer.micro_batch_size sequences) or a token count above rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens}, so that a prompt and a full-length response fit in one micro-batch"
        )
    batch = cfg.trainer.prompts_per_step * cfg.rollout.n
    if batch % cfg.trainer.mini_batches:
        raise ConfigError(
            f"trainer.mini_batches={cfg.trainer.mini_batches} must divide the rollout batch "
            f"trainer.prompts_per_step x rollout.n = {batch}"
        )

