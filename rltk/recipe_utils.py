"""What every recipe script does first: read ``--config`` files and overrides."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Callable

from omegaconf import DictConfig

from rltk.config.loader import load_config
from rltk.config.recipe_capabilities import RecipeSpec
from rltk.errors import ConfigError
from rltk.registry import RegistryError, unknown_name_message


def parse_recipe_args(argv: list[str] | None = None, recipe_file: str | None = None) -> DictConfig:
    """The validated config of a recipe run: ``[--config FILE ...] [key=value ...]``.

    Without ``--config`` the recipe's own ``configs/<recipe>.yaml`` (beside the
    script) is used when it exists. What the script's ``PROVIDES`` declares, if
    anything, is checked against the chosen components (see :func:`recipe_spec`).
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
    defaults, files = config_layers(recipe, [Path(f) for f in args.config])
    try:
        return load_config(files, args.overrides, recipe=recipe_spec(recipe), defaults=defaults)
    except (ConfigError, RegistryError) as exc:
        print(f"rltk: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _assigns_provides(script: Path) -> bool:
    """Whether a recipe script assigns ``PROVIDES`` at its top level, read with ``ast`` (nothing runs)."""
    try:
        tree = ast.parse(script.read_text(encoding="utf-8"), filename=str(script))
    except (OSError, SyntaxError, ValueError):
        return False  # running the script reports the problem
    return any(isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "PROVIDES"
                                                    for t in node.targets) for node in tree.body)


def _declared_provides(script: Path, *, sibling: bool = False) -> dict | None:
    """The recipe script's top-level ``PROVIDES`` dict (None where it has none), from the script loaded as a
    module (:func:`_load_recipe`: its ``main`` does not run), or the running script's own module.

    A script is loaded only when it assigns ``PROVIDES`` (so sft.py, dpo.py and scripts that are no recipes
    never are). A ``sibling`` (a script beside the recipe, loaded only to suggest it in an error) that fails
    to load is passed over: the recipe being validated is not its fault.
    """
    if not _assigns_provides(script):
        return None
    main = sys.modules.get("__main__")
    if getattr(main, "__file__", None) and Path(main.__file__).resolve() == script.resolve():
        module = main  # the recipe validating its own config: it has run up to main() already
    elif sibling:
        try:
            module = _load_recipe(script)
        except Exception:  # whatever a broken script raises (see the docstring)
            return None
    else:
        module = _load_recipe(script)
    value = getattr(module, "PROVIDES", None)
    return value if isinstance(value, dict) else None


def _declared_stages(script: Path) -> tuple[str, ...] | None:
    """The stage types of a recipe script's top-level ``STAGES = {"type": runner, ...}``, read without running it."""
    try:
        tree = ast.parse(script.read_text(encoding="utf-8"), filename=str(script))
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "STAGES" for t in node.targets)
                and isinstance(node.value, ast.Dict)):
            return tuple(k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return None


def _spec_of(script: Path, provides: dict | None = None) -> RecipeSpec:
    provides = provides if provides is not None else _declared_provides(script) or {}

    def field(key: str) -> frozenset[str] | None:
        return frozenset(provides[key]) if key in provides else None

    stages = _declared_stages(script)
    return RecipeSpec(script.stem, batch_fields=field("batch_fields"), buffer_sources=field("buffer_sources"),
                      expert_data=bool(provides.get("expert_data", False)), trainer_modes=field("trainer_modes"),
                      stage_types=frozenset(stages) if stages is not None else None)


def _stage_recipes(script: Path) -> dict[str, Path]:
    """Stage type -> the recipe script whose stage it is, for the types a config may chain besides the recipe's own.

    A recipe that declares ``STAGES`` with a type of its own name (``dpo.py``: ``"dpo"``) lends that stage to
    every other recipe's ``stages``. Scripts beside ``script`` come first (a copied folder of recipes uses its
    own copies), then the shipped ones.
    """
    found: dict[str, Path] = {}
    folders = [script.parent] if script.parent.is_dir() else []
    for path in [p for folder in folders for p in sorted(folder.glob("*.py"))] + list(shipped_recipes().values()):
        if path.name.startswith("_") or path.stem in found:
            continue
        if path.stem in (_declared_stages(path) or ()):
            found[path.stem] = path
    return found


def recipe_spec(script: str | Path) -> RecipeSpec:
    """What the recipe script ``script`` declares it serves its components, for config validation.

    A recipe declares it as a top-level dict, read from the script loaded as a module (its top level only
    imports and defines; ``main`` runs under ``if __name__ == "__main__"``). A recipe on
    :func:`rltk.training.stages.loop_state.rl_steps` builds it with
    :func:`~rltk.training.stages.loop_state.rl_provides`; written out::

        PROVIDES = {"batch_fields": ["input_ids", ..., "values"], "buffer_sources": ["policy"],
                    "expert_data": True, "trainer_modes": ["sync", "one_step_off", "async"]}

    ``trainer_modes`` lists the ``trainer.mode`` values its loop runs (``sync`` alone when left out).
    ``expert_data`` says it puts ``buffer.expert.path``'s experiences in the
    buffer. A key it leaves out is not checked (``expert_data``: false). The recipes beside it (``*.py`` in its
    folder) that declare ``PROVIDES`` come along as ``others``, so an error can name one that serves
    what is missing (one that declares nothing, such as ``sft``, serves no batch to suggest).
    """
    script = Path(script)
    siblings = [p for p in sorted(script.parent.glob("*.py")) if p.resolve() != script.resolve()
                and not p.name.startswith("_")] if script.parent.is_dir() else []
    declared = {p: _declared_provides(p, sibling=True) for p in siblings}
    others = tuple(_spec_of(p, provides) for p, provides in declared.items() if provides is not None)
    spec = _spec_of(script)
    own = spec.stage_types
    lent = {t: _spec_of(p) for t, p in _stage_recipes(script).items() if own is None or t not in own}
    stage_types = None if own is None else own | frozenset(lent)
    return RecipeSpec(spec.name, spec.batch_fields, spec.buffer_sources, others, spec.expert_data,
                      spec.trainer_modes, stage_types=stage_types,
                      stage_recipes=tuple(sorted(lent.items())) if own is not None else ())


class StageRunners(Mapping):
    """A recipe's stage runners by type: its own ``STAGES``, then the stage of every recipe that lends one.

    ``type: dpo`` in any recipe's ``stages`` runs ``recipes/dpo.py``'s ``STAGES["dpo"]``: the script is
    loaded (not run as ``__main__``) the first time a config names it, so each stage's loop exists once,
    in its own recipe. The stages hand weights on through ``run.policy`` (:func:`rltk.training.stages.run.run_stages`).
    """

    def __init__(self, own: dict[str, Callable], script: Path):
        self.own, self.lent = dict(own), {t: p for t, p in _stage_recipes(script).items() if t not in own}

    def __getitem__(self, stage_type: str) -> Callable:
        if stage_type in self.own:
            return self.own[stage_type]
        if stage_type not in self.lent:
            raise KeyError(stage_type)
        return _load_recipe(self.lent[stage_type]).STAGES[stage_type]

    def __iter__(self):
        return iter(sorted(set(self.own) | set(self.lent)))

    def __len__(self) -> int:
        return len(set(self.own) | set(self.lent))


_LOADED: dict[Path, ModuleType] = {}


def _load_recipe(script: Path) -> ModuleType:
    """A recipe script as a module (its ``main`` not run), loaded once per process."""
    script = script.resolve()
    if script not in _LOADED:
        name = f"rltk_recipe_{script.stem}"
        spec = importlib.util.spec_from_file_location(name, script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # what dataclasses and pickling look a module up by
        spec.loader.exec_module(module)
        _LOADED[script] = module
    return _LOADED[script]


def stage_runners(own: dict[str, Callable], recipe_file: str | None = None) -> StageRunners:
    """The runners of every stage type a recipe's config may name: ``own`` (the recipe's ``STAGES``) and the
    stage each other recipe lends (see :class:`StageRunners`). ``recipe_file``: the script (default ``sys.argv[0]``)."""
    return StageRunners(own, Path(recipe_file or sys.argv[0]))


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

    Raises ConfigError (or RegistryError / UsageError) naming the key, the value and what is valid.
    """
    spec, defaults = None, []
    if recipe is not None:
        script = resolve_recipe(recipe)
        spec = recipe_spec(script)
        # as `rltk run`: the recipe's own config unless --config replaces it
        defaults, files = config_layers(script, list(files))
    cfg = load_config(files, overrides, recipe=spec, warn=warn, defaults=defaults)
    checked = _check_warmup_demonstrations(cfg)
    return cfg, (f"ok: {', '.join(map(str, defaults + files)) or 'defaults'}"
                 f"{' with ' + ' '.join(overrides) if overrides else ''}"
                 f"{' for recipe ' + spec.name if spec else ''} "
                 f"({what_runs(cfg, spec.name if spec else None)})"
                 f"{'' if spec else '; no recipe given, so what a recipe serves was not checked (add RECIPE)'}"
                 f"{f'; the first {checked} warm-up examples fit the rollout' if checked else ''}")


def what_runs(cfg, recipe: str | None) -> str:
    """What a run of ``cfg`` trains, stage by stage, for ``rltk validate``'s ok line: e.g. ``2 stages: warmup
    (sft), dpo (dpo, loss sigmoid)``; an RL stage names its algorithm, the reward_model recipe its loss."""
    from rltk.config.schema import RL_STAGE_TYPES
    from rltk.training.scaffold.setup import stage_config

    parts = []
    for i, stage in enumerate(cfg.stages):
        staged = stage_config(cfg, i)
        if stage.type == "distill":
            detail = f", advantage {staged.algorithm.advantage_fn}"
        elif stage.type in RL_STAGE_TYPES:
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
    from rltk.training.scaffold.setup import stage_config

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
