"""The config as a run records it: resolved, except what was read from the environment.

A run writes its config to ``<output_dir>/config.yaml`` and hands it to
loggers (W&B stores it online). A value written ``${oc.env:WANDB_API_KEY}``
is usually there *because* it is a secret, so it is recorded as that
interpolation, not as the value. So is any value whose interpolation reaches
the environment through other keys (``key: ${wandb_key}`` where
``wandb_key: ${oc.env:...}``). Every other value is recorded resolved, so the
file still says what the run did (``${sub:${a},${b}}`` is written as the number).
"""

from __future__ import annotations

import re
from typing import Any

from omegaconf import DictConfig, OmegaConf

#: Resolvers whose value comes from outside the config file.
ENVIRONMENT_RESOLVERS = ("oc.env",)

_READS_ENVIRONMENT = re.compile(r"\$\{\s*(?:" + "|".join(re.escape(r) for r in ENVIRONMENT_RESOLVERS) + r")\s*:")
# ${key}, ${a.b[0].c}, ${.sibling}, ${..uncle}: a reference to another key (no resolver, so no ':').
_KEY_REFERENCE = re.compile(r"\$\{\s*([^${}:\s]+)\s*\}")
# ${oc.select:key,default} reads another key too.
_SELECT_REFERENCE = re.compile(r"oc\.select\s*:\s*([^,${}\s]+)")
_PATH_TOKEN = re.compile(r"[^.\[\]]+|\[(\d+)\]")


def config_to_record(cfg: DictConfig) -> dict:
    """``cfg`` as a plain container: resolved, except values that read the environment.

    Those keep their ``${oc.env:...}`` interpolation (or the interpolation
    that leads to one), so a secret never lands in ``config.yaml`` or a
    logger's run config. The run that reads the file back resolves it again
    from its own environment.
    """
    raw = OmegaConf.to_container(cfg, resolve=False)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    return _merge(raw, resolved, raw, [], {})


def config_yaml_to_record(cfg: DictConfig) -> str:
    """:func:`config_to_record` as YAML text, what a run writes to ``config.yaml``."""
    return OmegaConf.to_yaml(OmegaConf.create(config_to_record(cfg)))


def _merge(raw: Any, resolved: Any, root: Any, path: list, memo: dict) -> Any:
    if isinstance(raw, str) and "${" in raw:
        return raw if _reads_environment(raw, path, root, memo, set()) else resolved
    if isinstance(raw, dict) and isinstance(resolved, dict):
        return {k: _merge(raw[k], resolved[k], root, [*path, k], memo) for k in resolved}
    if isinstance(raw, list) and isinstance(resolved, list):
        return [_merge(r, v, root, [*path, i], memo) for i, (r, v) in enumerate(zip(raw, resolved))]
    return resolved


def _reads_environment(text: str, path: list, root: Any, memo: dict, seen: set) -> bool:
    """Whether the interpolation ``text`` at ``path`` reads the environment, directly or through keys."""
    if _READS_ENVIRONMENT.search(text):
        return True
    refs = _KEY_REFERENCE.findall(text) + _SELECT_REFERENCE.findall(text)
    for ref in refs:
        target = _target_path(ref, path)
        if target is None:
            return True  # a reference rltk cannot follow: keep the interpolation, to be safe
        key = tuple(target)
        if key in seen:
            continue  # a cycle; OmegaConf itself refuses it when resolving
        if key not in memo:
            found, node = _lookup(root, target)
            # A key that does not exist resolves to nothing secret (resolution would have failed).
            memo[key] = found and _node_reads_environment(node, target, root, memo, seen | {key})
        if memo[key]:
            return True
    return False


def _node_reads_environment(node: Any, path: list, root: Any, memo: dict, seen: set) -> bool:
    if isinstance(node, str):
        return "${" in node and _reads_environment(node, path, root, memo, seen)
    if isinstance(node, dict):
        return any(_node_reads_environment(v, [*path, k], root, memo, seen) for k, v in node.items())
    if isinstance(node, list):
        return any(_node_reads_environment(v, [*path, i], root, memo, seen) for i, v in enumerate(node))
    return False


def _target_path(ref: str, path: list) -> list | None:
    """The absolute path of reference ``ref`` made at ``path``; ``.x`` is a sibling, ``..x`` an uncle."""
    dots = len(ref) - len(ref.lstrip("."))
    base = path[: len(path) - dots] if dots else []
    if dots and dots > len(path):
        return None
    tokens = []
    for match in _PATH_TOKEN.finditer(ref[dots:]):
        tokens.append(int(match.group(1)) if match.group(1) is not None else match.group(0))
    return [*base, *tokens] if tokens else None


def _lookup(root: Any, path: list) -> tuple[bool, Any]:
    node = root
    for token in path:
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, dict) and str(token) in node:
            node = node[str(token)]
        elif isinstance(node, list) and str(token).isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return False, None
    return True, node
