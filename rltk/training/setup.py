"""Build a run's pieces from its config: policy, data, reward, engine, loggers, checkpoints.

Recipes call these so that each recipe script stays a readable loop; every
piece that is a registered component is looked up by its config name.
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

import rltk
from rltk.config.errors import ConfigError
from rltk.config.merge import apply_overrides
from rltk.config.saved import config_to_record, config_yaml_to_record
from rltk.distributed import process_rank
from rltk.loggers.base import StageSpan, announce_stages
from rltk.rollout.base import SamplingParams

log = logging.getLogger("rltk")


def available_cores() -> int:
    """The CPU cores this process may run on: its affinity mask, capped by a cgroup v2 CPU quota
    (``/sys/fs/cgroup/cpu.max``, a container's ``--cpus``), which ``os.cpu_count()`` ignores."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):  # no cgroup v2 here, or a format this does not know: the mask alone
        pass
    return max(1, cores)


def limit_torch_threads() -> int:
    """Cap torch's intra-op threads at this process's share of the cores it may use; return the count.

    torch starts one thread per physical core of the machine, which under a CPU quota or an affinity
    mask, or with several training processes on one node (``LOCAL_WORLD_SIZE``), is more threads than
    cores: every parallel region then waits for a thread the scheduler has parked, and steps that take
    milliseconds take seconds. ``OMP_NUM_THREADS``, when set, is the user's choice and is left alone.
    """
    import os

    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    share = max(1, available_cores() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if torch.get_num_threads() > share:
        torch.set_num_threads(share)
    return torch.get_num_threads()


def args_of(cfg: DictConfig, key: str) -> dict:
    """The ``<key>_args`` mapping of a component key as a plain dict."""
    node = OmegaConf.select(cfg, key + "_args")
    return dict(OmegaConf.to_container(node, resolve=True)) if node is not None else {}


def stage_config(cfg: DictConfig, index: int) -> DictConfig:
    """The config of stage ``index``: the run config with that stage's overrides applied."""
    stage = cfg.stages[index]
    overrides = OmegaConf.to_container(stage.overrides, resolve=True) if stage.overrides else {}
    return apply_overrides(cfg, overrides, f"stages[{index}].overrides (stage '{stage.name}')")


# ---------------------------------------------------------------- model and data

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


def build_rows(cfg: DictConfig, tokenizer) -> tuple[list[dict], list[dict]]:
    """Train and held-out rows in the standard form ``{prompt, ground_truth, extras, id}``.

    Data problems (a missing column, too few synthetic problems, an empty
    split) are config errors: they name the ``data.*`` key to change.
    """
    try:
        return _build_rows(cfg, tokenizer)
    except (ValueError, FileNotFoundError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"data: {exc}") from exc


def _build_rows(cfg: DictConfig, tokenizer) -> tuple[list[dict], list[dict]]:
    from rltk.data.loading import format_prompts, load_rows
    from rltk.data.synthetic import make_task

    d = cfg.data
    extras_keys = list(d.extras_keys) if d.extras_keys is not None else None
    if d.path:
        train = load_rows(d.path, split=d.split, prompt_key=d.prompt_key, answer_key=d.answer_key,
                          extras_keys=extras_keys, messages_key=d.messages_key)
        if d.eval_path:
            held_out = load_rows(d.eval_path, split=d.eval_split, prompt_key=d.prompt_key,
                                 answer_key=d.answer_key, extras_keys=extras_keys, messages_key=d.messages_key)
        else:  # carve a deterministic held-out slice off the training file
            order = list(range(len(train)))
            random.Random(cfg.seed).shuffle(order)
            n_eval = min(d.eval_size, max(1, len(train) // 10))
            held_out = [train[i] for i in order[:n_eval]]
            train = [train[i] for i in order[n_eval:]]
    elif d.task:
        task_args = dict(OmegaConf.to_container(d.task_args, resolve=True))
        train = make_task(d.task, "train", d.train_size, cfg.seed, **task_args)
        held_out = make_task(d.task, "heldout", d.eval_size, cfg.seed, **task_args)
    else:
        raise ConfigError("set either 'data.path' (a dataset file or folder) or 'data.task' (a synthetic task)")
    fmt = dict(system_prompt=d.system_prompt, use_chat_template=d.use_chat_template,
               prompt_template=d.prompt_template, max_prompt_tokens=d.max_prompt_tokens,
               on_too_long=d.on_too_long, tools=tool_schemas(cfg))
    return format_prompts(train, tokenizer, **fmt), format_prompts(held_out, tokenizer, **fmt)


def tool_schemas(cfg: DictConfig) -> list[dict] | None:
    """The OpenAI function schemas of ``env.tools`` (with ``env.tools_args``), as the chat template renders them.

    Prompts, demonstrations and multi-turn rollouts all render the same tool
    list, so the warm-up and RL see one prompt text. ``None`` without tools.
    """
    env = cfg.get("env")
    if env is None or not env.tools:
        return None
    from rltk.registry import get_registry

    tools_args = dict(OmegaConf.to_container(env.tools_args, resolve=True) or {})
    schemas = []
    for name in env.tools:
        base = get_registry().entry("tool", name, where="env.tools").obj
        try:
            schemas.append(base.bind(**dict(tools_args.get(name) or {})).schema())
        except ValueError as exc:
            raise ConfigError(f"env.tools_args.{name}: {exc}") from exc
    return schemas


def sft_pairs(rows: list[dict], tokenizer, completion_key: str | None = None, *,
              tools: list[dict] | None = None) -> list[tuple[list[int], list[int], list[int]]]:
    """``(prompt ids, response ids, loss mask)`` for supervised warm-up.

    A row with a demonstration transcript (``sft_messages``) is tokenized by
    :func:`rltk.data.chat.tokenize_transcript` (``tools`` rendered as in the
    rollout's prompts): the loss covers its assistant turns only, and the ids
    are those a multi-turn rollout of the same conversation builds. Any other
    row teaches one completion, all of it with eos: ``extras["solution"]``
    when the task provides one, else ``extras[completion_key]`` when
    configured, else the ground truth.
    """
    from rltk.data.chat import tokenize_transcript

    pairs = []
    for row in rows:
        extras = row.get("extras") or {}
        if row.get("sft_messages") and not completion_key:
            try:
                pairs.append(tokenize_transcript(row["sft_messages"], tokenizer, tools=tools))
            except ValueError as exc:
                raise ConfigError(f"row '{row.get('id')}': its demonstration (sft_messages) cannot be tokenized: "
                                  f"{exc}") from exc
            continue
        if completion_key:
            if completion_key not in extras:
                raise ConfigError(
                    f"sft.completion_key='{completion_key}' is not a column of row {row.get('id')}; "
                    f"available extras: {sorted(extras)} (add it to data.extras_keys)"
                )
            completion = str(extras[completion_key])
        else:
            completion = str(extras.get("solution", row["ground_truth"]))
        prompt_ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        pairs.append((prompt_ids, completion_ids, [1] * len(completion_ids)))
    return pairs


# ---------------------------------------------------------------- components

def build_reward(cfg: DictConfig):
    """The weighted combination of ``reward.reward_fn`` with fallback, timeout and worker processes.

    The reward's worker processes (if any of its functions needs them) start on its first call;
    :func:`rltk.training.run.finish_run` stops them.
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
    )


def sampling_params(cfg: DictConfig, *, greedy: bool = False) -> SamplingParams:
    r = cfg.rollout
    if greedy:
        return SamplingParams(n=1, greedy=True, max_new_tokens=r.eval_max_new_tokens or r.max_new_tokens)
    return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_new_tokens)


def build_strategy(cfg: DictConfig, model, *, lr: float, total_steps: int, warmup_steps: int,
                   lr_schedule: str):
    """The configured training strategy, set up with an optimizer and schedule for one stage."""
    strategy = rltk.get_component("training_strategy", cfg.strategy)(**args_of(cfg, "strategy"))
    t = cfg.trainer
    strategy.setup(model, lr=lr, total_steps=total_steps, weight_decay=t.weight_decay,
                   betas=tuple(t.betas), warmup_steps=warmup_steps, lr_schedule=lr_schedule,
                   min_lr_ratio=t.min_lr_ratio, grad_clip=t.grad_clip)
    return strategy


def build_loggers(cfg: DictConfig, run_dir: Path, total_steps: int, resume_step: int | None = None,
                  stages: list[StageSpan] | None = None) -> list:
    """The configured loggers; ``resume_step`` makes file loggers drop what was logged after it.

    ``stages`` (the run's stages as spans of global steps) reach the loggers
    that define ``set_stages``, e.g. the console, whose ETA is per stage.
    """
    container = config_to_record(cfg)  # loggers may upload it (W&B): no secret read from the environment
    loggers = []
    if process_rank() != 0:  # one set of curves per run, written by the main process
        return loggers
    for name in cfg.logging.logger:
        cls = rltk.get_component("logger", name)
        args = dict(OmegaConf.to_container(cfg.logging.logger_args, resolve=True)).get(name, {})
        logger = cls(run_dir=run_dir, config=container, total_steps=total_steps, resume_step=resume_step, **args)
        if stages:
            announce_stages(logger, stages)
        loggers.append(logger)
    return loggers


@dataclass
class MetricLog:
    """Fans metrics out to every logger and to the lifecycle hook."""

    loggers: list
    history: list[dict] = field(default_factory=list)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        rltk.call_lifecycle_hook("rltk_on_step_end", step=step, metrics=metrics)
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, np.floating, np.integer))}
        self.history.append({"step": step, **clean})
        for logger in self.loggers:
            logger.log(clean, step)

    def last(self, key: str) -> tuple[int, float] | None:
        """The latest ``(step, value)`` logged for ``key`` in this process, if any."""
        for entry in reversed(self.history):
            if key in entry:
                return entry["step"], entry[key]
        return None

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def prepare_run_dir(cfg: DictConfig, *, write_config: bool = True) -> Path:
    """Create the run folder and save the resolved config in it as ``config.yaml``.

    Values read from the environment (``${oc.env:...}``, often secrets) are
    saved as their interpolation, not their value (:mod:`rltk.config.saved`).

    Call it only once the run is known to be new or a compatible continuation
    (:func:`rltk.training.resume.resume_or_start_over`): a resumed run compares
    its config with this file. ``write_config=False`` leaves an existing one as it is.
    """
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if write_config:
        # Through a rename: other ranks may be reading the file to compare their config with it.
        temp = run_dir / ".config.yaml.tmp"
        temp.write_text(config_yaml_to_record(cfg))
        temp.replace(run_dir / "config.yaml")
    return run_dir


def write_summary(run_dir: Path, summary: dict) -> None:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
