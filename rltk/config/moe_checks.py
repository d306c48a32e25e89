"""Checks of the mixture-of-experts keys (``algorithm.routing_replay``, ``algorithm.router_aux_loss_coef``,
``strategy_args.expert_parallel_size``) that need nothing loaded: whether the configured policy is an MoE (the
tiny section, or ``model.path``'s config.json), whether the rollout engine and workflow carry routing to the
trainer, and whether the experts split over the ranks asked for."""

from __future__ import annotations

import json
import os
from pathlib import Path

from omegaconf import DictConfig

from rltk.errors import ConfigError

#: config.json keys whose positive value makes a model a mixture of experts (Qwen2/3-MoE, Mixtral, DeepSeek).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
#: Workflows whose experiences carry the engine's routing (``routed_experts``).
ROUTING_WORKFLOWS = ("single_turn",)


def policy_is_moe(cfg: DictConfig) -> tuple[bool, str]:
    """``(is an MoE, how a message names the policy)`` from the config alone."""
    experts, described = policy_experts(cfg)
    return experts > 0, described


def policy_experts(cfg: DictConfig) -> tuple[int, str]:
    """``(experts per sparse layer, 0 for a dense model; how a message names the policy)`` from the config."""
    if not cfg.model.path:
        experts = cfg.model.tiny.moe.num_experts
        return int(experts or 0), f"the tiny model with model.tiny.moe.num_experts={experts}"
    config_file = Path(cfg.model.path).expanduser() / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return 0, f"model.path='{cfg.model.path}' (no readable config.json)"
    text = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    experts = max((int(text.get(key) or 0) for key in EXPERT_COUNT_KEYS), default=0)
    return experts, f"model.path='{cfg.model.path}' ({text.get('model_type', 'unknown')}, {experts} experts)"


def check_expert_parallel(cfg: DictConfig) -> None:
    """``strategy_args.expert_parallel_size`` > 1 needs the accelerate strategy without FSDP, an MoE policy
    whose experts it divides, and (under a launcher, which says the process count) a divisor of the ranks."""
    key = "strategy_args.expert_parallel_size"
    size = (cfg.get("strategy_args") or {}).get("expert_parallel_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"bad value {size!r} for '{key}': a whole number of ranks >= 1 (1: experts replicated)")
    if size == 1:
        return
    fsdp = bool(cfg.strategy_args.get("fsdp", False))
    if cfg.strategy != "accelerate" or fsdp:
        raise ConfigError(
            f"{key}={size} runs with strategy=accelerate and strategy_args.fsdp=false (DDP over the other "
            f"parameters), not with strategy={cfg.strategy}{', strategy_args.fsdp=true' if fsdp else ''}. Set "
            f"those, or {key}=1")
    experts, described = policy_experts(cfg)
    if not experts:
        raise ConfigError(
            f"{key}={size}: the policy is {described}, a dense model with no experts to split. Set {key}=1, or "
            "train a mixture of experts (model.tiny.moe.num_experts=8, or a model.path of an MoE model)")
    if experts % size:
        raise ConfigError(f"{key}={size} does not divide the {experts} experts per layer of {described}: choose "
                          f"a divisor of {experts}")
    world = int(os.environ.get("WORLD_SIZE", "0"))  # set by launchers (torchrun); 0: not launched yet
    if world and world % size:
        raise ConfigError(f"{key}={size} does not divide the {world} processes of this launch (WORLD_SIZE): "
                          f"launch a multiple of {size} processes")


def check_moe_config(cfg: DictConfig, registry) -> None:
    """``routing_replay=rollout`` needs an MoE policy, an engine that returns routing, a workflow that keeps
    it, and no activation checkpointing; the load-balancing loss needs an MoE policy."""
    check_expert_parallel(cfg)
    replay = cfg.algorithm.get("routing_replay", "none")
    aux = cfg.algorithm.get("router_aux_loss_coef", 0.0)
    if replay == "none" and not aux:
        return
    moe, described = policy_is_moe(cfg)
    key = f"algorithm.routing_replay={replay}" if replay != "none" else f"algorithm.router_aux_loss_coef={aux}"
    if not moe:
        raise ConfigError(
            f"{key} needs a mixture-of-experts policy, but the policy is {described}, a dense model. Set "
            f"model.tiny.moe.num_experts=8 (the tiny MoE) or a model.path of an MoE model, or leave "
            f"algorithm.routing_replay=none and algorithm.router_aux_loss_coef=0")
    if aux < 0:
        raise ConfigError(f"bad value {aux} for 'algorithm.router_aux_loss_coef': a weight >= 0 (0: off)")
    if replay == "none":
        return
    engine = registry.entries["rollout_engine"][cfg.rollout.engine].described
    if not getattr(engine, "returns_routed_experts", False):
        able = sorted(name for name, entry in registry.entries["rollout_engine"].items()
                      if getattr(entry.described, "returns_routed_experts", False))
        raise ConfigError(
            f"{key}: rollout engine '{cfg.rollout.engine}' (rollout.engine) does not return the experts each "
            f"token was routed to. Engines that do: {', '.join(able) or 'none'}; or set algorithm.routing_replay=none")
    if cfg.rollout.workflow not in ROUTING_WORKFLOWS:
        raise ConfigError(
            f"{key}: rollout.workflow='{cfg.rollout.workflow}' does not carry the engine's routing into its "
            f"experiences; routing replay runs with rollout.workflow={' or '.join(ROUTING_WORKFLOWS)}")
    if cfg.model.gradient_checkpointing:
        raise ConfigError(
            f"{key} with model.gradient_checkpointing=true: the backward recomputes each layer outside the "
            f"replayed forward, with the router's own top-k. Turn one of them off")
