"""Validate a merged run config before anything heavy is built.

:func:`validate_config` runs every check in turn and raises a
:class:`~rltk.errors.ConfigError` on the first problem: component
names and arguments (:mod:`rltk.config.components`), choices and value
ranges, the seed and local paths, the divergence guard's keys, the ``env``
section of multi-turn episodes (:mod:`rltk.config.env_checks`), ``model.lora``
(:mod:`rltk.config.lora_checks`), ``launcher`` (:mod:`rltk.config.launcher_checks`), what the recipe serves
(:mod:`rltk.config.recipe_capabilities`), the critic section, the rollout
correction, each reward's own score where the estimator reads it, each
stage's overrides, and interpolations. The checks of one section each sit
below :func:`validate_config`, under a banner naming the section.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rltk.config.components import check_components, check_task
from rltk.strategies.layout import check_peer_size_names
from rltk.config.env_checks import check_agent_tools, check_env
from rltk.config.launcher_checks import check_launcher
from rltk.config.lora_checks import check_lora_fits_model, check_lora_values, check_no_stage_lora
from rltk.config.merge import apply_overrides
from rltk.config.moe_checks import check_moe_config
from rltk.errors import ConfigError
from rltk.config.recipe_capabilities import (
    RecipeSpec, check_recipe_serves, check_workflow_serves, required_batch_fields,
)
from rltk.config.schema import CHOICES
from rltk.data.templates import template_fields
from rltk.io import model_folder_problem
from rltk.models.parallel.sizes import TP_KEY, check_tensor_parallel_sizes
from rltk.registry import did_you_mean, get_registry


def validate_config(cfg: DictConfig, recipe: RecipeSpec | None = None) -> None:
    """Check names, arguments and choices of a merged config; raise ConfigError on the first problem.

    Also checks what can be checked without loading anything: the seed's range,
    that configured paths exist (model folders are folders), and, when the
    ``recipe`` is known, that it serves the chosen components (an advantage
    estimator's batch fields, a sample strategy's buffer sources).
    """
    registry = get_registry()
    check_peer_size_names(OmegaConf.to_container(cfg.strategy_args, resolve=True))
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
    check_moe_config(cfg, registry)
    check_tensor_parallel_config(cfg)
    check_vision_config(cfg)
    check_async_config(cfg, recipe, registry)
    check_launcher(cfg)
    check_seed(cfg)
    check_paths(cfg)
    check_lora_values(cfg)
    check_lora_fits_model(cfg)
    check_guard(cfg)
    check_prompt_template(cfg)
    check_task(cfg)
    needs = required_batch_fields(registry.entries["advantage_fn"][cfg.algorithm.advantage_fn].described)
    check_workflow_serves(cfg, needs)
    check_reward_components(cfg, needs)
    check_distill_task_coef(cfg)
    if recipe is not None:
        check_recipe_serves(cfg, recipe, needs)
    has_critic = recipe is not None and recipe.batch_fields is not None and "values" in recipe.batch_fields
    if "values" in needs or has_critic:  # a critic-based run: check its section too
        check_critic_config(cfg)
        tp = (OmegaConf.to_container(cfg.strategy_args, resolve=True) or {}).get("tensor_parallel_size", 1)
        if tp != 1:
            raise ConfigError(f"{TP_KEY}={tp}: the critic (a value model, no vocabulary head) is not "
                              f"tensor-parallel yet; train this recipe with {TP_KEY}=1")
    chainable = ["rl", *(n for n, e in registry.entries["stage"].items() if e.obj.chainable)]
    valid = sorted(recipe.stage_types) if recipe is not None and recipe.stage_types is not None else sorted(chainable)
    lent = dict(recipe.stage_recipes) if recipe is not None else {}
    for i, stage in enumerate(cfg.stages):
        if stage.type not in valid:
            runs = f" for recipe '{recipe.name}'" if recipe is not None and recipe.stage_types is not None else ""
            rl = "" if "rl" in valid else (" (rl is the RL loop of `rltk run grpo` or `rltk run ppo`; name it grpo or "
                                           "ppo here)")
            raise ConfigError(
                f"bad value {stage.type!r} for 'stages[{i}].type' (stage '{stage.name}')."
                f"{did_you_mean(stage.type, valid)} Valid{runs}: {', '.join(valid)}{rl}"
            )
        spec = registry.entries["stage"].get(stage.type)
        if spec is not None and spec.obj.check is not None:  # the loop's own refusals, before any stage runs
            spec.obj.check_config(apply_overrides(cfg, dict(stage.overrides or {}),
                                                  f"stages[{i}].overrides (stage '{stage.name}')"))
        # a stage another recipe lends is checked against what that recipe's loop serves
        if stage.overrides or stage.type in lent:
            check_no_stage_lora(i, stage.name, stage.overrides or {})
            staged = apply_overrides(cfg, dict(stage.overrides or {}), f"stages[{i}].overrides (stage '{stage.name}')")
            staged.stages = []
            validate_config(staged, lent.get(stage.type, recipe))
    try:
        OmegaConf.resolve(OmegaConf.create(OmegaConf.to_container(cfg, resolve=False)))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"config interpolation failed at '{getattr(exc, 'full_key', '')}': {exc}") from exc


def _check_positive(cfg: DictConfig) -> None:
    rules = {
        "trainer.prompts_per_step": 1, "trainer.micro_batch_size": 1, "trainer.mini_batches": 1,
        "trainer.ppo_epochs": 1, "rollout.n": 1, "rollout.max_new_tokens": 1, "sft.batch_size": 1,
        "algorithm.dynamic_sampling_max_rounds": 1,
        "reward.workers": 1, "logging.traces_per_step": 1, "logging.traces_every": 1,
        "reward_model.batch_size": 1, "reward_model.max_length": 1, "reward_model.wrong_offset": 1,
        "reward_model.steps": 1, "reward_model.eval_every": 0,
    }
    for key, minimum in rules.items():
        value = OmegaConf.select(cfg, key)
        if value < minimum:
            raise ConfigError(f"bad value {value!r} for '{key}': must be >= {minimum}")
    if not 0 <= cfg.reward_model.wrong_length <= 1:
        raise ConfigError(f"bad value {cfg.reward_model.wrong_length!r} for 'reward_model.wrong_length': must be in "
                          f"[0, 1], the fraction of synthetic pairs whose rejected answer has a wrong length")
    if cfg.sft.eval_every is not None and cfg.sft.eval_every < 0:
        raise ConfigError(f"bad value {cfg.sft.eval_every!r} for 'sft.eval_every': must be >= 0 (0 or null: no "
                          f"held-out evaluation during the stage)")
    for section, total in (("trainer", "total_steps"), ("sft", "steps"), ("reward_model", "steps")):
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
    sample_s = OmegaConf.select(cfg, "reward.reward_fn_args.code_execution.sample_timeout_s")
    if ("code_execution" in cfg.reward.reward_fn and cfg.reward.timeout_s is not None
            and isinstance(sample_s, (int, float)) and sample_s + 2 > cfg.reward.timeout_s):
        # The composer would kill the sample before the sandbox reports, losing the per-reason counts.
        raise ConfigError(
            f"bad value {sample_s!r} for 'reward.reward_fn_args.code_execution.sample_timeout_s': must be at least "
            f"2 s (the sandbox's setup) under 'reward.timeout_s'={cfg.reward.timeout_s}, which otherwise kills the "
            f"sample first; lower it or raise reward.timeout_s"
        )
    if cfg.logging.traces_max_mb <= 0:
        raise ConfigError(f"bad value {cfg.logging.traces_max_mb!r} for 'logging.traces_max_mb': must be > 0 "
                          f"(MiB); to write no traces, set logging.traces=false")
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


# --------------------------------------------------------------------------
# trainer.mode and its keys: asynchronous training (issue 30)
# --------------------------------------------------------------------------


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _first_line(component) -> str:
    """The first line of a component's docstring, for messages that say what it is."""
    import inspect

    doc = (inspect.getdoc(component) or "no docstring").strip().splitlines()[0]
    return doc.rstrip(".")


def check_async_config(cfg: DictConfig, recipe=None, registry=None) -> None:
    """The asynchronous-training keys, and the modes the loop runs.

    ``trainer.max_staleness`` is an int >= 0, ``trainer.sync_every`` an int >= 1,
    ``trainer.producers`` an int >= 0 (other than 1 only in an asynchronous mode; 0: every producer is
    started by the user, ``rltk produce``),
    ``buffer.queue_timeout_s`` > 0 (``trainer.mode`` and ``trainer.stale_policy``
    are plain choices). ``one_step_off`` and ``async`` run in a recipe that
    declares them (its stages' ``provides["trainer_modes"]``: grpo, ppo, distill), with local producer
    processes on an engine whose class declares ``runs_in_producer`` (``hf``, ``vllm_server``, a plugin's
    server engine; the colocated ``vllm`` lives in the trainer's process); given ``servers`` of an engine
    that ``owns_servers`` take one producer; ``one_step_off`` is ``max_staleness=1``. The
    producer may sample only with weights at most ``max_staleness`` versions
    behind the step that will train on them, and it gets weights every
    ``sync_every`` steps, so ``sync_every`` must be at most ``max_staleness + 1``
    (else both sides would wait on each other until the timeout).
    ``registry``: where the engine's class is looked up (default the process's).
    """
    t = cfg.trainer
    if not (_is_int(t.max_staleness) and t.max_staleness >= 0):
        raise ConfigError(
            f"bad value {t.max_staleness!r} for 'trainer.max_staleness': must be an integer >= 0 (policy versions "
            f"a trained token may lag the trainer; 0 is on-policy)"
        )
    if not (_is_int(t.sync_every) and t.sync_every >= 1):
        raise ConfigError(
            f"bad value {t.sync_every!r} for 'trainer.sync_every': must be an integer >= 1 (RL steps "
            f"between weight syncs to the producers)"
        )
    producers = t.get("producers", 1)
    if not (_is_int(producers) and producers >= 0):
        raise ConfigError(
            f"bad value {producers!r} for 'trainer.producers': must be an integer >= 0 (local rollout producer "
            f"processes of trainer.mode=one_step_off or async; 0: only producers you start with `rltk produce`)")
    if producers != 1 and t.mode == "sync":
        raise ConfigError(
            f"bad value {producers!r} for 'trainer.producers' with trainer.mode=sync: producers (local or "
            f"started with `rltk produce`) run only in trainer.mode=one_step_off or async; set one of those, or "
            f"trainer.producers=1")
    timeout = cfg.buffer.queue_timeout_s
    if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and math.isfinite(timeout)
            and timeout > 0):
        raise ConfigError(f"bad value {timeout!r} for 'buffer.queue_timeout_s': must be a number of seconds > 0")
    if t.mode == "sync":
        return
    modes = getattr(recipe, "trainer_modes", None) if recipe is not None else None
    if recipe is not None and (modes is None or t.mode not in modes):
        runs = sorted(r.name for r in recipe.others if r.trainer_modes is not None and t.mode in r.trainer_modes)
        raise ConfigError(
            f"bad value {t.mode!r} for 'trainer.mode': the {recipe.name} recipe runs "
            f"{', '.join(sorted(modes or ['sync']))}" + (f"; {', '.join(runs)} runs {t.mode}" if runs else ""))
    engines = (registry or get_registry()).entries["rollout_engine"]
    engine = engines[cfg.rollout.engine].described  # the name was checked with the other components
    if not getattr(engine, "runs_in_producer", False):
        able = sorted(name for name, entry in engines.items() if getattr(entry.described, "runs_in_producer", False))
        raise ConfigError(
            f"bad value {cfg.rollout.engine!r} for 'rollout.engine' with trainer.mode={t.mode}: a producer process "
            f"samples only with engines that declare runs_in_producer, and {engine.__module__}.{engine.__qualname__} "
            f"does not ({_first_line(engine)}). Engines that do: {', '.join(able) or 'none'}; set one of those or "
            f"trainer.mode=sync")
    servers = OmegaConf.select(cfg, "rollout.engine_args.servers")
    if getattr(engine, "owns_servers", False) and servers and producers > 1:
        raise ConfigError(
            f"bad value {producers!r} for 'trainer.producers' with rollout.engine_args.servers: every producer "
            f"loads each weight version into its servers, so {producers} producers would load into the same "
            f"servers at once; use trainer.producers=1, or rollout.engine_args.launch (each producer its own)")
    if t.mode == "one_step_off" and t.max_staleness != 1:
        raise ConfigError(
            f"bad value {t.max_staleness!r} for 'trainer.max_staleness' with trainer.mode=one_step_off: that mode "
            f"is max_staleness=1 (step t trains on policy t-1's rollouts); for another bound use trainer.mode=async")
    if t.sync_every > t.max_staleness + 1:
        raise ConfigError(
            f"bad value {t.sync_every!r} for 'trainer.sync_every': with trainer.max_staleness={t.max_staleness} it "
            f"must be at most {t.max_staleness + 1} (the producer may not sample with weights older than that, "
            f"and gets new ones only every sync_every steps)")


# --------------------------------------------------------------------------
# model.tiny.vision and vision-language policies: whether the configured policy is a VLM (the tiny
# section, or model.path's config.json), and whether the rest of the config can run one
# --------------------------------------------------------------------------

#: Rollout engines that generate with a VLM's images (the others take token ids only): ``vllm`` passes them as
#: vLLM's multimodal inputs (rltk.rollout.vllm_vision); ``vllm_server``'s requests carry token ids only so far.
VISION_ENGINES = ("hf", "vllm")


def policy_is_vlm(cfg: DictConfig) -> tuple[bool, str]:
    """``(is a vision-language model, how a message names the policy)`` from the config alone."""
    if not cfg.model.path:
        depth = cfg.model.tiny.vision.depth
        return bool(depth), f"the tiny VLM (model.tiny.vision.depth={depth})"
    config_file = Path(cfg.model.path).expanduser() / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return False, f"model.path='{cfg.model.path}' (no readable config.json)"
    return "vision_config" in config, f"model.path='{cfg.model.path}' ({config.get('model_type', 'unknown')})"


def check_vision_config(cfg: DictConfig) -> None:
    """The tiny VLM's sizes; a VLM needs a rollout engine that passes images, and the tiny VLM is dense."""
    tiny = cfg.model.tiny
    if not cfg.model.path and tiny.vision.depth:
        step = 28
        if tiny.vision.depth < 0 or tiny.vision.image_size < step or tiny.vision.image_size % step:
            raise ConfigError(
                f"model.tiny.vision: depth={tiny.vision.depth}, image_size={tiny.vision.image_size}: depth >= 0 "
                f"(0: a text-only model) and image_size a positive multiple of {step} (patch 14 x merge 2), e.g. 56")
        if tiny.moe.num_experts:
            raise ConfigError(
                f"model.tiny.vision.depth={tiny.vision.depth} with model.tiny.moe.num_experts="
                f"{tiny.moe.num_experts}: the tiny VLM is a dense Qwen2.5-VL; set one of them to 0")
    vlm, described = policy_is_vlm(cfg)
    if vlm and cfg.rollout.engine not in VISION_ENGINES:
        raise ConfigError(
            f"bad value '{cfg.rollout.engine}' for 'rollout.engine' with a vision-language policy ({described}): "
            f"rltk passes images to {', '.join(VISION_ENGINES)} only (vllm_server's requests do not carry images "
            f"yet); set rollout.engine=hf or rollout.engine=vllm")
    if vlm and cfg.trainer.pack_sequences:
        # measured on the tiny VLM: text-only rows packed come out up to 0.4 nats off the padded pass (a text
        # model's agree to 5e-7), so no row of a VLM packs, with images or without
        raise ConfigError(f"trainer.pack_sequences=true with a vision-language policy ({described}): a VLM's "
                          f"packed rows do not score as their padded rows do (its multimodal positions are not "
                          f"per packed sequence); set trainer.pack_sequences=false")
    tp = (OmegaConf.to_container(cfg.strategy_args, resolve=True) or {}).get("tensor_parallel_size", 1)
    if vlm and tp != 1:
        # the trainer scores the softmax without the image/video tokens (rltk.kernels.excluded_tokens), which
        # reads their rows of the head; a vocabulary-parallel head holds them on one rank only
        raise ConfigError(f"{TP_KEY}={tp} with a vision-language policy ({described}): a VLM is not "
                          f"tensor-parallel yet (its log-probs exclude the image tokens, whose head rows a "
                          f"vocabulary-sharded head splits across ranks); train it with {TP_KEY}=1")


# --------------------------------------------------------------------------
# The run: the seed's range, the local paths it reads, the prompt template
# --------------------------------------------------------------------------


SEED_MAX = 2**32 - 1


def check_seed(cfg: DictConfig) -> None:
    """The seed is one numpy's global seed takes: 0 .. 2**32 - 1 (it refuses anything else at the start of a run)."""
    if isinstance(cfg.seed, bool) or not 0 <= cfg.seed <= SEED_MAX:
        raise ConfigError(f"bad value {cfg.seed!r} for 'seed': must be an integer in [0, 2**32 - 1 = {SEED_MAX}]")


def check_paths(cfg: DictConfig) -> None:
    """Local paths the run reads exist, and model folders are folders with a config.json."""
    path = cfg.model.path
    if path:
        problem = model_folder_problem(path, "a Hugging Face model folder with config.json, weights and tokenizer files")
        if problem is None and not (Path(path).expanduser() / "config.json").is_file():
            problem = "not a Hugging Face model folder (no config.json in it)"
        if problem is not None:
            raise ConfigError(f"bad value '{path}' for 'model.path': {problem}; or leave model.path null for the "
                              f"embedded tiny model")
    start = OmegaConf.select(cfg, "checkpoint.start_from")
    if start and not (Path(start).expanduser() / "state.json").is_file():
        raise ConfigError(
            f"bad value '{start}' for 'checkpoint.start_from': not a complete rltk checkpoint (no state.json in it); "
            f"give the step_XXXXXX folder that ends a stage of another run (<output_dir>/checkpoints)"
        )
    for key in ("data.path", "data.eval_path", "buffer.expert.path"):
        value = OmegaConf.select(cfg, key)
        if value and not Path(value).expanduser().exists():
            raise ConfigError(
                f"bad value '{value}' for '{key}': no such file or folder. rltk reads local datasets only "
                f"(json, jsonl, parquet, csv, or a datasets folder)"
            )


def check_prompt_template(cfg: DictConfig) -> None:
    """``data.prompt_template`` names plain fields only (see :mod:`rltk.data.templates`)."""
    try:
        template_fields(cfg.data.prompt_template, "data.prompt_template")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


# --------------------------------------------------------------------------
# guard: the divergence guard (rltk/training/scaffold/guard.py)
# --------------------------------------------------------------------------


def check_guard(cfg: DictConfig) -> None:
    """Counts are whole numbers >= 0 (patience >= 1) and ``0 <= entropy_min < entropy_max <= 1``."""
    g = cfg.guard
    for key, minimum in (("max_skipped_steps", 0), ("entropy_patience", 1), ("check_weights_every", 0)):
        value = g[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            off = " (0 turns this check off)" if minimum == 0 else ""
            raise ConfigError(f"bad value {value!r} for 'guard.{key}': must be an integer >= {minimum}{off}")
    low, high = g.entropy_min, g.entropy_max
    for key, value in (("entropy_min", low), ("entropy_max", high)):
        if not math.isfinite(value) or not 0 <= value <= 1:
            raise ConfigError(
                f"bad value {value!r} for 'guard.{key}': must be in [0, 1], a fraction of log(vocabulary size) "
                f"(1 is the uniform distribution's entropy, 0 a single token's)"
            )
    if low >= high:
        raise ConfigError(
            f"bad values guard.entropy_min={low!r} >= guard.entropy_max={high!r}: the floor must be below the "
            f"ceiling (defaults 1e-4 and 0.999; 0 and 1 turn each off)"
        )


# --------------------------------------------------------------------------
# critic: for recipes that train a critic
# --------------------------------------------------------------------------


def check_critic_config(cfg: DictConfig) -> None:
    """Check the ``critic`` section against the trainer's; raise ConfigError naming the key.

    Checked here rather than in the schema because the rules relate keys of
    two sections and only recipes with a critic read them (validation runs it
    when the advantage estimator needs ``values`` or the recipe has a critic).
    """
    c, t = cfg.critic, cfg.trainer
    if c.model_path:
        folder = Path(c.model_path).expanduser()
        if not folder.is_dir():
            raise ConfigError(
                f"bad value '{c.model_path}' for 'critic.model_path': "
                f"{'it is a file, not' if folder.exists() else 'no such folder; expected'} a critic folder or a "
                f"Hugging Face causal-LM folder (null copies the policy's backbone)"
            )
    if not c.lr > 0:
        raise ConfigError(f"bad value {c.lr!r} for 'critic.lr': must be > 0 (e.g. 1e-4)")
    if c.value_clip is not None and not c.value_clip > 0:
        raise ConfigError(
            f"bad value {c.value_clip!r} for 'critic.value_clip': must be > 0 (in reward units, e.g. 0.2) or null "
            "for an unclipped value loss"
        )
    if not 0 <= c.warmup_steps < t.total_steps:
        raise ConfigError(
            f"bad value {c.warmup_steps!r} for 'critic.warmup_steps': must be in [0, trainer.total_steps="
            f"{t.total_steps}) so that the policy is updated at least once"
        )
    policy_steps = t.total_steps - c.warmup_steps
    if t.warmup_steps > policy_steps:
        raise ConfigError(
            f"bad value {t.warmup_steps!r} for 'trainer.warmup_steps': the policy trains for trainer.total_steps - "
            f"critic.warmup_steps = {policy_steps} steps, so its LR warm-up must be in [0, {policy_steps}]"
        )
    if not 0 <= c.lr_warmup_steps <= t.total_steps:
        raise ConfigError(
            f"bad value {c.lr_warmup_steps!r} for 'critic.lr_warmup_steps': must be in [0, trainer.total_steps="
            f"{t.total_steps}]"
        )
    if not c.head_init_std >= 0:
        raise ConfigError(f"bad value {c.head_init_std!r} for 'critic.head_init_std': must be >= 0 (0 = zero init)")


# --------------------------------------------------------------------------
# algorithm.rollout_correction: the rollout/trainer mismatch correction
# --------------------------------------------------------------------------


_CORRECTION_KEY = "algorithm.rollout_correction"


def check_rollout_correction_config(cfg: DictConfig) -> None:
    """Levels, thresholds and the mode combination; and that the correction has something to correct.

    With ``algorithm.use_rollout_logprobs=true`` the old log-probs *are* the
    rollout log-probs, every ratio is 1 and a correction would silently do
    nothing, so that combination is refused.
    """
    from rltk.algorithms.correction_settings import check_rollout_correction, correction_active

    settings = OmegaConf.to_container(OmegaConf.select(cfg, _CORRECTION_KEY), resolve=True)
    settings.pop("log_metrics", None)
    try:
        check_rollout_correction(settings, where=_CORRECTION_KEY)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if correction_active(settings) and cfg.algorithm.use_rollout_logprobs:
        on = ", ".join(f"{_CORRECTION_KEY}.{k}={settings[k]}" for k in ("tis", "mis", "rejection") if settings[k] is not None)
        raise ConfigError(
            f"{on} corrects between the trainer's old log-probs and the engine's, but "
            f"algorithm.use_rollout_logprobs=true makes them the same (every ratio would be 1). "
            f"Set algorithm.use_rollout_logprobs=false so the trainer recomputes the old log-probs, "
            f"or turn the correction off"
        )


def check_distill_task_coef(cfg: DictConfig) -> None:
    """``on_policy_distill``'s ``task_coef`` weighs the task reward's GRPO advantage added to the teacher's:
    a negative one would train away from the reward, so it is refused here, before the teacher and the
    student load, instead of at the first step."""
    if cfg.algorithm.advantage_fn != "on_policy_distill":
        return
    coef = OmegaConf.select(cfg, "algorithm.advantage_fn_args.task_coef")
    if coef is None:
        return
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef) or coef < 0:
        raise ConfigError(
            f"bad value {coef!r} for 'algorithm.advantage_fn_args.task_coef': must be a number >= 0 (0: the "
            f"teacher's per-token advantage alone; > 0 adds that many times the task reward's GRPO advantage)"
        )


# --------------------------------------------------------------------------
# reward: each reward function's own score, for an estimator that reads it (gdpo)
# --------------------------------------------------------------------------
# The recipes fill ``reward_components [B, K]`` from every experience's
# ``reward_details``, column ``k`` for the k-th name of ``reward.reward_fn``.
# Two configs cannot work, and are caught here before anything loads instead of
# at the first step: weights per column that do not match the reward functions,
# and expert data given one fixed score (``buffer.expert.score``), which carries
# no per-reward scores.


def check_reward_components(cfg: DictConfig, needs: frozenset[str]) -> None:
    """Raise ConfigError for a config the ``reward_components`` columns cannot serve (see the module)."""
    if "reward_components" not in needs:
        return
    names = list(cfg.reward.reward_fn)
    estimator = cfg.algorithm.advantage_fn
    weights = OmegaConf.select(cfg, "algorithm.advantage_fn_args.reward_weights")
    if weights is not None:
        if isinstance(weights, ListConfig):
            weights = OmegaConf.to_container(weights, resolve=True)
        if not isinstance(weights, list) or len(weights) != len(names):
            raise ConfigError(
                f"bad value {weights!r} for 'algorithm.advantage_fn_args.reward_weights': "
                f"'algorithm.advantage_fn'='{estimator}' weighs each reward function of reward.reward_fn {names}, "
                f"so give a list of {len(names)} numbers in that order (or leave it unset for all 1.0)"
            )
    expert = cfg.buffer.expert
    if expert.path and expert.score is not None:
        raise ConfigError(
            f"'buffer.expert.score'={expert.score} gives every expert response one score and no score per reward "
            f"function, which 'algorithm.advantage_fn'='{estimator}' needs (batch field reward_components, one "
            f"column per function of reward.reward_fn {names}); unset buffer.expert.score so that the reward "
            f"functions score the expert responses"
        )


# ---------------------------------------------------------------- strategy_args.tensor_parallel_size

#: the tiny section's names of the sizes (its vocabulary comes from the tokenizer: checked when the model is sharded)
TINY_SIZES = {"num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
              "intermediate_size": "intermediate_size"}


def check_tensor_parallel_config(cfg: DictConfig) -> None:
    """ConfigError naming ``strategy_args.tensor_parallel_size`` for a size that is not a whole number >= 1, or
    that does not divide the model's heads, KV heads, MLP width or vocabulary, or (under a launcher, ``WORLD_SIZE``
    set) the process count, or data ranks without FSDP2."""
    args = OmegaConf.to_container(cfg.strategy_args, resolve=True) or {}
    size = args.get("tensor_parallel_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"{TP_KEY}: {size!r} is not a whole number of ranks >= 1")
    if size == 1:
        return
    from rltk.models.lora import lora_enabled

    if lora_enabled(cfg.model.get("lora")):
        # peft wraps each projection the plan splits in a layer of its own (the plan's paths then name the
        # wrapper), and the adapter would need a split of its own: A whole and B by columns beside a
        # column-parallel weight, A by rows beside a row-parallel one
        raise ConfigError(f"{TP_KEY}={size} with model.lora: LoRA adapters are not tensor-parallel (their A and B "
                          "matrices are not split with the layers they adapt); train the adapters data-parallel "
                          f"({TP_KEY}=1, or strategy_args.fsdp=true to shard the frozen base), or set "
                          "model.lora.r=0 to train every weight")
    sizes, described = _model_sizes(cfg)
    check_tensor_parallel_sizes(sizes, size, described)
    world = os.environ.get("WORLD_SIZE")
    if world and world.isdigit():
        processes = int(world)
        if processes % size:
            raise ConfigError(f"{TP_KEY}={size} does not divide the {processes} processes of the run: launch a "
                              f"multiple of {size} processes")
        if processes > size and not args.get("fsdp", False):
            raise ConfigError(f"{TP_KEY}={size} over {processes} processes leaves {processes // size} data-parallel "
                              "ranks, which shard with FSDP2 on the 2-D mesh: set strategy_args.fsdp=true")


def _model_sizes(cfg: DictConfig) -> tuple[dict, str]:
    if not cfg.model.path:
        tiny = cfg.model.tiny
        return {name: tiny[key] for name, key in TINY_SIZES.items()}, "the tiny model (model.tiny)"
    config_file = Path(cfg.model.path).expanduser() / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return {}, f"model.path='{cfg.model.path}'"
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return text, f"model.path='{cfg.model.path}' ({text.get('model_type', 'unknown')})"
