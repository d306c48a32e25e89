"""Old home of what recipe scripts import: kept for one release, each name with a ``DeprecationWarning``.

A recipe imports :mod:`rltk.recipes` now; what ``rltk validate`` knows about a recipe is
:mod:`rltk.recipe_tools.validation`. Stages are registered components (kind ``stage``), so nothing reads a
script's ``PROVIDES`` or ``STAGES`` as source any more.
"""

from __future__ import annotations

import warnings
from pathlib import Path

#: old name -> (its new module, its name there)
_MOVED = {
    **{name: ("rltk.recipe_tools.validation", name) for name in (
        "parse_recipe_args", "UsageError", "shipped_recipes", "resolve_recipe", "default_config_for", "config_layers",
        "validate", "what_runs", "VALIDATE_DEMONSTRATIONS", "RECIPE_ALIASES")},
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"rltk.recipe_utils.{old} moved to {new}: import it from there (the old name goes in the next "
                  f"release)", DeprecationWarning, stacklevel=3)


def recipe_spec(script):
    """Deprecated: what the recipe of ``script``'s name serves, from its registered stages
    (:func:`rltk.recipe_tools.validation.recipe_spec` with :func:`rltk.recipes.recipe_stages`)."""
    from rltk.recipe_tools.validation import recipe_spec as spec_of, recipe_stages

    _warn("recipe_spec", "rltk.recipe_tools.validation.recipe_spec(rltk.recipes.recipe_stages(name), name)")
    name = Path(script).stem
    return spec_of(recipe_stages(name), name)


def stage_runners(own: dict, recipe_file: str | None = None) -> dict:
    """Deprecated: a script's own ``STAGES`` (type -> loop function) beside every registered stage
    (:func:`rltk.recipes.recipe_stages`)."""
    import sys

    from rltk.recipe_tools.validation import recipe_stages

    _warn("stage_runners", "rltk.recipes.recipe_stages")
    return recipe_stages(Path(recipe_file or sys.argv[0]).stem, **own)


def __getattr__(name: str):
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module, new = _MOVED[name]
    _warn(name, f"{module}.{new}")
    return getattr(importlib.import_module(module), new)
