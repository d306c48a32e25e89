"""A warning for a preset switched on the command line whose settings the YAML still overrides.

Configs merge as schema < preset < YAML files < command line, so ``rltk run grpo
algorithm.name=dapo`` keeps every ``algorithm.*`` value the recipe's YAML sets,
tuned for the preset the YAML names: grpo.yaml's ``kl_coef: 0.05`` then beats
DAPO's ``kl_coef: 0.0`` and the "DAPO" run trains with a KL penalty. That
precedence is right (a file the user wrote outranks a bundle of defaults), but
silent; :func:`preset_override_warnings` names each such key.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf


def preset_override_warnings(cli: DictConfig, file_nodes: list[tuple[str, DictConfig]], preset_name: str,
                             preset: dict, default_name: str) -> list[str]:
    """One message when the command line's ``algorithm.name`` differs from the YAML's and YAML keys
    override values the chosen preset sets; otherwise none.

    Args:
        cli: the command-line overrides.
        file_nodes: ``(path, node)`` of the YAML files, in merge order.
        preset_name: the preset in effect (the command line's ``algorithm.name``).
        preset: what it sets, as merged (``*_args`` of a component swapped away already dropped).
        default_name: the schema's ``algorithm.name``, the preset files that name none were written against.

    A key set on the command line as well is the user's explicit choice and is
    not reported. Argument mappings (``policy_loss_args`` ...) are compared key
    by key, as they merge.
    """
    if not file_nodes or OmegaConf.select(cli, "algorithm.name") is None:
        return []
    merged = OmegaConf.merge(*[node for _, node in file_nodes])
    yaml_name = OmegaConf.select(merged, "algorithm.name") or default_name
    if yaml_name == preset_name:
        return []

    def file_setting(key: str) -> str | None:
        return next((path for path, node in reversed(file_nodes) if OmegaConf.select(node, key) is not None), None)

    overridden = []  # (key, yaml value, preset value, file)
    for key, value in _leaves(preset, "algorithm"):
        if key == "algorithm.description" or OmegaConf.select(cli, key) is not None:
            continue
        path = file_setting(key)
        if path is None:
            continue
        yaml_value = _plain(OmegaConf.select(merged, key))
        if yaml_value != value:
            overridden.append((key, yaml_value, value, path))
    if not overridden:
        return []
    if OmegaConf.select(merged, "algorithm.name") is None:
        replaced = f"the default preset '{yaml_name}', which the YAML leaves in place"
    else:
        replaced = f"preset '{yaml_name}' (named in {file_setting('algorithm.name')})"
    several_files = len({path for *_, path in overridden}) > 1 or len(file_nodes) > 1
    listed = "; ".join(
        f"{key}={_cli_value(mine)} ('{preset_name}': {_cli_value(theirs)})" + (f" from {path}" if several_files else "")
        for key, mine, theirs, path in overridden)
    follow = " ".join(f"{key}={_cli_value(theirs)}" for key, _, theirs, _ in overridden)
    return [
        f"algorithm.name={preset_name} on the command line replaces {replaced}, but the YAML's own "
        f"algorithm settings still override what '{preset_name}' sets: {listed}. To follow the preset, add "
        f"{follow} to the command line"
    ]


def _leaves(value: Any, prefix: str):
    """``(dotted key, value)`` of every leaf of a nested mapping.

    An empty mapping (a preset's ``advantage_fn_args: {}``) sets nothing: arguments merge into it.
    """
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{prefix}.{k}")
    else:
        yield prefix, value


def _plain(value: Any) -> Any:
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _cli_value(value: Any) -> str:
    """``value`` as it would be written in a ``key=value`` override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_cli_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_cli_value(v)}" for k, v in value.items()) + "}"
    return str(value)
