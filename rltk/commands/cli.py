"""The ``rltk`` command line: list, plugins, validate, run, export, serve, serve-tinker, produce.

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
import os
import runpy
import sys
import traceback
from pathlib import Path

import rltk
from rltk.commands.new_plugin import cmd_new
from rltk.commands.produce import cmd_produce
from rltk.commands.serve import cmd_serve
from rltk.commands.serve_tinker import cmd_serve_tinker
from rltk.config.loader import load_config
from rltk.errors import ConfigError
from rltk.recipe_tools.validation import (  # noqa: F401 (shipped_recipes, VALIDATE_DEMONSTRATIONS: used from here by tests)
    VALIDATE_DEMONSTRATIONS, UsageError, _is_yaml, _recipes_dir, config_layers, default_config_for, resolve_recipe,
    shipped_recipe_spec, shipped_recipes, validate,
)
from rltk.registry import (
    KINDS, LifecycleHookError, RegistryError, get_registry, list_components, unknown_name_message,
)
from rltk.rewards.judges.reward_server import run as serve_reward
from rltk.errors import ProcessWaitError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

# The two errors below live in modules that import torch; this module does not import them, so that `rltk
# validate`, `rltk list` and `rltk dashboard` start without torch (tests/test_cli_imports.py). An exception of
# a class can only have been raised once its module ran, so main() looks them up among the loaded modules.
_DIVERGED = ("rltk.training.scaffold.guard", "TrainingDiverged")  # exit status guard.EXIT_DIVERGED (3)
_CHECKPOINT_FILE = ("rltk.serialization", "CheckpointFileError")


def _is_loaded_error(exc: BaseException, where: tuple[str, str]) -> bool:
    """Whether ``exc`` is an instance of the class ``where`` names, without importing its module."""
    module, name = where
    cls = getattr(sys.modules.get(module), name, None)
    return isinstance(cls, type) and isinstance(exc, cls)


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


def cmd_run(args, extra: list[str]) -> int:
    recipe = resolve_recipe(args.recipe)
    files = _config_files(args.config, args.recipe)
    overrides = list(args.overrides) + extra
    for arg in overrides:
        if _is_yaml(arg) and "=" not in arg:
            raise UsageError(f"'{arg}' looks like a config file: pass it as `rltk run {args.recipe} --config {arg}`")
    # A shipped recipe is validated before handing over, so a typo never costs a model load; it validates
    # again as it starts (it can also run without this command) and prints the warnings then. Someone's
    # script validates itself against the stages it hands parse_recipe_args, before anything heavy.
    if recipe.resolve().parent == _recipes_dir().resolve():
        defaults, chosen = config_layers(recipe, files)
        load_config(chosen, overrides, recipe=shipped_recipe_spec(recipe.stem), warn=False, defaults=defaults)
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
    from rltk.training.scaffold.export import export_checkpoint

    from rltk.models.lora import is_adapter_folder

    out = export_checkpoint(args.checkpoint, args.out_dir, merge=args.merge)
    if is_adapter_folder(out):
        print(f"exported the LoRA adapter of {args.checkpoint} -> {out} (load with PeftModel.from_pretrained on the "
              f"base model, or as model.lora.path; `rltk export --merge` writes a plain model folder instead)")
    else:
        from rltk.models.loading import is_vision_language_folder

        auto = "AutoModelForImageTextToText and AutoProcessor" if is_vision_language_folder(out) else \
            "AutoModelForCausalLM"
        print(f"exported {args.checkpoint} -> {out} (load with {auto}.from_pretrained)")
    return EXIT_OK


def cmd_dashboard(args) -> int:
    from rltk.dashboard.server import serve

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: must be in 0..65535")
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"rltk: warning: the dashboard listens on {args.host}: anyone who can reach this address can read "
              f"your runs and write YAML files into {args.save_dir}", file=sys.stderr)

    runs = Path(args.runs)
    if (runs / "metrics.jsonl").is_file() or (runs / "traces.jsonl").is_file():
        # a run folder where the folder of runs belongs: show its parent, where it is one of the runs
        print(f"rltk dashboard: {runs} is a run folder; listing the runs beside it in {runs.resolve().parent}",
              file=sys.stderr)
        args.runs = str(runs.resolve().parent)

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
    from rltk.commands.serve import add_parser as add_serve_parser

    add_serve_parser(sub)
    from rltk.commands.serve_tinker import add_parser as add_serve_tinker_parser

    add_serve_tinker_parser(sub)
    from rltk.commands.produce import add_parser as add_produce_parser

    add_produce_parser(sub)
    from rltk.commands.new_plugin import add_parser as add_new_parser

    add_new_parser(sub)
    from rltk.rewards.judges.reward_server import add_arguments as add_reward_server_arguments

    p = sub.add_parser("serve-reward", help="a reward model (sequence classification, num_labels=1) over HTTP, "
                                            "for reward_model's url= (POST /score)")
    add_reward_server_arguments(p)
    return parser


#: What runs each subcommand but ``run`` (which also takes the arguments argparse left: the recipe's overrides).
COMMANDS = {"list": cmd_list, "plugins": cmd_plugins, "validate": cmd_validate, "export": cmd_export,
            "dashboard": cmd_dashboard, "serve-reward": serve_reward, "serve": cmd_serve, "produce": cmd_produce,
            "serve-tinker": cmd_serve_tinker, "new": cmd_new}


def main(argv: list[str] | None = None) -> int:
    from rltk.argv import strip_local_rank_argument

    parser = build_parser()
    argv = strip_local_rank_argument(list(sys.argv[1:] if argv is None else argv))
    try:
        args, extra = parser.parse_known_args(argv)
        if args.command == "validate":  # overrides after --config FILE land here
            args.targets += [e for e in extra if not e.startswith("-")]
            extra = [e for e in extra if e.startswith("-")]
        if args.command != "run" and extra:
            parser.error(f"unrecognised arguments: {' '.join(extra)}")
        if args.command in COMMANDS:
            return COMMANDS[args.command](args)
        return cmd_run(args, extra)
    except (ConfigError, RegistryError, UsageError) as exc:
        print(f"rltk: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except LifecycleHookError as exc:
        # The plugin's own frames are what its author needs; rltk's training loop above them is not.
        cause = exc.__cause__
        if cause is not None:
            print("".join(traceback.format_exception(cause)).rstrip(), file=sys.stderr)
        print(f"rltk: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except ProcessWaitError as exc:  # a producer that died, a wait that ran out: the message names it
        print(f"rltk: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("rltk: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if _is_loaded_error(exc, _DIVERGED):  # the divergence guard stopped the run
            print(f"rltk: error: {exc}", file=sys.stderr)
            return sys.modules[_DIVERGED[0]].EXIT_DIVERGED
        if _is_loaded_error(exc, _CHECKPOINT_FILE):  # a refused or damaged checkpoint file: the message names it
            print(f"rltk: error: {exc}", file=sys.stderr)
            return EXIT_FAILURE
        raise


def console_main() -> None:
    """The ``rltk`` command (and ``python -m rltk.commands.cli``): :func:`main`'s status as the exit status.

    A process of a multi-process launch (torchrun, accelerate, deepspeed: ``WORLD_SIZE`` > 1) leaves
    through ``os._exit`` once its output is flushed: its process group is already ended, and under CPU
    contention a gloo thread's C++ destructor at interpreter exit can still abort ("terminate called
    without an active exception", exit -6) a run that finished, failing the whole launch.
    """
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
