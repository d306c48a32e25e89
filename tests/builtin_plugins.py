"""Register builtin plugin modules in-process when the installed rltk metadata predates their entry points.

The registry reads builtins from the installed distribution's entry points;
a checkout whose ``pyproject.toml`` gained an entry point since the last
``pip install -e .`` would not see it. Tests of such a module call
:func:`ensure_registered`, which registers the module under its
entry-point name only when no loaded plugin holds it yet (after a
reinstall it does nothing).
"""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

from rltk.registry import get_registry, register_plugin

REPO = Path(__file__).resolve().parents[1]


def ensure_registered(*entry_point_names: str) -> None:
    """Make the builtin entry points ``entry_point_names`` (keys of ``[project.entry-points.rltk]``) registered."""
    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["rltk"]
    registry = get_registry()
    for name in entry_point_names:
        # a builtin registered from its source (rltk.registration.source) is a plugin the manager never imported
        if f"rltk:{name}" in registry.plugins:
            continue
        module = importlib.import_module(eps[name])
        if not registry.pm.is_registered(module):
            register_plugin(module, name=f"rltk:{name}")
