"""Build a run's components from its config: policy and tokenizer, reward, sampling, training strategy.

Recipes call these so that each recipe script stays a readable loop; every
piece that is a registered component is looked up by its config name. The
run's rows are :mod:`rltk.training.scaffold.rows`; its folder and loggers
:mod:`rltk.training.scaffold.run_outputs`.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig, OmegaConf

import rltk
from rltk.config.merge import apply_overrides, stage_config  # noqa: F401  (stage_config moved to rltk.config, torch-free)
from rltk.errors import ConfigError
from rltk.rollout.base import RolloutEngine, SamplingParams
from rltk.workflows.base import Workflow

def args_of(cfg: DictConfig, key: str) -> dict:
    """The ``<key>_args`` mapping of a component key as a plain dict."""
    node = OmegaConf.select(cfg, key + "_args")
    return dict(OmegaConf.to_container(node, resolve=True)) if node is not None else {}




# ---------------------------------------------------------------- model

def build_tokenizer_and_policy(cfg: DictConfig):
    """The tokenizer and policy model: a local HF folder (``model.path``) or the embedded tiny model."""
    from rltk.models.activation_checkpointing import enable_activation_checkpointing
    from rltk.models.loading import ensure_pad_token, load_model, load_tokenizer
    from rltk.models.tiny import build_tiny_from_config

    if cfg.model.path:
        try:
            tokenizer = ensure_pad_token(load_tokenizer(cfg.model.path))
            model = load_model(cfg.model.path, dtype=cfg.model.dtype)
        except (OSError, ValueError) as exc:
            # A folder validation let through (it checks only config.json) that transformers cannot
            # read: missing weights or tokenizer, an unknown architecture. The user's to fix, not a crash.
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if "model.path" not in text:
                text = f"bad value '{cfg.model.path}' for 'model.path': cannot load it as a causal LM: {text}"
            raise ConfigError(text) from exc
    else:
        tokenizer, model = build_tiny_from_config(cfg.model.tiny, cfg.seed)
        model = model.to(getattr(torch, cfg.model.dtype))
    if cfg.model.freeze_vision_tower:
        from rltk.models.vision.tower import freeze_vision_tower

        freeze_vision_tower(model)
    if cfg.model.gradient_checkpointing:
        enable_activation_checkpointing(model)
    # from_pretrained hands back a model in eval mode, the tiny builder one in train mode; train both in
    # train mode. Transformers checkpoints activations only in train mode, so an eval-mode policy would
    # keep every activation with model.gradient_checkpointing=true. The no-grad passes (old and reference
    # log-probs, generation) switch to eval mode themselves and back.
    model.train()
    # LoRA (model.lora): the run trains adapters on this model, in every stage; checkpoints hold only
    # them, so the base weights must come out of this function the same way each time (they do:
    # model.path's folder, or the tiny model built from cfg.seed).
    from rltk.config.lora_checks import model_description
    from rltk.models.lora import apply_lora

    model = apply_lora(model, cfg.model.lora, model_desc=model_description(cfg))
    return tokenizer, model


def build_processor(cfg: DictConfig, tokenizer):
    """A vision-language policy's processor (image processor, placeholders, chat template), or None for a text policy.

    ``tokenizer`` is :func:`build_tokenizer_and_policy`'s; the tiny VLM's processor is built in code
    (:func:`rltk.models.tiny.build_tiny_processor`), a folder's loaded (:func:`rltk.models.loading.load_processor`).
    """
    from rltk.models.loading import is_vision_language_folder, load_processor
    from rltk.models.tiny import build_tiny_processor

    if not cfg.model.path:
        vision = cfg.model.tiny.vision
        return build_tiny_processor(tokenizer, vision.image_size) if vision.depth else None
    if not is_vision_language_folder(cfg.model.path):
        return None
    try:
        return load_processor(cfg.model.path, tokenizer)
    except (OSError, ValueError) as exc:
        raise ConfigError(str(exc).strip().splitlines()[0]) from exc


def save_tokenizer_folder(cfg: DictConfig, tokenizer, folder) -> None:
    """The run's tokenizer, and a VLM's processor (image processor config, chat template), into ``folder``:
    what ``rltk export`` copies beside the weights, so that the exported folder is a complete model folder."""
    processor = build_processor(cfg, tokenizer)
    if processor is not None:
        processor.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


# ---------------------------------------------------------------- components

def build_reward(cfg: DictConfig):
    """The weighted combination of ``reward.reward_fn`` with fallback, timeout and worker processes.

    The reward's worker processes (if any of its functions needs them) start on its first call;
    :func:`rltk.training.stages.run.finish_run` stops them.
    """
    from rltk.rewards.compose import build_reward_composer

    r = cfg.reward
    return build_reward_composer(
        list(r.reward_fn),
        weights=dict(OmegaConf.to_container(r.weights, resolve=True)),
        args=dict(OmegaConf.to_container(r.reward_fn_args, resolve=True)),
        fallback=r.fallback,
        timeout_s=r.timeout_s,
        workers=r.workers,
        stand_ins=reward_services(cfg),
    )


def reward_services(cfg: DictConfig) -> dict:
    """``launcher=ray``'s reward services (``launcher_args.rewards``), as the stand-ins that call them."""
    if cfg.get("launcher", "local") != "ray" or not (cfg.get("launcher_args") or {}).get("rewards"):
        return {}
    from rltk.config.launcher_checks import ray_launcher_settings
    from rltk.rewards.ray_service import RemoteReward

    settings = ray_launcher_settings(cfg)
    return {name: RemoteReward(name, run_name=str(cfg.name), namespace=settings.namespace,
                               replicas=service.replicas, timeout_s=service.timeout_s,
                               lookup_timeout_s=settings.placement_timeout_s)
            for name, service in settings.rewards.items()}


def build_workflow(cfg: DictConfig, policy, tokenizer):
    """The configured rollout workflow on an engine of ``rollout.engine`` sampling from ``policy``.

    The trainer builds one on its own policy; an asynchronous run's producer
    process (:mod:`rltk.training.rollouts.asynchronous.producer`) builds the same on its copy.
    """
    from rltk.config.components import signature_params

    engine_cls = rltk.get_component("rollout_engine", cfg.rollout.engine)
    engine = engine_cls(model=policy, tokenizer=tokenizer, **engine_processor(cfg, tokenizer, engine_cls),
                        **args_of(cfg, "rollout.engine"))
    workflow_cls = rltk.get_component("workflow", cfg.rollout.workflow)
    # A workflow that names `env` in its signature (multi_turn, agentic) gets the env section.
    named = signature_params(workflow_cls)[0]
    env = {"env": OmegaConf.to_container(cfg.env, resolve=True)} if "env" in named else {}
    # A workflow that names `processor` (single_turn) encodes a VLM's images with it (rltk.models.vision.inputs).
    processor = build_processor(cfg, tokenizer) if "processor" in named else None
    workflow = workflow_cls(
        engine=engine, tokenizer=tokenizer, reward=build_reward(cfg), sampling=sampling_params(cfg),
        **env, **({"processor": processor} if processor is not None else {}), **args_of(cfg, "rollout.workflow"))
    # The trainer relies on what the base classes declare (state_dict, close, samples_from_module ...).
    for key, built, base in (("rollout.engine", engine, RolloutEngine), ("rollout.workflow", workflow, Workflow)):
        if not isinstance(built, base):
            raise ConfigError(f"'{key}': {type(built).__module__}.{type(built).__name__} does not subclass "
                              f"{base.__module__}.{base.__name__}; a registered {key.split('.')[1]} must, so the "
                              f"trainer can rely on what the base class declares")
    return workflow


def engine_processor(cfg: DictConfig, tokenizer, engine_cls) -> dict:
    """``{"processor": ...}`` for an engine that names ``processor`` (``vllm``: vLLM preprocesses a VLM's images
    with it) when the policy is a VLM; else nothing."""
    from rltk.config.components import signature_params

    if "processor" not in signature_params(engine_cls)[0]:
        return {}
    processor = build_processor(cfg, tokenizer)
    return {"processor": processor} if processor is not None else {}


def trainer_workflow_config(cfg: DictConfig) -> DictConfig:
    """The config the trainer builds its own workflow from (its evaluations; all rollouts in ``sync``).

    In ``trainer.mode`` ``one_step_off`` / ``async`` with an engine that declares ``owns_servers``
    (``vllm_server``, a plugin's server engine) the servers belong to the producer process, which loads
    every published version into them (their weight labels are the trainer's versions); a second set launched for the trainer, or the same addresses
    loaded by both, would cost a server start or mix two version counts. The trainer evaluates with the
    ``hf`` engine on its own module instead (the same weights, sampled in its process).
    """
    if cfg.trainer.mode == "sync" or not rltk.get_component("rollout_engine", cfg.rollout.engine).owns_servers:
        return cfg
    out = cfg.copy()
    out.rollout.engine = "hf"
    out.rollout.engine_args = {}
    return out


def sampling_params(cfg: DictConfig, *, greedy: bool = False) -> SamplingParams:
    r = cfg.rollout
    if greedy:
        return SamplingParams(n=1, greedy=True, max_new_tokens=r.eval_max_new_tokens or r.max_new_tokens)
    return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_new_tokens)


def layout_of_run(cfg: DictConfig):
    """The :class:`~rltk.strategies.layout.ParallelLayout` of the run's ``strategy_args`` sizes over the launched
    processes, before any strategy exists; a size that does not divide the processes exits 2 here."""
    import os

    from rltk.strategies.layout import ParallelLayout

    return ParallelLayout.from_strategy_args(args_of(cfg, "strategy"), int(os.environ.get("WORLD_SIZE", "1")))


def data_rank_of_run(cfg: DictConfig) -> int:
    """This process's data rank under the run's ``strategy_args`` sizes, before any strategy exists: what seeds
    its sampling, so that the ranks of a sequence- or tensor-parallel group (one share of the rows) sample
    alike. The process rank when only data is split."""
    from rltk.distributed import process_rank

    return layout_of_run(cfg).data_rank(process_rank())


def build_strategy(cfg: DictConfig, model, *, lr: float, total_steps: int, warmup_steps: int,
                   lr_schedule: str):
    """The configured training strategy, set up with an optimizer and schedule for one stage."""
    strategy = rltk.get_component("training_strategy", cfg.strategy)(**args_of(cfg, "strategy"))
    t = cfg.trainer
    strategy.setup(model, lr=lr, total_steps=total_steps, weight_decay=t.weight_decay,
                   betas=tuple(t.betas), warmup_steps=warmup_steps, lr_schedule=lr_schedule,
                   min_lr_ratio=t.min_lr_ratio, grad_clip=t.grad_clip)
    return strategy


def samples_every_step(stage_type: str) -> bool:
    """Whether a stage of ``stage_type`` samples from the rollout workflow every step: ``rl`` (a recipe's RL
    loop) or a registered stage whose spec says so (:attr:`StageSpec.rl`)."""
    from rltk.registry import get_registry

    entry = get_registry().entries["stage"].get(stage_type)
    return stage_type == "rl" or (entry is not None and entry.obj.rl)
