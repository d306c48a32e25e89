"""What every recipe script does first: read ``--config`` files and overrides."""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from omegaconf import DictConfig

from rltk.config.errors import ConfigError
from rltk.config.loader import load_config
from rltk.config.recipe_capabilities import RecipeSpec
from rltk.registry import RegistryError


def parse_recipe_args(argv: list[str] | None = None, recipe_file: str | None = None) -> DictConfig:
    """The validated config of a recipe run: ``[--config FILE ...] [key=value ...]``.

    Without ``--config`` the recipe's own ``configs/<recipe>.yaml`` (beside the
    script) is used when it exists. The script's ``PROVIDES`` declaration, if
    any, is checked against the chosen components (see :func:`recipe_spec`).
    A config error prints the message and exits with status 2, whether the
    recipe runs under ``rltk run`` or as ``python recipes/grpo.py``.
    """
    from rltk.distributed import strip_local_rank_argument

    # The `deepspeed` launcher appends --local_rank=N; it is an environment fact, not config.
    argv = strip_local_rank_argument(list(sys.argv[1:] if argv is None else argv))
    recipe = Path(recipe_file or sys.argv[0])
    parser = argparse.ArgumentParser(prog=recipe.name)
    parser.add_argument("--config", action="append", default=[])
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    files = [Path(f) for f in args.config]
    if not files:
        default = recipe.parent / "configs" / f"{recipe.stem}.yaml"
        if default.is_file():
            files = [default]
    try:
        return load_config(files, args.overrides, recipe=recipe_spec(recipe))
    except (ConfigError, RegistryError) as exc:
        print(f"rltk: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _declared_provides(script: Path) -> dict | None:
    """The literal ``PROVIDES = {...}`` at the top level of a recipe script, read without running it."""
    try:
        tree = ast.parse(script.read_text(encoding="utf-8"), filename=str(script))
    except (OSError, SyntaxError, ValueError):
        return None  # running the script reports the problem
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "PROVIDES" for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return None
            return value if isinstance(value, dict) else None
    return None


def _spec_of(script: Path) -> RecipeSpec:
    provides = _declared_provides(script) or {}

    def field(key: str) -> frozenset[str] | None:
        return frozenset(provides[key]) if key in provides else None

    return RecipeSpec(script.stem, batch_fields=field("batch_fields"), buffer_sources=field("buffer_sources"),
                      expert_data=bool(provides.get("expert_data", False)))


def recipe_spec(script: str | Path) -> RecipeSpec:
    """What the recipe script ``script`` declares it serves its components, for config validation.

    A recipe declares it as a top-level literal, read here with ``ast`` so that
    validating never runs the script::

        PROVIDES = {"batch_fields": ["input_ids", ..., "values"], "buffer_sources": ["policy"],
                    "expert_data": True}

    ``expert_data`` says it puts ``buffer.expert.path``'s experiences in the
    buffer. A key it leaves out is not checked (``expert_data``: false). The recipes beside it (``*.py`` in its
    folder) come along as ``others``, so an error can name one that serves
    what is missing.
    """
    script = Path(script)
    others = tuple(
        _spec_of(p) for p in sorted(script.parent.glob("*.py"))
        if p.resolve() != script.resolve() and not p.name.startswith("_")
    ) if script.parent.is_dir() else ()
    spec = _spec_of(script)
    return RecipeSpec(spec.name, spec.batch_fields, spec.buffer_sources, others, spec.expert_data)
