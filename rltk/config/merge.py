"""Merging config nodes onto the schema, with errors that name the source, the key and the valid keys.

A name given for a list key is read as a one-element list before merging
(:func:`one_name_as_list`); :func:`apply_overrides` applies ``{dotted.key: value}``
on top of a merged config (a stage's overrides).
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rltk.config.schema import RunConfig
from rltk.errors import ConfigError
from rltk.registry import did_you_mean


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
_SCHEMA: DictConfig | None = None


def schema_node() -> DictConfig:
    """A fresh ``OmegaConf.structured(RunConfig)``: a copy of one built once (a copy is ten times cheaper than
    building it from the dataclasses, and every config load and stage config starts from one)."""
    global _SCHEMA
    if _SCHEMA is None:
        _SCHEMA = OmegaConf.structured(RunConfig)
    return copy.deepcopy(_SCHEMA)


def all_keys() -> list[str]:
    """Every dotted key of the schema (for suggestions)."""
    global _ALL_KEYS
    if _ALL_KEYS is None:
        _ALL_KEYS = _schema_keys(schema_node())
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


def one_name_as_list(node: DictConfig) -> DictConfig:
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
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        siblings = [k.split(".")[-1] for k in all_keys() if (k.rsplit(".", 1)[0] if "." in k else "") == parent]
        return ConfigError(
            f"{source}: unknown config key '{key}'.{did_you_mean(key, all_keys())} Valid keys"
            f"{' under ' + repr(parent) if parent else ''}: {', '.join(sorted(siblings))}"
        )
    value = getattr(exc, "value", None)
    return ConfigError(f"{source}: bad value {value!r} for config key '{key}': {msg}")


def checked_merge(base: DictConfig, node: DictConfig, source: str) -> DictConfig:
    """``OmegaConf.merge(base, node)``; a key or value the schema refuses is a ConfigError naming ``source``."""
    try:
        return OmegaConf.merge(base, node)
    except OmegaConfBaseException as exc:
        raise _explain(exc, source) from exc


def apply_overrides(cfg: DictConfig, overrides: dict[str, Any], source: str) -> DictConfig:
    """A copy of ``cfg`` with ``{dotted.key: value}`` applied (stage overrides)."""
    if isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is RunConfig:
        merged = copy.deepcopy(cfg)  # already merged onto the schema: merging it again would only copy it, slowly
    else:
        merged = checked_merge(schema_node(), OmegaConf.create(OmegaConf.to_container(cfg, resolve=False)), source)
    for key, value in overrides.items():
        if key not in all_keys() and not any(key.startswith(k + ".") for k in all_keys() if k.endswith("_args")):
            raise ConfigError(f"{source}: unknown config key '{key}'.{did_you_mean(key, all_keys())}")
        if key in STR_LIST_KEYS and isinstance(value, str) and "${" not in value:
            value = [value]  # one name for a list key, as in files and on the command line
        try:
            OmegaConf.update(merged, key, value, merge=True)
        except OmegaConfBaseException as exc:
            raise _explain(exc, source) from exc
    return merged


def stage_config(cfg: DictConfig, index: int) -> DictConfig:
    """The config of stage ``index``: the run config with that stage's overrides applied."""
    stage = cfg.stages[index]
    overrides = OmegaConf.to_container(stage.overrides, resolve=True) if stage.overrides else {}
    return apply_overrides(cfg, overrides, f"stages[{index}].overrides (stage '{stage.name}')")
