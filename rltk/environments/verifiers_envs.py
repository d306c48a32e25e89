"""``verifiers`` environments: loading one by id, and its dataset as rltk rows (task ``verifiers``).

A `verifiers <https://github.com/PrimeIntellect-ai/verifiers>`_ environment is an
installed Python module with a ``load_environment(**args)`` function returning a
``verifiers.Environment`` (``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv``, ...):
its dataset, its rollout loop (which talks to an OpenAI-compatible client) and
its rubric (reward functions with weights). The Environments Hub installs them
as packages (``prime env install owner/name`` or ``pip install <name>``); an
environment written beside your code only needs to be importable.

This module only loads environments and reads their datasets; the rollouts run
in the ``verifiers`` workflow (:mod:`rltk.workflows.verifiers_workflow`).

The data task ``verifiers`` (``data.task=verifiers data.task_args.env_id=<id>``)
turns the environment's dataset (``train`` split) and its eval dataset
(``heldout``; the train dataset when it has none) into rows: ``messages`` (the
prompt as the environment formatted it, system prompt included), ``prompt``
(its last user message),
``ground_truth`` (its ``answer``), ``id`` (its ``example_id``) and the whole
row in ``extras["verifiers"]``, which the workflow hands back to the
environment unchanged.

Versions. rltk drives the classic ``verifiers`` API (``verifiers.legacy`` in
verifiers 0.3, the top-level API before it), which is what the Environments
Hub's ``load_environment`` modules implement. verifiers 0.4 ships only the new
``verifiers.v1`` stack, whose agents run as separate programs that ``uv``
installs from PyPI on first use; see docs/tutorials/environments.md,
"Environments from elsewhere: verifiers".
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from typing import Any

import rltk
from rltk.errors import ConfigError

INSTALL_HINT = "pip install 'rltk[verifiers]'"


def import_verifiers(feature: str = "the verifiers workflow"):
    """The classic ``verifiers`` API module (``verifiers.legacy`` where it exists), or ConfigError saying how to
    install it."""
    try:
        module = importlib.import_module("verifiers")
    except ImportError as exc:
        raise ConfigError(f"{feature} needs the `verifiers` package, which is not installed ({exc}); "
                          f"install it with `{INSTALL_HINT}`") from exc
    try:
        return importlib.import_module("verifiers.legacy")
    except ModuleNotFoundError as exc:
        if exc.name != "verifiers.legacy":
            raise ConfigError(f"{feature}: `import verifiers.legacy` failed: a package it needs is missing "
                              f"({exc}); install verifiers with its dependencies: `{INSTALL_HINT}`") from exc
    if hasattr(module, "load_environment"):
        return module  # verifiers < 0.3: the classic API at the top level
    version = getattr(module, "__version__", "?")
    raise ConfigError(f"{feature}: verifiers {version} has no classic environment API (`load_environment`, "
                      f"`SingleTurnEnv`, ...): 0.4 ships only `verifiers.v1`. Install a version rltk drives: "
                      f"`{INSTALL_HINT}` (verifiers 0.3)")


def installed_environments() -> list[str]:
    """Names of installed distributions that depend on ``verifiers`` (how the Hub's environments are installed)."""
    from importlib.metadata import distributions

    names = set()
    for dist in distributions():
        name = dist.metadata.get("Name") or ""
        for requirement in dist.requires or []:
            head = requirement.split(";")[0].strip().lower()
            if head.startswith("verifiers") and not head[len("verifiers"):len("verifiers") + 1].isalnum() \
                    and name.lower() not in ("verifiers", "rltk"):
                names.add(name)
    return sorted(names)


def load_verifiers_env(env_id: Any, env_args: Mapping[str, Any] | None, *, key: str, args_key: str):
    """``load_environment(**env_args)`` of the installed module ``env_id``; ConfigError naming ``key`` when it fails."""
    vf = import_verifiers()
    if not isinstance(env_id, str) or not env_id.strip():
        raise ConfigError(f"'{key}' must name an installed verifiers environment, got {env_id!r}. "
                          f"{_listing()}")
    if env_args is not None and not isinstance(env_args, Mapping):
        raise ConfigError(f"'{args_key}' must be a mapping of load_environment() arguments, got {env_args!r}")
    module_name = env_id.replace("-", "_").split("/")[-1].split("@")[0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise ConfigError(f"bad value {env_id!r} for '{key}': no module {module_name!r} is installed. "
                              f"{_listing()}") from exc
        raise
    loader = getattr(module, "load_environment", None)
    if not callable(loader):
        raise ConfigError(f"bad value {env_id!r} for '{key}': module {module_name!r} has no load_environment() "
                          f"function, so it is not a verifiers environment. {_listing()}")
    try:
        env = loader(**dict(env_args or {}))
    except TypeError as exc:
        raise ConfigError(f"'{args_key}': {module_name}.load_environment() refused {dict(env_args or {})!r}: {exc}") \
            from exc
    if not isinstance(env, vf.Environment):
        raise ConfigError(f"bad value {env_id!r} for '{key}': {module_name}.load_environment() returned a "
                          f"{type(env).__name__}, not a verifiers.Environment")
    return env


def _listing() -> str:
    found = installed_environments()
    where = (f"Installed packages that depend on verifiers: {', '.join(found)}" if found else
             "No installed package depends on verifiers")
    return (f"{where} (list them with `pip list`; an environment is any importable module with a "
            f"load_environment() function, installed with `prime env install owner/name` or `pip install`).")


def env_rows(env, split: str, size: int, seed: int, env_id: str) -> list[dict]:
    """``size`` rows of the environment's dataset (``train``) or eval dataset (``heldout``), shuffled with ``seed``."""
    dataset = None
    if split != "train" and (env.eval_dataset is not None or getattr(env, "eval_dataset_source", None) is not None):
        dataset = env.get_eval_dataset(seed=seed)
    if dataset is None:
        dataset = env.get_dataset(seed=seed)
    count = len(dataset)
    if size > count:
        raise ConfigError(f"data: verifiers environment {env_id!r} has {count} {split} rows, fewer than the "
                          f"{size} asked for (data.train_size / data.eval_size)")
    rows = []
    for index in range(size):
        row = _plain(dict(dataset[index]))
        if isinstance(row.get("info"), str):
            try:
                row["info"] = json.loads(row["info"])
            except ValueError:
                pass
        messages = row.get("prompt")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        messages = [{"role": m["role"], "content": m.get("content") or ""} for m in messages or []]
        users = [m["content"] for m in messages if m["role"] == "user"]
        rows.append({
            "id": str(row.get("example_id", index)),
            "prompt": users[-1] if users else "",
            "messages": messages,
            "ground_truth": str(row.get("answer", "") or ""),
            "extras": {"verifiers": row},
        })
    return rows


def _plain(value: Any) -> Any:
    """A JSON-compatible copy (datasets hands back numpy and pyarrow scalars in places)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value


def verifiers_task(split: str, size: int, seed: int, env_id: str | None = None,
                   env_args: Mapping[str, Any] | None = None) -> list[dict]:
    """Task ``verifiers``: rows of an installed verifiers environment's dataset (see the module docstring)."""
    env = load_verifiers_env(env_id, env_args, key="data.task_args.env_id", args_key="data.task_args.env_args")
    return env_rows(env, split, size, seed, env_id)


@rltk.hookimpl
def rltk_tasks():
    return {"verifiers": verifiers_task}
