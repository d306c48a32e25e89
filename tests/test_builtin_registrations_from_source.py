"""rltk's builtins are registered from their source without importing them (``rltk validate`` needs no torch,
issue 55 item 5); what the source says must be what importing them gives, for every builtin.

The registry reads each builtin registration module's hooks (:func:`rltk.registration.source.read_registrations`)
and, for a config check, each component's signature, type hints, docstring and literal class attributes
(:func:`rltk.registration.source.describe`). Here both are compared with the imported objects, so a builtin whose
source the reader gets wrong fails here rather than letting ``rltk validate`` check a config differently.
"""

from __future__ import annotations

import importlib
import importlib.metadata as importlib_metadata
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rltk.registration.source import Described, describe, read_registrations
from rltk.config.components import expected_types, signature_params
from rltk.registry import KINDS, PROJECT

REPO = Path(__file__).resolve().parents[1]
HOOKS = {kind.hook: kind.name for kind in KINDS.values()}
#: What config checks read off a component by name (rltk/config): each must agree with the imported one.
ATTRIBUTES = ("component_args", "runs_in_producer", "returns_routed_experts", "owns_servers", "chainable",
              "check_args", "buffer_sources", "run")


def builtin_modules() -> list[str]:
    return sorted({ep.value for ep in importlib_metadata.entry_points(group="rltk")
                   if ep.dist is not None and ep.dist.name == PROJECT})


def registered_by_import(module_name: str) -> dict[str, dict[str, object]]:
    module = importlib.import_module(module_name)
    return {kind: dict(getattr(module, hook)()) for hook, kind in HOOKS.items() if hasattr(module, hook)}


def resolve(ref: str):
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


def test_most_builtin_registration_modules_are_read_from_their_source():
    read = [m for m in builtin_modules() if read_registrations(m, HOOKS) is not None]
    # the heavy ones above all: the algorithms, the strategies and the engines import torch
    for module in ("rltk.algorithms.advantages", "rltk.algorithms.policy_losses", "rltk.rollout.hf",
                   "rltk.strategies.accelerate_strategy", "rltk.strategies.deepspeed_strategy"):
        assert module in read
    assert len(read) >= len(builtin_modules()) - 2, sorted(set(builtin_modules()) - set(read))


@pytest.mark.parametrize("module_name", builtin_modules())
def test_what_the_source_says_a_module_registers_is_what_importing_it_registers(module_name):
    found = read_registrations(module_name, HOOKS)
    if found is None:
        pytest.skip(f"{module_name} is imported to register (its source does not say exactly)")
    imported = registered_by_import(module_name)
    assert {k: sorted(v) for k, v in found.items()} == {k: sorted(v) for k, v in imported.items()}
    for kind, entries in found.items():
        for name, ref in entries.items():
            assert resolve(ref) is imported[kind][name], (kind, name, ref)


def _facts(obj) -> dict:
    params, takes_kwargs = signature_params(obj)
    is_function = inspect.isfunction(obj) or (isinstance(obj, Described) and obj.is_function)
    attributes = {}
    for name in ATTRIBUTES:
        value = getattr(obj, name, "<missing>")
        attributes[name] = "<callable>" if callable(value) else value
    return {
        "params": [(n, p.kind, repr(p.default), repr(p.annotation)) for n, p in params.items()],
        "takes_kwargs": takes_kwargs,
        "expected": {n: repr(expected_types(obj, p)) for n, p in params.items()},
        "function": is_function,
        "doc": inspect.getdoc(obj),
        "attributes": attributes,
        "where": (obj.__module__, obj.__qualname__),
    }


def _described_components() -> list[tuple[str, str, str]]:
    out = []
    for module_name in builtin_modules():
        for kind, entries in (read_registrations(module_name, HOOKS) or {}).items():
            out += [(kind, name, ref) for name, ref in entries.items()]
    return out


@pytest.mark.parametrize("kind,name,ref", _described_components())
def test_a_builtin_described_from_its_source_is_checked_as_the_imported_one(kind, name, ref):
    described = describe(ref, lambda: resolve(ref))
    if described is None:
        pytest.skip(f"{kind} '{name}' is imported to be described")
    real = resolve(ref)
    assert _facts(described) == _facts(real)


def test_the_described_builtins_include_every_component_a_grpo_config_names():
    described = {(k, n) for k, n, ref in _described_components() if describe(ref, lambda: None) is not None}
    for key in [("advantage_fn", "grpo"), ("policy_loss", "ppo_clip"), ("kl_penalty_fn", "k3"),
                ("loss_agg", "token-mean"), ("rollout_engine", "hf"), ("training_strategy", "accelerate"),
                ("workflow", "single_turn"), ("sample_strategy", "on_policy")]:
        assert key in described, key


@pytest.mark.parametrize("plugins", ["builtins only", "with the plugins installed"])
def test_rltk_validate_grpo_imports_no_torch(plugins):
    """The whole of ``rltk validate grpo`` in a fresh interpreter: torch is never imported (the config's
    components are read from their source). The repository's own plugins, where installed, import none either."""
    code = ("import json, sys; from rltk.commands.cli import main; code = main(['validate', 'grpo']); "
            "print(json.dumps([code, [m for m in ('torch', 'accelerate', 'deepspeed') if m in sys.modules]]))")
    env = dict(os.environ, RLTK_DISABLE_PLUGIN_AUTOLOAD="1" if plugins == "builtins only" else "0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    from tests.waits import scaled

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=scaled(180))
    assert out.returncode == 0, out.stderr
    code, loaded = json.loads(out.stdout.splitlines()[-1])
    assert code == 0 and "ok: " in out.stdout
    assert loaded == []


def test_a_component_registered_by_reference_imports_on_first_use():
    from rltk.algorithms.advantages import ADVANTAGE_FNS
    from rltk.registry import Entry

    ref = read_registrations("rltk.algorithms.advantages", HOOKS)["advantage_fn"]["grpo"]
    entry = Entry("advantage_fn", "grpo", plugin="rltk:advantages", ref=ref)
    assert not entry.loaded
    assert entry.described is entry.obj is ADVANTAGE_FNS["grpo"]  # its module is imported: the object itself
    assert entry.loaded
