"""What ``rltk validate`` (and ``rltk run``, and a recipe script as it starts) knows about a recipe: its
stages, from the registry, and the config checked against what they provide.

Nothing here imports torch or reads a script: a shipped recipe's stages are the registered ones
(:func:`recipe_stages`), a script's are what it hands :func:`parse_recipe_args`, which
``rltk validate SCRIPT.py`` learns by running the script up to that call (:func:`validate`).
"""

from __future__ import annotations

import argparse
import runpy
import sys
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig

from rltk.config.loader import load_config
from rltk.config.recipe_capabilities import RecipeSpec
from rltk.errors import ConfigError
from rltk.registry import RegistryError, get_registry, unknown_name_message
from rltk.registration.stage_spec import StageSpec


# ---------------------------------------------------------------- a recipe's stages

def registered_stages() -> dict[str, StageSpec]:
    """Every registered stage by name (kind ``stage``: rltk's and the plugins')."""
    return {name: entry.obj for name, entry in get_registry().entries["stage"].items()}


def recipe_stages(recipe: str | None = None, **own: StageSpec | Callable) -> dict[str, StageSpec]:
    """The stages a recipe's config may name: every registered chainable stage by its name, ``rl`` (the
    recipe's own RL loop) and ``own``.

    ``rl`` is the registered stage named ``recipe`` when that stage is an RL loop (``recipe_stages("grpo")``:
    ``type: rl`` runs the grpo loop), unless ``own`` gives one. ``own`` maps a type to a
    :class:`~rltk.StageSpec`, or to a loop function (a script's own loop, which then declares nothing it
    provides; wrap it in a ``StageSpec(loop, provides=...)`` to have its config checked)::

        STAGES = recipe_stages("grpo", rl=StageSpec(my_loop, "my loop", provides=rl_provides("values")))
    """
    stages = {name: spec for name, spec in registered_stages().items() if spec.chainable}
    mine = registered_stages().get(recipe) if recipe else None
    if mine is not None and mine.rl:
        stages["rl"] = mine
    for name, loop in own.items():
        stages[name] = loop if isinstance(loop, StageSpec) else StageSpec(loop)
    return stages


def recipe_spec(stages: Mapping[str, StageSpec], name: str) -> RecipeSpec:
    """What a recipe whose stages are ``stages`` serves its components, for config validation.

    The recipe's own provides are its ``rl`` stage's (none declared without one: nothing is checked);
    every other stage type that declares what it provides is checked against that (``stage_recipes``); the other
    registered stages come along as ``others``, so an error can name one that serves what is missing.
    """
    specs = {t: _spec_of(t, s) for t, s in stages.items()}
    own = specs.get("rl", RecipeSpec(name))
    own_loop = stages.get("rl")
    others = tuple(spec for t, spec in sorted(specs.items())
                   if t != "rl" and stages[t] is not own_loop and spec.batch_fields is not None)
    return RecipeSpec(name, own.batch_fields, own.buffer_sources, others, own.expert_data, own.trainer_modes,
                      stage_types=frozenset(stages),
                      stage_recipes=tuple(sorted((t, specs[t]) for t, s in stages.items() if t != "rl" and s.provides)))


def shipped_recipe_spec(recipe: str) -> RecipeSpec:
    """What the shipped recipe ``recipe`` (a name, an alias or the path of its script) serves: its registered stages."""
    name = resolve_recipe(str(recipe)).stem
    return recipe_spec(recipe_stages(name), name)


def _spec_of(name: str, stage: StageSpec) -> RecipeSpec:
    return RecipeSpec(name, batch_fields=stage.fields("batch_fields"), buffer_sources=stage.fields("buffer_sources"),
                      expert_data=bool(stage.provides.get("expert_data", False)),
                      trainer_modes=stage.fields("trainer_modes"))


def parse_recipe_args(stages: Mapping[str, StageSpec] | None = None, argv: list[str] | None = None,
                      recipe_file: str | None = None) -> DictConfig:
    """The validated config of a recipe run: ``[--config FILE ...] [key=value ...]``.

    Without ``--config`` the recipe's own ``configs/<recipe>.yaml`` (beside the script) is used when it
    exists. ``stages`` (:func:`recipe_stages`; by default the recipe's of the script's name) are what the
    config's ``stages`` may name, each checked against what it provides. A config error prints the message
    and exits with status 2, whether the recipe runs under ``rltk run`` or as ``python recipes/grpo.py``.
    """
    from rltk.argv import strip_local_rank_argument

    # The `deepspeed` launcher appends --local_rank=N; it is an environment fact, not config.
    argv = strip_local_rank_argument(list(sys.argv[1:] if argv is None else argv))
    recipe = Path(recipe_file or sys.argv[0])
    parser = argparse.ArgumentParser(prog=recipe.name)
    parser.add_argument("--config", action="append", default=[])
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    defaults, files = config_layers(recipe, [Path(f) for f in args.config])
    try:
        spec = _legacy_spec(recipe) if stages is None else recipe_spec(stages, recipe.stem)
        cfg = load_config(files, args.overrides, recipe=spec, defaults=defaults)
    except (ConfigError, RegistryError) as exc:
        if _VALIDATING:
            raise
        print(f"rltk: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if _VALIDATING:  # `rltk validate SCRIPT.py`: the script stops here, its config checked
        raise _Validated(cfg, spec, defaults + files)
    return cfg


def _legacy_spec(script: Path) -> RecipeSpec:
    """What a script that hands :func:`parse_recipe_args` no stages serves: a script of a registered stage's
    name, one written for an older rltk (its module's ``STAGES`` and ``PROVIDES``, read from the running
    module), or nothing declared (a script that only reads its config: no stage type is checked)."""
    main = sys.modules.get("__main__")
    declared = getattr(main, "STAGES", None) if getattr(main, "__file__", None) and \
        Path(main.__file__).resolve() == script.resolve() else None
    if not isinstance(declared, dict):
        if script.stem in registered_stages():
            return recipe_spec(recipe_stages(script.stem), script.stem)
        return RecipeSpec(script.stem)
    import warnings

    warnings.warn(f"{script.name}: a module-level STAGES/PROVIDES is read for one more release; hand "
                  f"parse_recipe_args and run_stages rltk.recipes.recipe_stages(...) instead", DeprecationWarning,
                  stacklevel=3)
    provides = getattr(main, "PROVIDES", None) or {}
    own = {t: StageSpec(loop, provides=provides if t == "rl" else {}) for t, loop in declared.items()
           if t == "rl" or t not in registered_stages()}
    return recipe_spec(recipe_stages(script.stem, **own), script.stem)


# ---------------------------------------------------------------- validating a script: run it up to parse_recipe_args

_VALIDATING: list[bool] = []


class _Validated(Exception):
    """Raised by :func:`parse_recipe_args` under ``rltk validate SCRIPT.py``: the checked config, no run."""

    def __init__(self, cfg, spec: RecipeSpec, files: list[Path]):
        super().__init__("validated")
        self.cfg, self.spec, self.files = cfg, spec, files


def _validate_script(script: Path, files: list[Path], overrides: list[str]):
    """``(config, spec, files)`` of a script, run as ``__main__`` until it parses its arguments."""
    argv = [str(script), *[a for f in files for a in ("--config", str(f))], *overrides]
    saved = sys.argv
    sys.argv = argv
    _VALIDATING.append(True)
    try:
        runpy.run_path(str(script), run_name="__main__")
    except _Validated as done:
        return done.cfg, done.spec, done.files
    finally:
        _VALIDATING.pop()
        sys.argv = saved
    raise UsageError(f"recipe script '{script}' ended without calling rltk.recipes.parse_recipe_args, so its "
                     f"config could not be checked")


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


def config_layers(recipe_path: Path, files: list[Path]) -> tuple[list[Path], list[Path]]:
    """``(the recipe's own config, the user's config files)`` of a run of ``recipe_path`` given ``--config files``.

    Without ``files`` the recipe's own :func:`default_config_for` is the config (also when it is named as the
    first ``--config``, as ``rltk run`` hands it on); it is read as the recipe's defaults, not as the user's
    settings (``load_config(defaults=...)``: e.g. its LR warm-up is cut to fit a run shortened on the command line).
    """
    own = default_config_for(recipe_path)
    if own is not None and (not files or Path(files[0]).resolve() == own.resolve()):
        return [own], list(files[1:])
    return [], list(files)


# ---------------------------------------------------------------- commands

def validate(recipe: str | None, files: list[Path], overrides: list[str], *, warn: bool = True):
    """What ``rltk validate`` checks (and the dashboard's config builder calls): ``(config, "ok: ..." line)``.

    A shipped recipe is checked against its registered stages (:func:`recipe_stages`) without running
    anything; a recipe script runs up to its :func:`parse_recipe_args`, which checks it against the stages
    it hands over. Raises ConfigError (or RegistryError / UsageError) naming the key, the value and what is valid.
    """
    spec, defaults = None, []
    if recipe is not None:
        script = resolve_recipe(recipe)
        if script.resolve().parent != _recipes_dir().resolve():  # someone's script: ask it
            cfg, spec, used = _validate_script(script, list(files), list(overrides))
            return cfg, _ok_line(cfg, spec, used, overrides, _check_warmup_demonstrations(cfg))
        spec = shipped_recipe_spec(script.stem)
        # as `rltk run`: the recipe's own config unless --config replaces it
        defaults, files = config_layers(script, list(files))
    cfg = load_config(files, overrides, recipe=spec, warn=warn, defaults=defaults)
    return cfg, _ok_line(cfg, spec, defaults + list(files), overrides, _check_warmup_demonstrations(cfg))


def _ok_line(cfg, spec: RecipeSpec | None, files: list[Path], overrides: list[str], checked: int) -> str:
    return (f"ok: {', '.join(map(str, files)) or 'defaults'}"
            f"{' with ' + ' '.join(overrides) if overrides else ''}"
            f"{' for recipe ' + spec.name if spec else ''} "
            f"({what_runs(cfg, spec.name if spec else None)})"
            f"{'' if spec else '; no recipe given, so what a recipe serves was not checked (add RECIPE)'}"
            f"{f'; the first {checked} warm-up examples fit the rollout' if checked else ''}"
            f"{_indented(step_plans(cfg, spec.name if spec else None))}")


def _indented(text: str) -> str:
    return f"\n{text}" if text else ""


def step_plans(cfg, recipe: str | None) -> str:
    """The step plan of each RL stage of ``cfg`` (:class:`rltk.config.recipe_capabilities.StepPlan`): which pass
    fills which batch field and what each component reads, for ``rltk validate``. Empty without an RL stage."""
    from rltk.config.recipe_capabilities import StepPlan
    from rltk.config.merge import stage_config

    stages = recipe_stages(recipe) if recipe in registered_stages() else registered_stages()
    plans = []
    for i, stage in enumerate(cfg.stages):
        spec = stages.get(stage.type)
        if spec is None or spec.fields("batch_fields") is None:  # not a loop that runs the estimator
            continue
        plan = StepPlan.build(stage_config(cfg, i), spec.provides, stage.type)
        plans.append(f"step plan of stage '{stage.name}' ({stage.type}):\n{plan.describe()}")
    return "\n".join(plans)


def what_runs(cfg, recipe: str | None) -> str:
    """What a run of ``cfg`` trains, stage by stage, for ``rltk validate``'s ok line: e.g. ``2 stages: warmup
    (sft), dpo (dpo, loss sigmoid)``; a stage that feeds an advantage estimator names its algorithm, the
    reward_model recipe its loss."""
    from rltk.config.merge import stage_config

    parts = []
    for i, stage in enumerate(cfg.stages):
        staged = stage_config(cfg, i)
        if stage.type == "distill":
            detail = f", advantage {staged.algorithm.advantage_fn}"
        elif stage.type == "rl" or registered_stages()[stage.type].fields("batch_fields"):  # it runs the estimator
            detail = f", algorithm {staged.algorithm.name}"
        elif stage.type == "dpo":
            detail = f", loss {staged.dpo.loss}{', online' if staged.dpo.online else ''}"
        else:
            detail = ""
        parts.append(f"{stage.name} ({stage.type}{detail})")
    text = f"{len(parts)} stage{'' if len(parts) == 1 else 's'}{': ' + ', '.join(parts) if parts else ''}"
    if recipe == "reward_model":  # the recipe trains a reward model after its stages
        text += f"{', then' if parts else ';'} a reward model (loss {cfg.reward_model.loss})"
    return text


#: ``rltk validate`` tokenizes this many training rows of a warm-up; a run checks them all before its first step.
VALIDATE_DEMONSTRATIONS = 256


def _check_warmup_demonstrations(cfg) -> int:
    """Tokenize the first warm-up examples as the warm-up will and check them against the rollout's caps
    (:func:`rltk.config.env_checks.check_demonstrations`); returns how many were checked (0: no warm-up).

    Loads the tokenizer (not the model) and the data; each ``sft`` stage is checked with its overrides."""
    from rltk.config.env_checks import check_demonstrations
    from rltk.training.scaffold.rows import build_rows, sft_pairs, tool_schemas
    from rltk.config.merge import stage_config

    stages = [i for i, stage in enumerate(cfg.stages) if stage.type == "sft"]
    if not stages:
        return 0
    if cfg.model.path:
        from rltk.models.loading import ensure_pad_token, load_tokenizer

        tokenizer = ensure_pad_token(load_tokenizer(cfg.model.path))
    else:
        from rltk.models.tiny import build_char_tokenizer

        tokenizer = build_char_tokenizer(tool_role=cfg.model.tiny.tool_role, vision=bool(cfg.model.tiny.vision.depth))
    checked = 0
    for index in stages:
        staged = stage_config(cfg, index)
        if staged.data.task and not staged.data.path:  # a synthetic task: generate only the rows checked
            staged.data.train_size = min(staged.data.train_size, VALIDATE_DEMONSTRATIONS)
            staged.data.eval_size = 1
        rows = build_rows(staged, tokenizer)[0][:VALIDATE_DEMONSTRATIONS]
        processor = None
        if any(row.get("images") for row in rows):
            from rltk.training.scaffold.setup import build_processor  # imports torch: only for rows with images

            processor = build_processor(staged, tokenizer)
        pairs = sft_pairs(rows, tokenizer, staged.sft.completion_key, tools=tool_schemas(staged), processor=processor)
        check_demonstrations(staged, rows, pairs)
        checked = max(checked, len(rows))
    return checked
