"""Load and merge run configs: schema < algorithm preset < YAML files < ``key=value`` overrides.

:func:`load_config` builds a run config and, by default, validates it
(:mod:`rltk.config.validation`) and warns about KL settings without effect
(:mod:`rltk.config.kl_warnings`) and about YAML settings that override a preset
switched on the command line (:mod:`rltk.config.preset_warnings`). Every error is a
:class:`~rltk.errors.ConfigError` naming the full key path, the bad
value and what would be valid.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterable

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rltk.config.kl_warnings import kl_warnings
from rltk.config.merge import checked_merge, one_name_as_list, schema_node
from rltk.config.preset_warnings import preset_override_warnings
from rltk.config.recipe_capabilities import RecipeSpec
from rltk.config.resolvers import register_resolvers
from rltk.config.validation import validate_config
from rltk.errors import ConfigError
from rltk.registry import RegistryError, get_registry

# Configs are built here, so importing this module (rltk.config does) registers the resolvers they may use.
register_resolvers()


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


def _preset(name: str, source: str) -> dict:
    try:
        preset = get_registry().entry("algorithm", name, where="algorithm.name").obj
    except RegistryError as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    return {k: v for k, v in dict(preset).items() if k != "description"}


#: Each warm-up, the run's length it must fit in, and what a warm-up nobody set is cut to (see :func:`fit_warmups`).
WARMUPS = (
    ("critic.warmup_steps", "trainer.total_steps", lambda cfg: cfg.trainer.total_steps - 1),  # the policy trains too
    ("trainer.warmup_steps", "trainer.total_steps", lambda cfg: cfg.trainer.total_steps - cfg.critic.warmup_steps),
    ("critic.lr_warmup_steps", "trainer.total_steps", lambda cfg: cfg.trainer.total_steps),
    ("sft.warmup_steps", "sft.steps", lambda cfg: cfg.sft.steps),
    ("reward_model.warmup_steps", "reward_model.steps", lambda cfg: cfg.reward_model.steps),
)


def fit_warmups(cfg: DictConfig, chosen: Iterable[DictConfig]) -> list[str]:
    """Cut each warm-up that none of the ``chosen`` nodes (the user's files and overrides) sets, and that is longer
    than its run, to the run's length; returns one line per warm-up cut.

    A shipped config's warm-up (``trainer.warmup_steps: 10`` in grpo.yaml) is sized for its run's length: a run
    shortened with ``trainer.total_steps=2`` warms its LR up over those 2 steps instead of being refused for a
    setting its user never made. A warm-up the user set stays as it is, and a bad one is an error naming the key
    (:mod:`rltk.config.validation`). A run of the shipped length trains exactly as before.
    """
    chosen = list(chosen)
    lines = []
    for key, total, limit in WARMUPS:
        value, steps = OmegaConf.select(cfg, key), OmegaConf.select(cfg, total)
        if any(OmegaConf.select(node, key) is not None for node in chosen) or not (
                isinstance(value, int) and isinstance(steps, int) and steps >= 1):
            continue
        fitted = max(0, limit(cfg))
        if value > fitted:
            OmegaConf.update(cfg, key, fitted)
            lines.append(f"{key}={value} (a default; you did not set it) is longer than this run's {total}={steps}: "
                         f"using {fitted} (set {key} to choose)")
    return lines


def load_config(
    files: Iterable[str | Path] = (),
    overrides: Iterable[str] = (),
    *,
    validate: bool = True,
    recipe: RecipeSpec | None = None,
    warn: bool = True,
    defaults: Iterable[str | Path] = (),
) -> DictConfig:
    """Build a run config: schema < preset < YAML ``defaults`` < YAML ``files`` < ``overrides``.

    The preset is the one named by ``algorithm.name`` after the files and
    overrides are read, so ``algorithm.name=ppo`` on the command line switches
    every default the ``ppo`` preset sets, while anything the user set wins.

    ``recipe``, when known (``rltk run RECIPE``, ``rltk validate RECIPE``), lets
    validation refuse components that recipe cannot serve. ``warn`` prints
    settings that take no effect (e.g. a KL estimator with ``kl_coef`` 0) and
    YAML settings that override a preset chosen on the command line (e.g.
    grpo.yaml's ``kl_coef`` under ``algorithm.name=dapo``) to stderr, one line each.

    ``defaults`` are a recipe's own config (``configs/<recipe>.yaml``, read
    when no ``--config`` replaces it): read before ``files``, and what they set
    is the recipe's choice, not the user's. So a warm-up they set longer than a
    run the user shortened is cut to fit it (:func:`fit_warmups`, a note on
    stderr), where the same value from the user's ``files`` or ``overrides``
    is refused.
    """
    defaults = [Path(f) for f in defaults]
    files = [Path(f) for f in files]
    file_nodes = [(str(f), one_name_as_list(load_yaml(f))) for f in defaults + files]
    chosen_files = [node for _, node in file_nodes[len(defaults):]]
    user = OmegaConf.create({})
    for _, node in file_nodes:
        user = OmegaConf.merge(user, node)
    overrides = list(overrides)
    cli = one_name_as_list(parse_overrides(overrides))
    source = " + ".join([name for name, _ in file_nodes] + (["command line"] if overrides else [])) or "defaults"

    schema = schema_node()
    # Validate the user's keys against the schema first so a typo is reported
    # against its own source, not against the merged result.
    for name, node in file_nodes:
        checked_merge(schema, node, name)
    checked_merge(schema, cli, "command line")

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
    cfg = checked_merge(schema, OmegaConf.create({"algorithm": preset}), f"preset '{preset_name}'")
    cfg = checked_merge(cfg, user, source)
    cfg = checked_merge(cfg, cli, "command line")
    fitted = fit_warmups(cfg, [*chosen_files, cli])
    if validate:
        validate_config(cfg, recipe=recipe)
    if warn:
        for line in fitted:
            print(f"rltk: note: {line}", file=sys.stderr)
        messages = preset_override_warnings(cli, file_nodes, preset_name, preset, schema.algorithm.name)
        messages += kl_warnings(cfg, [("command line", cli), *reversed(file_nodes)], preset_name, preset)
        for message in messages:
            print(f"rltk: warning: {message}", file=sys.stderr)
    return cfg
