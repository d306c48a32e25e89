"""Checks of the mixture-of-experts keys (``algorithm.routing_replay``, ``algorithm.router_aux_loss_coef``)
that need nothing loaded: whether the configured policy is an MoE (the tiny section, or ``model.path``'s
config.json), and whether the rollout engine and workflow carry routing to the trainer."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from rltk.errors import ConfigError

#: config.json keys whose positive value makes a model a mixture of experts (Qwen2/3-MoE, Mixtral, DeepSeek).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
#: Workflows whose experiences carry the engine's routing (``routed_experts``).
ROUTING_WORKFLOWS = ("single_turn",)


def policy_is_moe(cfg: DictConfig) -> tuple[bool, str]:
    """``(is an MoE, how a message names the policy)`` from the config alone."""
    if not cfg.model.path:
        experts = cfg.model.tiny.moe.num_experts
        return bool(experts), f"the tiny model with model.tiny.moe.num_experts={experts}"
    config_file = Path(cfg.model.path).expanduser() / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return False, f"model.path='{cfg.model.path}' (no readable config.json)"
    text = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    experts = max((int(text.get(key) or 0) for key in EXPERT_COUNT_KEYS), default=0)
    return experts > 0, f"model.path='{cfg.model.path}' ({text.get('model_type', 'unknown')}, {experts} experts)"


def check_moe_config(cfg: DictConfig, registry) -> None:
    """``routing_replay=rollout`` needs an MoE policy, an engine that returns routing, a workflow that keeps
    it, and no activation checkpointing; the load-balancing loss needs an MoE policy."""
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
    engine = registry.entries["rollout_engine"][cfg.rollout.engine].obj
    if not getattr(engine, "returns_routed_experts", False):
        able = sorted(name for name, entry in registry.entries["rollout_engine"].items()
                      if getattr(entry.obj, "returns_routed_experts", False))
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
