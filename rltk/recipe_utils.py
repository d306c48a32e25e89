"""What every recipe script does first: read ``--config`` files and overrides."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omegaconf import DictConfig

from rltk.config.loader import ConfigError, load_config
from rltk.registry import RegistryError


def parse_recipe_args(argv: list[str] | None = None, recipe_file: str | None = None) -> DictConfig:
    """The validated config of a recipe run: ``[--config FILE ...] [key=value ...]``.

    Without ``--config`` the recipe's own ``configs/<recipe>.yaml`` (beside the
    script) is used when it exists. A config error prints the message and
    exits with status 2, whether the recipe runs under ``rltk run`` or as
    ``python recipes/grpo.py``.
    """
    from rltk.strategies.deepspeed_strategy import strip_local_rank_argument

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
        return load_config(files, args.overrides)
    except (ConfigError, RegistryError) as exc:
        print(f"rltk: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
