"""The configured components: each name is registered, and its arguments fit its signature.

Covers every key of :data:`~rltk.config.schema.COMPONENT_KEYS` with its
``*_args``, the ``reward.weights`` of the chosen reward functions, and the
synthetic task (``data.task``) with its ``data.task_args``.
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from rltk.registration.source import Described
from rltk.config.schema import COMPONENT_KEYS
from rltk.errors import ConfigError
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


#: What each plain type is called in an error: what the person would type.
_TYPE_WORDS = {bool: "true or false", int: "a whole number", float: "a number", str: "a string",
               list: "a list", dict: "a mapping", type(None): "null"}
_TYPE_NAMES = {"bool": bool, "int": int, "float": float, "str": str, "None": type(None), "list": list,
               "tuple": list, "dict": dict, "Sequence": list, "Mapping": dict}


def _annotation_types(hint: Any) -> tuple[set[type], tuple] | None:
    """The plain types an annotation allows (``float | None`` -> {float, NoneType}) and a ``Literal``'s values;
    None when it is something a config value cannot be checked against (a tensor, a callable, ``Any``)."""
    if isinstance(hint, str):  # unresolved (a name only the module knows): read the simple spellings
        text = hint.replace(" ", "")
        optional = text.startswith("Optional[") and text.endswith("]")
        members = (text[9:-1] if optional else text).split("|") + (["None"] if optional else [])
        found = {_TYPE_NAMES.get(m.split("[")[0]) for m in members}
        return None if None in found else (found, ())
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return {type(v) for v in typing.get_args(hint)}, typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        out: set[type] = set()
        choices: tuple = ()
        for member in typing.get_args(hint):
            part = _annotation_types(member)
            if part is None:
                return None
            out |= part[0]
            choices += part[1]
        return out, choices
    if hint is None or hint is type(None):
        return {type(None)}, ()
    plain = origin or hint
    if plain in (list, tuple) or getattr(plain, "__name__", "") in ("Sequence", "Iterable"):
        return {list}, ()
    if plain is dict or getattr(plain, "__name__", "") in ("Mapping", "MutableMapping"):
        return {dict}, ()
    if plain in (bool, int, float, str):
        return {plain}, ()
    return None


def expected_types(obj: Any, param: inspect.Parameter) -> tuple[set[type], tuple] | None:
    """What a component's parameter accepts, from its annotation, else from its default's type; None when
    neither says (no annotation and a default of None, or a type a config cannot hold)."""
    hint = param.annotation
    if hint is not inspect.Parameter.empty:
        target = obj.__init__ if inspect.isclass(obj) else obj
        try:
            hint = typing.get_type_hints(target).get(param.name, hint)
        except Exception:  # a name the module imports only for type checkers: read the text instead
            pass
        allowed = _annotation_types(hint)
        if allowed is not None and param.default is None:
            allowed[0].add(type(None))
        return allowed
    default = param.default
    if default is inspect.Parameter.empty or default is None:
        return None
    if isinstance(default, bool):
        return {bool, type(None)}, ()
    if isinstance(default, (int, float)):  # an int default (gamma=1) still takes 0.99
        return {int, float}, ()
    if isinstance(default, str):
        return {str}, ()
    return None


def _fits(value: Any, allowed: set[type]) -> bool:
    if isinstance(value, bool):
        return bool in allowed
    if isinstance(value, int):
        return bool(allowed & {int, float})
    if isinstance(value, float):
        return float in allowed
    if isinstance(value, (list, tuple)):
        return list in allowed
    if isinstance(value, dict):
        return dict in allowed
    return type(value) in allowed


def _shown(value: Any) -> str:
    """A value as the config spells it: null, true, 0.5, 'abc'."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)


def check_arg_type(kind: str, name: str, obj: Any, param: inspect.Parameter, value: Any, key: str) -> None:
    """Raise ConfigError when a configured argument's value is not of the type its annotation (or default)
    says: ``eps: float`` refuses ``'abc'`` here, not at the first step after the whole warm-up."""
    expected = expected_types(obj, param)
    if expected is None:
        return
    allowed, choices = expected
    if choices and value not in choices and not (value is None and type(None) in allowed):
        valid = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"'{key}': bad value {_shown(value)} for argument '{param.name}' of {kind} '{name}'. "
                          f"Valid: {valid}{did_you_mean(str(value), [str(c) for c in choices])}")
    if choices or _fits(value, allowed):
        return
    if float in allowed:
        allowed = allowed - {int}
    words = " or ".join(_TYPE_WORDS.get(t, t.__name__) for t in sorted(allowed, key=lambda t: t is type(None)))
    default = "" if param.default is inspect.Parameter.empty else f"; default {_shown(param.default)}"
    raise ConfigError(f"'{key}': bad value {_shown(value)} for argument '{param.name}' of {kind} '{name}': "
                      f"must be {words}{default}")


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
    try:
        plain_args = OmegaConf.to_container(args, resolve=True) if isinstance(args, DictConfig) else dict(args)
    except Exception:  # an interpolation that does not resolve here is reported where it is resolved
        plain_args = {}
    # A function may check its arguments itself (ranges, how they go together, a template's fields): its
    # own ``check_args(args)`` raises ValueError saying what is wrong and what is valid. It goes first,
    # since it knows more than the annotation; a TypeError from it (a value of the wrong type it did not
    # expect) is left to the annotation check below, which names the argument and its type.
    is_function = inspect.isfunction(obj) or (isinstance(obj, Described) and obj.is_function)
    check = getattr(obj, "check_args", None) if is_function else None
    if callable(check):
        plain = OmegaConf.to_container(args, resolve=True) if isinstance(args, DictConfig) else dict(args)
        try:
            check(plain)
        except ValueError as exc:
            raise ConfigError(f"'{key}': {kind} '{name}': {exc}") from None
        except TypeError:
            pass
    for arg, value in plain_args.items():
        if arg in params:
            check_arg_type(kind, name, obj, params[arg], value, f"{key}.{arg}")


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
                check_component_args(kind, name, registry.entries[kind][name].described,
                                     (args or {}).get(name, {}), f"{key}_args.{name}")
        else:
            check_component_args(kind, names[0], registry.entries[kind][names[0]].described, args, key + "_args")
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
    declared = getattr(workflow.described, "component_args", None) if workflow is not None else None
    args = OmegaConf.select(cfg, "rollout.workflow_args") or {}
    for arg, kind in (declared or {}).items():
        if arg not in args or kind not in registry.entries:
            continue  # a missing required argument is reported against the workflow's signature
        name, key = args[arg], f"rollout.workflow_args.{arg}"
        table = registry.entries[kind]
        if not isinstance(name, str) or name not in table:
            raise ConfigError(unknown_name_message(kind, str(name), list(table), where=key))
        check_component_args(kind, name, table[name].described, args.get(f"{arg}_args"), f"{key}_args")


def check_task(cfg: DictConfig) -> None:
    """The synthetic task (a registered ``task``) and its arguments, when no dataset path is given."""
    if cfg.data.path or not cfg.data.task:
        return
    from rltk.data.synthetic import task_arguments
    from rltk.registry import get_registry

    table = get_registry().entries["task"]
    if cfg.data.task not in table:
        raise ConfigError(unknown_name_message("task", cfg.data.task, list(table), where="data.task"))
    valid, takes_any = task_arguments(table[cfg.data.task].described)
    for arg in cfg.data.task_args or {}:
        if arg not in valid and not takes_any:
            raise ConfigError(
                f"'data.task_args.{arg}': task '{cfg.data.task}' has no argument '{arg}'.{did_you_mean(arg, valid)} "
                f"Valid: {', '.join(valid)}"
            )
