"""The configured components: each name is registered, and its arguments fit its signature.

Covers every key of :data:`~rltk.config.schema.COMPONENT_KEYS` with its
``*_args``, the ``reward.weights`` of the chosen reward functions, and the
synthetic task (``data.task``) with its ``data.task_args``.
"""

from __future__ import annotations

import inspect
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from rltk.config.errors import ConfigError
from rltk.config.schema import COMPONENT_KEYS
from rltk.registry import KINDS, Registry, did_you_mean, unknown_name_message


def signature_params(obj: Any) -> tuple[dict[str, inspect.Parameter], bool]:
    """A component's named parameters (no ``self``, ``*args``, ``**kwargs``) and whether it takes ``**kwargs``.

    An object whose signature cannot be read gives ``({}, True)``: anything may be passed.
    """
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return {}, True
    params = {
        n: p for n, p in sig.parameters.items()
        if n not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    return params, takes_kwargs


def check_component_args(kind: str, name: str, obj: Any, args: Any, key: str) -> None:
    """Bind configured ``args`` to the component's signature; raise ConfigError if they do not fit."""
    if args is None:
        args = {}
    if not isinstance(args, (dict, DictConfig)):
        raise ConfigError(f"'{key}' must be a mapping of argument names to values, got {args!r}")
    provided = KINDS[kind].provided
    params, takes_kwargs = signature_params(obj)
    configurable = sorted(n for n in params if n not in provided)
    for arg in args:
        if arg in provided:
            raise ConfigError(
                f"'{key}.{arg}': '{arg}' is filled in by rltk for a {kind}, not set in the config. "
                f"Configurable arguments of {kind} '{name}': {', '.join(configurable) or '(none)'}"
            )
        if arg not in params and not takes_kwargs:
            raise ConfigError(
                f"'{key}.{arg}': {kind} '{name}' has no argument '{arg}'.{did_you_mean(arg, configurable)} "
                f"Valid: {', '.join(configurable) or '(none)'}"
            )
    missing = [
        n for n, p in params.items()
        if p.default is inspect.Parameter.empty and n not in provided and n not in args
    ]
    if missing:
        raise ConfigError(
            f"'{key}': {kind} '{name}' needs argument(s) {', '.join(missing)}; "
            f"set them as {key}.{missing[0]}=..."
        )
    # A function may check how its arguments go together (one of two, a template's fields): its own
    # ``check_args(args)`` raises ValueError saying what is wrong and what is valid.
    check = getattr(obj, "check_args", None) if inspect.isfunction(obj) else None
    if callable(check):
        plain = OmegaConf.to_container(args, resolve=True) if isinstance(args, DictConfig) else dict(args)
        try:
            check(plain)
        except ValueError as exc:
            raise ConfigError(f"'{key}': {kind} '{name}': {exc}") from None


def check_components(cfg: DictConfig, registry: Registry) -> None:
    """Every component key names a registered component; its ``*_args`` and ``reward.weights`` fit the choice."""
    for key, (kind, is_list) in COMPONENT_KEYS.items():
        value = OmegaConf.select(cfg, key)
        names = list(value) if is_list else [value]
        if is_list and not isinstance(value, (list, ListConfig)):
            raise ConfigError(f"'{key}' must be a list of {kind} names, got {value!r}")
        for name in names:
            if not isinstance(name, str):
                raise ConfigError(f"'{key}' must name a registered {kind}, got {name!r}")
            table = registry.entries[kind]
            if name not in table:
                raise ConfigError(unknown_name_message(kind, name, list(table), where=key))
        if kind == "algorithm":
            continue
        args = OmegaConf.select(cfg, key + "_args")
        if is_list:
            for arg_name in (args or {}):
                if arg_name not in names:
                    raise ConfigError(
                        f"'{key}_args.{arg_name}': '{arg_name}' is not selected in '{key}' "
                        f"(selected: {', '.join(names)})"
                    )
            for name in names:
                check_component_args(kind, name, registry.entries[kind][name].obj,
                                     (args or {}).get(name, {}), f"{key}_args.{name}")
        else:
            check_component_args(kind, names[0], registry.entries[kind][names[0]].obj, args, key + "_args")
    check_agent(cfg, registry)
    weights = OmegaConf.select(cfg, "reward.weights") or {}
    for w in weights:
        if w not in cfg.reward.reward_fn:
            raise ConfigError(
                f"'reward.weights.{w}': '{w}' is not selected in 'reward.reward_fn' "
                f"(selected: {', '.join(cfg.reward.reward_fn)})"
            )


def check_agent(cfg: DictConfig, registry: Registry) -> None:
    """Workflow arguments that name components: ``rollout.workflow_args.<arg>`` of a workflow whose class
    declares ``component_args = {arg: kind}`` (the agentic workflow: ``{"agent": "agent"}``) names a
    registered component of that kind, which takes ``rollout.workflow_args.<arg>_args``."""
    workflow = registry.entries["workflow"].get(OmegaConf.select(cfg, "rollout.workflow"))
    declared = getattr(workflow.obj, "component_args", None) if workflow is not None else None
    args = OmegaConf.select(cfg, "rollout.workflow_args") or {}
    for arg, kind in (declared or {}).items():
        if arg not in args or kind not in registry.entries:
            continue  # a missing required argument is reported against the workflow's signature
        name, key = args[arg], f"rollout.workflow_args.{arg}"
        table = registry.entries[kind]
        if not isinstance(name, str) or name not in table:
            raise ConfigError(unknown_name_message(kind, str(name), list(table), where=key))
        check_component_args(kind, name, table[name].obj, args.get(f"{arg}_args"), f"{key}_args")


def check_task(cfg: DictConfig) -> None:
    """The synthetic task (a registered ``task``) and its arguments, when no dataset path is given."""
    if cfg.data.path or not cfg.data.task:
        return
    from rltk.data.synthetic import task_arguments
    from rltk.registry import get_registry

    table = get_registry().entries["task"]
    if cfg.data.task not in table:
        raise ConfigError(unknown_name_message("task", cfg.data.task, list(table), where="data.task"))
    valid, takes_any = task_arguments(table[cfg.data.task].obj)
    for arg in cfg.data.task_args or {}:
        if arg not in valid and not takes_any:
            raise ConfigError(
                f"'data.task_args.{arg}': task '{cfg.data.task}' has no argument '{arg}'.{did_you_mean(arg, valid)} "
                f"Valid: {', '.join(valid)}"
            )
