"""Load, merge and validate run configs.

``load_config`` merges schema < preset < YAML files < ``key=value`` overrides;
``validate_config`` checks every component name against the registry and every
``*_args`` entry against the component's signature before anything heavy is
built, and, given the recipe's :class:`RecipeSpec`, that the recipe can serve
the chosen components. Every error is a :class:`ConfigError` naming the full
key path, the bad value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rltk.config.schema import CHOICES, COMPONENT_KEYS, STAGE_TYPES, RunConfig
from rltk.registry import KINDS, RegistryError, closest, get_registry, unknown_name_message


class ConfigError(ValueError):
    """A config problem; the message names the key path, the value and what is valid."""


@dataclass(frozen=True)
class RecipeSpec:
    """What a recipe serves its components, so validation can refuse one it cannot feed.

    A recipe script declares it as a module-level ``PROVIDES`` literal (read
    without running the script, see :func:`rltk.recipe_utils.recipe_spec`).
    ``None`` means "not declared": nothing is checked against it.

    Attributes:
        name: the recipe's name (its script's stem), for messages.
        batch_fields: the batch fields its advantage step hands the estimator
            (an estimator that needs ``values`` needs a recipe with a critic).
        buffer_sources: the buffer sources it puts experiences in (``policy``;
            a sample strategy that reads ``expert`` needs a recipe that fills it).
        others: the specs of sibling recipes, to suggest one that serves what is missing.
    """

    name: str
    batch_fields: frozenset[str] | None = None
    buffer_sources: frozenset[str] | None = None
    others: tuple["RecipeSpec", ...] = ()


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


def _str_list_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Dotted keys of the schema typed ``List[str]`` (optional or not)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) is typing.Union and len(args) == 1:  # Optional[X]
            hint = args[0]
        if dataclasses.is_dataclass(hint):
            keys.extend(_str_list_keys(hint, f"{prefix}{f.name}."))
        elif typing.get_origin(hint) is list and typing.get_args(hint) == (str,):
            keys.append(f"{prefix}{f.name}")
    return keys


#: Keys that take a list of names; a single name given for one is read as a one-element list.
STR_LIST_KEYS = tuple(_str_list_keys())


def _one_name_as_list(node: DictConfig) -> DictConfig:
    """``reward.reward_fn: exact_match`` as ``[exact_match]``, for every ``List[str]`` key of ``node``.

    Done before merging, where OmegaConf would otherwise refuse a string for a
    list with a message about its internal node types. An interpolation
    (``${...}``) is left alone: it may resolve to a whole list.
    """
    for key in STR_LIST_KEYS:
        try:
            value = OmegaConf.select(node, key)
        except OmegaConfBaseException:  # a parent that is not a mapping: the merge reports it
            continue
        if isinstance(value, str) and "${" not in value:
            OmegaConf.update(node, key, [value], merge=False)
    return node


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
    recipe: RecipeSpec | None = None,
    warn: bool = True,
) -> DictConfig:
    """Build a run config: schema < preset < YAML ``files`` < ``overrides``.

    The preset is the one named by ``algorithm.name`` after the files and
    overrides are read, so ``algorithm.name=ppo`` on the command line switches
    every default the ``ppo`` preset sets, while anything the user set wins.

    ``recipe``, when known (``rltk run RECIPE``, ``rltk validate RECIPE``), lets
    validation refuse components that recipe cannot serve. ``warn`` prints
    settings that take no effect (e.g. a KL estimator with ``kl_coef`` 0) to
    stderr, one line each.
    """
    files = [Path(f) for f in files]
    file_nodes = [(str(f), _one_name_as_list(load_yaml(f))) for f in files]
    user = OmegaConf.create({})
    for _, node in file_nodes:
        user = OmegaConf.merge(user, node)
    overrides = list(overrides)
    cli = _one_name_as_list(parse_overrides(overrides))
    source = " + ".join([name for name, _ in file_nodes] + (["command line"] if overrides else [])) or "defaults"

    schema = OmegaConf.structured(RunConfig)
    # Validate the user's keys against the schema first so a typo is reported
    # against its own source, not against the merged result.
    for name, node in file_nodes:
        _merge(schema, node, name)
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
        validate_config(cfg, recipe=recipe)
    if warn:
        for message in kl_warnings(cfg, [("command line", cli), *reversed(file_nodes)], preset_name, preset):
            print(f"rltk: warning: {message}", file=sys.stderr)
    return cfg


# The KL settings that only matter when a KL penalty is applied (algorithm.kl_coef > 0).
_KL_KEYS = ("kl_penalty_fn", "kl_in", "kl_controller", "kl_target")


def kl_warnings(cfg: DictConfig, user_nodes: list[tuple[str, DictConfig]], preset_name: str,
                preset: dict) -> list[str]:
    """Messages for KL settings the user gave that do nothing because ``algorithm.kl_coef`` is 0.

    ``user_nodes`` are ``(source, node)`` of what the user wrote, highest
    precedence first (command line, then files from last to first). With
    ``kl_coef`` 0 the recipes never build the reference model, so a KL
    estimator, its placement and its controller are silently unused; the same
    holds for a preset chosen by the user that puts the KL in the reward.
    Stages that set their own ``algorithm.kl_coef`` above 0 count as using it.
    """
    coefs = [cfg.algorithm.kl_coef] + [
        stage.overrides["algorithm.kl_coef"] for stage in cfg.stages
        if stage.overrides and "algorithm.kl_coef" in stage.overrides
    ]
    if any(c != 0 for c in coefs):
        return []

    def origin(key: str) -> str | None:
        for name, node in user_nodes:
            if OmegaConf.select(node, key) is not None:
                return name
        return None

    given = []
    for key in _KL_KEYS:
        where = origin(f"algorithm.{key}")
        if where is not None:
            given.append(f"algorithm.{key}={OmegaConf.select(cfg, f'algorithm.{key}')} ({where})")
    where = origin("algorithm.name")
    if where is not None and preset.get("kl_in") == "reward" and origin("algorithm.kl_in") is None:
        given.append(f"the {preset.get('kl_penalty_fn')} KL in the reward of algorithm.name={preset_name} ({where})")
    if not given:
        return []
    coef_from = origin("algorithm.kl_coef") or (f"preset '{preset_name}'" if "kl_coef" in preset else "the default")
    return [
        f"KL setting(s) without effect: {'; '.join(given)}. algorithm.kl_coef is 0 (from {coef_from}), so no KL "
        f"penalty is computed; set algorithm.kl_coef to a positive value (e.g. algorithm.kl_coef=0.01) to use it"
    ]


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
        if key in STR_LIST_KEYS and isinstance(value, str) and "${" not in value:
            value = [value]  # one name for a list key, as in files and on the command line
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


def validate_config(cfg: DictConfig, recipe: RecipeSpec | None = None) -> None:
    """Check names, arguments and choices of a merged config; raise ConfigError on the first problem.

    Also checks what can be checked without loading anything: the seed's range,
    that configured paths exist (model folders are folders), and, when the
    ``recipe`` is known, that it serves the chosen components (an advantage
    estimator's batch fields, a sample strategy's buffer sources).
    """
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
    _check_seed(cfg)
    _check_paths(cfg)
    _check_task(cfg)
    needs = required_batch_fields(registry.entries["advantage_fn"][cfg.algorithm.advantage_fn].obj)
    if recipe is not None:
        _check_recipe_serves(cfg, recipe, needs)
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
            staged = apply_overrides(cfg, dict(stage.overrides), f"stages[{i}].overrides (stage '{stage.name}')")
            staged.stages = []
            validate_config(staged, recipe)
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


#: The largest seed numpy and torch both accept.
SEED_MAX = 2**32 - 1


def _check_seed(cfg: DictConfig) -> None:
    # numpy's global seed takes 0 .. 2**32 - 1 and refuses anything else at the start of a run.
    if isinstance(cfg.seed, bool) or not 0 <= cfg.seed <= SEED_MAX:
        raise ConfigError(f"bad value {cfg.seed!r} for 'seed': must be an integer in [0, 2**32 - 1 = {SEED_MAX}]")


def _check_paths(cfg: DictConfig) -> None:
    """Local paths the run reads exist, and model folders are folders with a config.json."""
    path = cfg.model.path
    if path:
        folder = Path(path).expanduser()
        if not folder.exists():
            raise ConfigError(
                f"bad value '{path}' for 'model.path': the folder does not exist. rltk loads models from local "
                f"folders only; download one first (e.g. `huggingface-cli download <repo> --local-dir <folder>`) "
                f"and set model.path=<folder>, or leave model.path null for the embedded tiny model"
            )
        if not folder.is_dir():
            raise ConfigError(
                f"bad value '{path}' for 'model.path': it is a file, not a model folder (expected a Hugging Face "
                f"model folder with config.json, weights and tokenizer files)"
            )
        if not (folder / "config.json").is_file():
            raise ConfigError(
                f"bad value '{path}' for 'model.path': not a Hugging Face model folder (no config.json in it)"
            )
    for key in ("data.path", "data.eval_path"):
        value = OmegaConf.select(cfg, key)
        if value and not Path(value).expanduser().exists():
            raise ConfigError(
                f"bad value '{value}' for '{key}': no such file or folder. rltk reads local datasets only "
                f"(json, jsonl, parquet, csv, or a datasets folder)"
            )


def required_batch_fields(advantage_fn: Any) -> frozenset[str]:
    """The batch fields an advantage estimator cannot run without: its required parameters that are batch fields.

    An estimator declares what it needs by naming batch fields in its
    signature; a field with a default is optional, so it is not required here.
    """
    params, _ = _signature_params(advantage_fn)
    return frozenset(
        n for n, p in params.items()
        if p.default is inspect.Parameter.empty and n in KINDS["advantage_fn"].provided
    )


def _check_recipe_serves(cfg: DictConfig, recipe: RecipeSpec, needs: frozenset[str]) -> None:
    """The recipe fills the batch fields the advantage estimator needs and the buffer sources the strategy reads."""
    registry = get_registry()
    if recipe.batch_fields is not None and not needs <= recipe.batch_fields:
        missing = sorted(needs - recipe.batch_fields)
        name = cfg.algorithm.advantage_fn
        preset = registry.entries["algorithm"][cfg.algorithm.name].obj
        via = (f" (the advantage_fn of algorithm.name='{cfg.algorithm.name}')"
               if dict(preset).get("advantage_fn") == name else "")
        servers = [r.name for r in recipe.others if r.batch_fields is not None and needs <= r.batch_fields]
        fits = sorted(
            n for n, e in registry.entries["advantage_fn"].items()
            if required_batch_fields(e.obj) <= recipe.batch_fields
        )
        where = f"`rltk run {servers[0]}`" if servers else "a recipe that provides it"
        raise ConfigError(
            f"'algorithm.advantage_fn'='{name}'{via} needs batch field(s) {', '.join(map(repr, missing))}, which "
            f"recipe '{recipe.name}' does not provide"
            f"{' (it trains no critic)' if 'values' in missing else ''}. Use {where}, or an advantage_fn "
            f"that recipe '{recipe.name}' can serve: {', '.join(fits)}"
        )
    if recipe.buffer_sources is None:
        return
    name = cfg.buffer.sample_strategy
    cls = registry.entries["sample_strategy"][name].obj
    reads = getattr(cls, "buffer_sources", None)
    if not callable(reads):
        return
    args = dict(OmegaConf.to_container(cfg.buffer.sample_strategy_args, resolve=True) or {})
    try:
        sources = frozenset(reads(**args))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"'buffer.sample_strategy_args' of sample strategy '{name}': {exc}") from exc
    missing = sorted(sources - recipe.buffer_sources)
    if missing:
        servers = [r.name for r in recipe.others if r.buffer_sources is not None and sources <= r.buffer_sources]
        where = f"recipe '{servers[0]}'" if servers else "a recipe script that puts them in"
        raise ConfigError(
            f"'buffer.sample_strategy'='{name}'{f' with buffer.sample_strategy_args={args}' if args else ''} reads "
            f"experiences of buffer source(s) {', '.join(map(repr, missing))}, which recipe '{recipe.name}' never "
            f"fills (it fills "
            f"{', '.join(map(repr, sorted(recipe.buffer_sources)))}). Use {where} "
            f"(buffer.put(experiences, step, source='{missing[0]}')), or a sample strategy that reads only what "
            f"the recipe fills, e.g. buffer.sample_strategy=on_policy"
        )


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
