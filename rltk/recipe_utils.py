"""What every recipe script does first: read ``--config`` files and overrides."""

from __future__ import annotations

import argparse
import ast
import sys
from importlib import resources
from pathlib import Path

from omegaconf import DictConfig

from rltk.config.errors import ConfigError
from rltk.config.loader import load_config
from rltk.config.recipe_capabilities import RecipeSpec
from rltk.registry import RegistryError, unknown_name_message


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
                      expert_data=bool(provides.get("expert_data", False)), trainer_modes=field("trainer_modes"))


def recipe_spec(script: str | Path) -> RecipeSpec:
    """What the recipe script ``script`` declares it serves its components, for config validation.

    A recipe declares it as a top-level literal, read here with ``ast`` so that
    validating never runs the script::

        PROVIDES = {"batch_fields": ["input_ids", ..., "values"], "buffer_sources": ["policy"],
                    "expert_data": True}

    ``trainer_modes`` lists the ``trainer.mode`` values its loop runs (``sync`` alone when left out).
    ``expert_data`` says it puts ``buffer.expert.path``'s experiences in the
    buffer. A key it leaves out is not checked (``expert_data``: false). The recipes beside it (``*.py`` in its
    folder) that declare ``PROVIDES`` come along as ``others``, so an error can name one that serves
    what is missing (one that declares nothing, such as ``sft``, serves no batch to suggest).
    """
    script = Path(script)
    others = tuple(
        _spec_of(p) for p in sorted(script.parent.glob("*.py"))
        if p.resolve() != script.resolve() and not p.name.startswith("_") and _declared_provides(p) is not None
    ) if script.parent.is_dir() else ()
    spec = _spec_of(script)
    return RecipeSpec(spec.name, spec.batch_fields, spec.buffer_sources, others, spec.expert_data,
                      spec.trainer_modes)


# ---------------------------------------------------------------- finding recipes, validating a config
# (`rltk validate` and the dashboard's config builder share these)

class UsageError(Exception):
    """A mistake in how the command was called."""


def _recipes_dir() -> Path:
    return Path(str(resources.files("rltk._recipes")))


def shipped_recipes() -> dict[str, Path]:
    """Recipe name -> script path, for every recipe shipped with rltk."""
    return {p.stem: p for p in sorted(_recipes_dir().glob("*.py")) if not p.name.startswith("_")}


def _is_yaml(arg: str) -> bool:
    return Path(arg).suffix in (".yaml", ".yml")


#: Other names of shipped recipes: ``rltk run rm`` is ``rltk run reward_model`` (its script and its config).
RECIPE_ALIASES = {"rm": "reward_model"}


def resolve_recipe(recipe: str) -> Path:
    """A shipped recipe name (or an alias of one, :data:`RECIPE_ALIASES`) or a path to a recipe script."""
    path = Path(recipe)
    if _is_yaml(recipe):
        # A config file where the recipe belongs: the recipe cannot be guessed safely (a YAML
        # names no recipe), so say how to pass it, naming the recipe its file name suggests.
        guess = path.stem if path.stem in shipped_recipes() else "RECIPE"
        raise UsageError(
            f"'{recipe}' is a config file, not a recipe: pass it with --config, e.g. "
            f"`rltk run {guess} --config {recipe}` (recipes: {', '.join(shipped_recipes())}, or a .py script)"
        )
    if path.suffix == ".py" or path.exists():
        if not path.is_file():
            raise UsageError(f"recipe script '{recipe}' does not exist")
        return path
    recipes = shipped_recipes()
    name = RECIPE_ALIASES.get(recipe, recipe)
    if name not in recipes:
        raise UsageError(unknown_name_message("recipe", recipe, list(recipes)) + ", or a path to a .py file")
    return recipes[name]


def default_config_for(recipe_path: Path) -> Path | None:
    """``configs/<recipe>.yaml`` beside a recipe script, if it exists."""
    candidate = recipe_path.parent / "configs" / f"{recipe_path.stem}.yaml"
    return candidate if candidate.is_file() else None


# ---------------------------------------------------------------- commands

def validate(recipe: str | None, files: list[Path], overrides: list[str], *, warn: bool = True):
    """What ``rltk validate`` checks (and the dashboard's config builder calls): ``(config, "ok: ..." line)``.

    Raises ConfigError (or RegistryError / UsageError) naming the key, the value and what is valid.
    """
    spec = None
    if recipe is not None:
        script = resolve_recipe(recipe)
        spec = recipe_spec(script)
        if not files:  # as `rltk run`: the recipe's own config unless --config replaces it
            default = default_config_for(script)
            files = [default] if default is not None else []
    cfg = load_config(files, overrides, recipe=spec, warn=warn)
    checked = _check_warmup_demonstrations(cfg)
    return cfg, (f"ok: {', '.join(map(str, files)) or 'defaults'}"
                 f"{' with ' + ' '.join(overrides) if overrides else ''}"
                 f"{' for recipe ' + spec.name if spec else ''} "
                 f"(algorithm {cfg.algorithm.name}, {len(cfg.stages)} stage(s))"
                 f"{'' if spec else '; no recipe given, so what a recipe serves was not checked (add RECIPE)'}"
                 f"{f'; the first {checked} warm-up examples fit the rollout' if checked else ''}")


#: ``rltk validate`` tokenizes this many training rows of a warm-up; a run checks them all before its first step.
VALIDATE_DEMONSTRATIONS = 256


def _check_warmup_demonstrations(cfg) -> int:
    """Tokenize the first warm-up examples as the warm-up will and check them against the rollout's caps
    (:func:`rltk.config.env_checks.check_demonstrations`); returns how many were checked (0: no warm-up).

    Loads the tokenizer (not the model) and the data; each ``sft`` stage is checked with its overrides."""
    from rltk.config.env_checks import check_demonstrations
    from rltk.training.rows import build_rows, sft_pairs, tool_schemas
    from rltk.training.setup import stage_config

    stages = [i for i, stage in enumerate(cfg.stages) if stage.type == "sft"]
    if not stages:
        return 0
    if cfg.model.path:
        from rltk.models.loading import ensure_pad_token, load_tokenizer

        tokenizer = ensure_pad_token(load_tokenizer(cfg.model.path))
    else:
        from rltk.models.tiny import build_char_tokenizer

        tokenizer = build_char_tokenizer(tool_role=cfg.model.tiny.tool_role)
    checked = 0
    for index in stages:
        staged = stage_config(cfg, index)
        if staged.data.task and not staged.data.path:  # a synthetic task: generate only the rows checked
            staged.data.train_size = min(staged.data.train_size, VALIDATE_DEMONSTRATIONS)
            staged.data.eval_size = 1
        rows = build_rows(staged, tokenizer)[0][:VALIDATE_DEMONSTRATIONS]
        pairs = sft_pairs(rows, tokenizer, staged.sft.completion_key, tools=tool_schemas(staged))
        check_demonstrations(staged, rows, pairs)
        checked = max(checked, len(rows))
    return checked
