"""Load, merge and validate run configs.

``load_config`` merges schema < preset < YAML files < ``key=value`` overrides;
``validate_config`` checks every component name against the registry and every
``*_args`` entry against the component's signature before anything heavy is
built. Every error is a :class:`ConfigError` naming the full key path, the bad
value and what would be valid.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Iterable

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rltk.config.schema import CHOICES, COMPONENT_KEYS, STAGE_TYPES, RunConfig
from rltk.registry import KINDS, RegistryError, closest, get_registry, unknown_name_message


class ConfigError(ValueError):
    """A config problem; the message names the key path, the value and what is valid."""


# ---------------------------------------------------------------- resolvers

def _number(x: Any) -> float | int:
    if isinstance(x, (int, float)):
        return x
    try:
        return int(x)
    except (TypeError, ValueError):
        return float(x)


def register_resolvers() -> None:
    """Arithmetic resolvers for derived values, e.g. ``${sub:${max_len},${prompt_len}}``."""
    resolvers = {
        "add": lambda *xs: sum(_number(x) for x in xs),
        "sub": lambda a, b: _number(a) - _number(b),
        "mul": lambda *xs: __import__("math").prod(_number(x) for x in xs),
        "div": lambda a, b: _number(a) / _number(b),
        "floordiv": lambda a, b: _number(a) // _number(b),
        "max": lambda *xs: max(_number(x) for x in xs),
        "min": lambda *xs: min(_number(x) for x in xs),
    }
    # omegaconf 2.4 renamed register_new_resolver and deprecated the old name.
    register = getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver
    for name, fn in resolvers.items():
        register(name, fn, replace=True)


register_resolvers()


# ---------------------------------------------------------------- loading

def _schema_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    if isinstance(node, DictConfig):
        for k in node.keys():
            path = f"{prefix}{k}"
            keys.append(path)
            child = node._get_node(k)
            if isinstance(child, DictConfig) and not path.endswith("_args") and path not in (
                "data.task_args", "reward.weights", "stages"
            ):
                keys.extend(_schema_keys(child, path + "."))
    return keys


_ALL_KEYS: list[str] | None = None


def all_keys() -> list[str]:
    """Every dotted key of the schema (for suggestions)."""
    global _ALL_KEYS
    if _ALL_KEYS is None:
        _ALL_KEYS = _schema_keys(OmegaConf.structured(RunConfig))
    return _ALL_KEYS


def _explain(exc: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(exc, "full_key", None) or ""
    msg = (getattr(exc, "msg", None) or str(exc)).strip().splitlines()[0]
    if "not in" in msg or "Key '" in msg and "not" in msg:
        # An unknown key: suggest the closest schema keys.
        suggestions = closest(key, all_keys(), n=3)
        hint = (" Did you mean: " + ", ".join(f"'{s}'" for s in suggestions) + "?") if suggestions else ""
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        siblings = [k.split(".")[-1] for k in all_keys() if (k.rsplit(".", 1)[0] if "." in k else "") == parent]
        return ConfigError(
            f"{source}: unknown config key '{key}'.{hint} Valid keys"
            f"{' under ' + repr(parent) if parent else ''}: {', '.join(sorted(siblings))}"
        )
    value = getattr(exc, "value", None)
    return ConfigError(f"{source}: bad value {value!r} for config key '{key}': {msg}")


def load_yaml(path: str | Path) -> DictConfig:
    """A YAML file as an OmegaConf node, with a clear error when it is missing or malformed."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        node = OmegaConf.load(path)
    except Exception as exc:  # yaml.YAMLError and friends
        raise ConfigError(f"config file '{path}' is not valid YAML: {exc}") from exc
    if not isinstance(node, DictConfig):
        raise ConfigError(f"config file '{path}' must hold a mapping at the top, got a list")
    return node


def parse_overrides(overrides: Iterable[str]) -> DictConfig:
    """``key=value`` strings as a config node (OmegaConf's dotlist grammar)."""
    overrides = list(overrides)
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(
                f"override '{item}' is not of the form key=value (e.g. algorithm.advantage_fn=rloo)"
            )
    try:
        return OmegaConf.from_dotlist(overrides)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"could not parse overrides {overrides}: {exc}") from exc


def _merge(base: DictConfig, node: DictConfig, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, node)
    except OmegaConfBaseException as exc:
        raise _explain(exc, source) from exc


def _preset(name: str, source: str) -> dict:
    try:
        preset = get_registry().entry("algorithm", name, where="algorithm.name").obj
    except RegistryError as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    return {k: v for k, v in dict(preset).items() if k != "description"}


def load_config(
    files: Iterable[str | Path] = (),
    overrides: Iterable[str] = (),
    *,
    validate: bool = True,
) -> DictConfig:
    """Build a run config: schema < preset < YAML ``files`` < ``overrides``.

    The preset is the one named by ``algorithm.name`` after the files and
    overrides are read, so ``algorithm.name=ppo`` on the command line switches
    every default the ``ppo`` preset sets, while anything the user set wins.
    """
    files = [Path(f) for f in files]
    user = OmegaConf.create({})
    sources = []
    for f in files:
        user = OmegaConf.merge(user, load_yaml(f))
        sources.append(str(f))
    cli = parse_overrides(overrides)
    source = " + ".join(sources + (["command line"] if list(overrides) else [])) or "defaults"

    schema = OmegaConf.structured(RunConfig)
    # Validate the user's keys against the schema first so a typo is reported
    # against its own source, not against the merged result.
    for f in files:
        _merge(schema, load_yaml(f), str(f))
    _merge(schema, cli, "command line")

    preset_name = OmegaConf.select(cli, "algorithm.name") or OmegaConf.select(user, "algorithm.name") \
        or schema.algorithm.name
    preset = _preset(preset_name, source)
    # A preset's arguments belong to the component it chose: swapping the component
    # (algorithm.advantage_fn=rloo on top of grpo) drops them rather than feeding
    # grpo's arguments to rloo.
    for key in [k for k in preset if not k.endswith("_args")]:
        chosen = OmegaConf.select(cli, f"algorithm.{key}") or OmegaConf.select(user, f"algorithm.{key}")
        if chosen is not None and chosen != preset[key]:
            preset.pop(f"{key}_args", None)
    cfg = _merge(schema, OmegaConf.create({"algorithm": preset}), f"preset '{preset_name}'")
    cfg = _merge(cfg, user, source)
    cfg = _merge(cfg, cli, "command line")
    if validate:
        validate_config(cfg)
    return cfg


def apply_overrides(cfg: DictConfig, overrides: dict[str, Any], source: str) -> DictConfig:
    """A copy of ``cfg`` with ``{dotted.key: value}`` applied (stage overrides)."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    schema = OmegaConf.structured(RunConfig)
    merged = _merge(schema, cfg, source)
    for key, value in overrides.items():
        if key not in all_keys() and not any(key.startswith(k + ".") for k in all_keys() if k.endswith("_args")):
            suggestions = closest(key, all_keys())
            hint = (" Did you mean: " + ", ".join(f"'{s}'" for s in suggestions) + "?") if suggestions else ""
            raise ConfigError(f"{source}: unknown config key '{key}'.{hint}")
        try:
            OmegaConf.update(merged, key, value, merge=True)
        except OmegaConfBaseException as exc:
            raise _explain(exc, source) from exc
    return merged


# ---------------------------------------------------------------- validation

def _signature_params(obj: Any) -> tuple[dict[str, inspect.Parameter], bool]:
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
    params, takes_kwargs = _signature_params(obj)
    configurable = sorted(n for n in params if n not in provided)
    for arg in args:
        if arg in provided:
            raise ConfigError(
                f"'{key}.{arg}': '{arg}' is filled in by rltk for a {kind}, not set in the config. "
                f"Configurable arguments of {kind} '{name}': {', '.join(configurable) or '(none)'}"
            )
        if arg not in params and not takes_kwargs:
            close = closest(str(arg), configurable)
            hint = (" Did you mean: " + ", ".join(f"'{c}'" for c in close) + "?") if close else ""
            raise ConfigError(
                f"'{key}.{arg}': {kind} '{name}' has no argument '{arg}'.{hint} "
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


def validate_config(cfg: DictConfig) -> None:
    """Check names, arguments and choices of a merged config; raise ConfigError on the first problem."""
    registry = get_registry()
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
    weights = OmegaConf.select(cfg, "reward.weights") or {}
    for w in weights:
        if w not in cfg.reward.reward_fn:
            raise ConfigError(
                f"'reward.weights.{w}': '{w}' is not selected in 'reward.reward_fn' "
                f"(selected: {', '.join(cfg.reward.reward_fn)})"
            )
    for key, choices in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in choices:
            close = closest(str(value), list(choices))
            hint = (" Did you mean: " + ", ".join(f"'{c}'" for c in close) + "?") if close else ""
            raise ConfigError(f"bad value {value!r} for '{key}'.{hint} Valid: {', '.join(choices)}")
    _check_positive(cfg)
    _check_task(cfg)
    advantage_fn = registry.entries["advantage_fn"][cfg.algorithm.advantage_fn].obj
    if "values" in inspect.signature(advantage_fn).parameters:  # a critic-based run: check its section too
        from rltk.training.ppo import check_critic_config

        check_critic_config(cfg)
    for i, stage in enumerate(cfg.stages):
        if stage.type not in STAGE_TYPES:
            raise ConfigError(
                f"bad value {stage.type!r} for 'stages[{i}].type' (stage '{stage.name}'). "
                f"Valid: {', '.join(STAGE_TYPES)}"
            )
        if stage.overrides:
            staged = apply_overrides(cfg, dict(stage.overrides), f"stages[{i}].overrides (stage '{stage.name}')")
            staged.stages = []
            validate_config(staged)
    try:
        OmegaConf.resolve(OmegaConf.create(OmegaConf.to_container(cfg, resolve=False)))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"config interpolation failed at '{getattr(exc, 'full_key', '')}': {exc}") from exc


def _check_task(cfg: DictConfig) -> None:
    """The synthetic task and its arguments, when no dataset path is given."""
    if cfg.data.path or not cfg.data.task:
        return
    from rltk.data.synthetic import TASKS

    if cfg.data.task not in TASKS:
        raise ConfigError(unknown_name_message("synthetic task", cfg.data.task, list(TASKS), where="data.task"))
    fn = TASKS[cfg.data.task]
    valid = [n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY]
    for arg in cfg.data.task_args or {}:
        if arg not in valid:
            close = closest(str(arg), valid)
            hint = (" Did you mean: " + ", ".join(f"'{c}'" for c in close) + "?") if close else ""
            raise ConfigError(
                f"'data.task_args.{arg}': task '{cfg.data.task}' has no argument '{arg}'.{hint} "
                f"Valid: {', '.join(valid)}"
            )


def _check_positive(cfg: DictConfig) -> None:
    rules = {
        "trainer.prompts_per_step": 1, "trainer.micro_batch_size": 1, "trainer.mini_batches": 1,
        "trainer.ppo_epochs": 1, "rollout.n": 1, "rollout.max_new_tokens": 1, "sft.batch_size": 1,
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
    if cfg.trainer.lr <= 0:
        raise ConfigError(f"bad value {cfg.trainer.lr!r} for 'trainer.lr': must be > 0")
    if cfg.rollout.temperature <= 0:
        raise ConfigError(
            f"bad value {cfg.rollout.temperature!r} for 'rollout.temperature': must be > 0 "
            f"(greedy decoding is used for evaluation automatically)"
        )
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"bad value {cfg.rollout.top_p!r} for 'rollout.top_p': must be in (0, 1]")
    batch = cfg.trainer.prompts_per_step * cfg.rollout.n
    if batch % cfg.trainer.mini_batches:
        raise ConfigError(
            f"trainer.mini_batches={cfg.trainer.mini_batches} must divide the rollout batch "
            f"trainer.prompts_per_step x rollout.n = {batch}"
        )
