"""The ``rltk`` command line: list, plugins, validate, run, export, serve.

Exit codes: 0 success, 1 a failure inside a run, 2 usage or config errors,
3 a run stopped by the divergence guard (``guard.*``: entropy collapse,
nothing trained, non-finite weights). 2 and 3 print a message on stderr, no
traceback. A plugin's lifecycle hook that raises stops a run with exit code
1: the plugin's traceback, then one line naming the plugin and the hook.

``validate`` and ``run`` take a config the same way: a recipe (shipped name
or script path), ``--config FILE`` (repeatable; replaces the recipe's own
config), and ``key=value`` overrides. ``validate`` also takes a bare YAML file.
"""

from __future__ import annotations

import argparse
import runpy
import sys
import traceback
from importlib import resources
from pathlib import Path

import rltk
from rltk.config.errors import ConfigError
from rltk.config.loader import load_config
from rltk.recipe_utils import recipe_spec
from rltk.registry import (
    KINDS, LifecycleHookError, RegistryError, get_registry, list_components, unknown_name_message,
)
from rltk.training.guard import EXIT_DIVERGED, TrainingDiverged
from rltk.serialization import CheckpointFileError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A mistake in how the command was called."""


def _recipes_dir() -> Path:
    return Path(str(resources.files("rltk._recipes")))


def shipped_recipes() -> dict[str, Path]:
    """Recipe name -> script path, for every recipe shipped with rltk."""
    return {p.stem: p for p in sorted(_recipes_dir().glob("*.py")) if not p.name.startswith("_")}


def _is_yaml(arg: str) -> bool:
    return Path(arg).suffix in (".yaml", ".yml")


def resolve_recipe(recipe: str) -> Path:
    """A shipped recipe name or a path to a recipe script."""
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
    if recipe not in recipes:
        raise UsageError(unknown_name_message("recipe", recipe, list(recipes)) + ", or a path to a .py file")
    return recipes[recipe]


def default_config_for(recipe_path: Path) -> Path | None:
    """``configs/<recipe>.yaml`` beside a recipe script, if it exists."""
    candidate = recipe_path.parent / "configs" / f"{recipe_path.stem}.yaml"
    return candidate if candidate.is_file() else None


# ---------------------------------------------------------------- commands

def cmd_list(args) -> int:
    kind = args.kind
    if kind is not None and kind not in KINDS:
        raise UsageError(unknown_name_message("component kind", kind, list(KINDS)))
    entries = list_components(kind)
    current = None
    for e in entries:
        if e.kind != current:
            current = e.kind
            print(f"{e.kind}  ({KINDS[e.kind].description})")
        extra = f" [overrides {e.overrides}]" if e.overrides else ""
        print(f"  {e.name:<30} {e.plugin:<28} {e.summary}{extra}")
    return EXIT_OK


def cmd_plugins(args) -> int:
    registry = get_registry()
    for info in registry.plugins.values():
        print(f"{info.name}  ({info.distribution} {info.version}, module {info.module})")
        for kind, names in info.components.items():
            print(f"    {kind}: {', '.join(names)}")
        if not info.components:
            print("    (lifecycle hooks only)")
    return EXIT_OK


def _config_files(config: list[str] | None, recipe: str | None) -> list[Path]:
    files = [Path(c) for c in (config or [])]
    if not files and recipe is not None:
        default = default_config_for(resolve_recipe(recipe))
        if default is not None:
            files = [default]
    return files


def _validate_targets(targets: list[str], config: list[str] | None) -> tuple[str | None, list[Path], list[str]]:
    """``rltk validate`` arguments as (recipe, config files, overrides), whatever their order.

    A ``key=value`` is an override, a ``.yaml``/``.yml`` (or any existing file
    other than a ``.py`` script) is a config file, anything else the recipe.
    """
    recipe, files, overrides = None, [Path(c) for c in (config or [])], []
    for arg in targets:
        path = Path(arg)
        if "=" in arg and not path.exists():
            overrides.append(arg)
        elif _is_yaml(arg) or (path.is_file() and path.suffix != ".py"):
            files.append(path)
        elif recipe is None:
            recipe = arg
        else:
            raise UsageError(f"two recipes given, '{recipe}' and '{arg}': validate checks one config at a time")
    return recipe, files, overrides


def cmd_validate(args) -> int:
    recipe, files, overrides = _validate_targets(args.targets, args.config)
    if recipe is None and not files:
        raise UsageError("validate needs a recipe or a config file, e.g. `rltk validate grpo` or "
                         "`rltk validate --config my.yaml grpo`")
    if recipe is None and len(files) == 1 and files[0].parent.name == "configs":
        # A recipe's own config (recipes/configs/grpo.yaml beside recipes/grpo.py) names its recipe.
        sibling = files[0].parent.parent / f"{files[0].stem}.py"
        recipe = str(sibling) if sibling.is_file() else None
    print(validate(recipe, files, overrides)[1])
    return EXIT_OK


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
    from rltk.training.setup import build_rows, sft_pairs, stage_config, tool_schemas

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


def cmd_run(args, extra: list[str]) -> int:
    recipe = resolve_recipe(args.recipe)
    files = _config_files(args.config, args.recipe)
    overrides = list(args.overrides) + extra
    for arg in overrides:
        if _is_yaml(arg) and "=" not in arg:
            raise UsageError(f"'{arg}' looks like a config file: pass it as `rltk run {args.recipe} --config {arg}`")
    # Validate before handing over, so a typo never costs a model load. The recipe validates
    # again as it starts (it can also run without this command) and prints the warnings then.
    load_config(files, overrides, recipe=recipe_spec(recipe), warn=False)
    argv = [str(recipe)]
    for f in files:
        argv += ["--config", str(f)]
    argv += overrides
    saved = sys.argv
    sys.argv = argv
    try:
        runpy.run_path(str(recipe), run_name="__main__")
    finally:
        sys.argv = saved
    return EXIT_OK


def cmd_export(args) -> int:
    from rltk.training.export import export_checkpoint

    from rltk.models.lora import is_adapter_folder

    out = export_checkpoint(args.checkpoint, args.out_dir, merge=args.merge)
    if is_adapter_folder(out):
        print(f"exported the LoRA adapter of {args.checkpoint} -> {out} (load with PeftModel.from_pretrained on the "
              f"base model, or as model.lora.path; `rltk export --merge` writes a plain model folder instead)")
    else:
        print(f"exported {args.checkpoint} -> {out} (load with AutoModelForCausalLM.from_pretrained)")
    return EXIT_OK


def cmd_dashboard(args) -> int:
    from rltk.dashboard.server import serve

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: must be in 0..65535")
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"rltk: warning: the dashboard listens on {args.host}: anyone who can reach this address can read "
              f"your runs and write YAML files into {args.save_dir}", file=sys.stderr)

    def ready(server):
        print(f"rltk dashboard: {server.url} (runs from {Path(args.runs).resolve()}, configs saved to "
              f"{Path(args.save_dir).resolve()}); Ctrl-C stops it", flush=True)

    try:
        serve(args.host, args.port, args.runs, args.save_dir, ready=ready)
    except OSError as exc:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from exc
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rltk", description="Composable RL components for LLM post-training."
    )
    parser.add_argument("--version", action="version", version=f"rltk {rltk.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="registered components, with their plugin and summary")
    p.add_argument("kind", nargs="?", help=f"one of: {', '.join(KINDS)}")
    sub.add_parser("plugins", help="loaded plugins: distribution, version, module, what each registers")
    p = sub.add_parser(
        "validate", help="check a config without running it: RECIPE, --config FILE, or a bare FILE, plus overrides",
        usage="rltk validate [RECIPE] [--config FILE ...] [FILE] [key=value ...]",
    )
    p.add_argument("targets", nargs="*", metavar="RECIPE|FILE|key=value",
                   help="a recipe (shipped name or .py script; checks what it can serve), a YAML file, overrides")
    p.add_argument("--config", action="append", help="YAML config (repeatable; default: the recipe's own)")
    p = sub.add_parser("run", help="run a shipped recipe by name, or a recipe script by path")
    p.add_argument("recipe")
    p.add_argument("--config", action="append", help="YAML config (repeatable; default: the recipe's own)")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p = sub.add_parser("export", help="write a plain Hugging Face model folder from a checkpoint")
    p.add_argument("checkpoint", help="a step_XXXXXX folder under <output_dir>/checkpoints")
    p.add_argument("out_dir")
    p.add_argument("--merge", action="store_true",
                   help="LoRA checkpoints: fold the adapter into the base model and write a plain model folder "
                        "(default: the adapter folder)")
    p = sub.add_parser("dashboard", help="a local web page: build a config from the schema and the registry, "
                                         "view runs (curves, steps, sampled trajectories)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 picks a free one)")
    p.add_argument("--runs", default="runs", help="folder whose subfolders are run folders (default ./runs)")
    p.add_argument("--save-dir", default=".", help="where the config builder saves YAML files (default .)")
    from rltk.serve.cli import add_parser as add_serve_parser

    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from rltk.distributed import strip_local_rank_argument

    parser = build_parser()
    argv = strip_local_rank_argument(list(sys.argv[1:] if argv is None else argv))
    try:
        args, extra = parser.parse_known_args(argv)
        if args.command == "validate":  # overrides after --config FILE land here
            args.targets += [e for e in extra if not e.startswith("-")]
            extra = [e for e in extra if e.startswith("-")]
        if args.command != "run" and extra:
            parser.error(f"unrecognised arguments: {' '.join(extra)}")
        if args.command == "list":
            return cmd_list(args)
        if args.command == "plugins":
            return cmd_plugins(args)
        if args.command == "validate":
            return cmd_validate(args)
        if args.command == "export":
            return cmd_export(args)
        if args.command == "dashboard":
            return cmd_dashboard(args)
        if args.command == "serve":
            from rltk.serve.cli import cmd_serve

            return cmd_serve(args)
        return cmd_run(args, extra)
    except (ConfigError, RegistryError, UsageError) as exc:
        print(f"rltk: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TrainingDiverged as exc:
        print(f"rltk: error: {exc}", file=sys.stderr)
        return EXIT_DIVERGED
    except LifecycleHookError as exc:
        # The plugin's own frames are what its author needs; rltk's training loop above them is not.
        cause = exc.__cause__
        if cause is not None:
            print("".join(traceback.format_exception(cause)).rstrip(), file=sys.stderr)
        print(f"rltk: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except CheckpointFileError as exc:  # a refused or damaged checkpoint file: the message names it
        print(f"rltk: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("rltk: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
