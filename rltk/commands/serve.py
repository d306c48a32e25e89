"""``rltk serve [CHECKPOINT_OR_MODEL_DIR]``: the OpenAI-compatible endpoint over a saved policy.

PATH may be:

* a Hugging Face model folder (``config.json`` + weights + tokenizer), e.g. one
  written by ``rltk export``;
* a checkpoint, ``<output_dir>/checkpoints/step_XXXXXX``: it is exported (and
  verified) to a temporary model folder first, exactly as ``rltk export`` would,
  with the run's tokenizer;
* a run folder (``<output_dir>``): its newest checkpoint;
* nothing: the untrained tiny model of the embedded default, to try the endpoint.

The rollout engine is ``--engine`` (default: the run's ``rollout.engine`` when
PATH belongs to a run, else ``hf``), with the run's ``rollout.engine_args``
unless ``--engine-arg key=value`` overrides them.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import tempfile
from pathlib import Path
from typing import Any

from rltk.errors import ConfigError

CONFIG_FILE = "config.yaml"
LIMIT_FLAGS = ("max_body_bytes", "max_json_depth", "max_prompt_chars", "max_prompts", "max_choices",
               "max_request_tokens")


def resolve_model_dir(path: str | None, stack: contextlib.ExitStack) -> tuple[Path | None, Path | None]:
    """``(model folder, run folder)`` for PATH; a checkpoint is exported into a temporary folder on ``stack``.

    Weights are checked before anything loads them (:func:`rltk.models.integrity.check_weights`): a
    damaged file is refused with its name. A run folder falls back from a damaged newest checkpoint
    to the newest intact one, with a warning naming what was skipped (nothing is moved: serving
    only reads the run).
    """
    from rltk.checkpoint import STATE_FILE, CheckpointManager, damage_summary
    from rltk.models.integrity import check_weights
    from rltk.serialization import CheckpointFileError, UnsafeCheckpointError

    if path is None:
        return None, None
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"rltk serve: '{path}' is not a folder; pass a model folder (config.json and weights), "
                          "a checkpoint step_XXXXXX folder, or a run's output_dir")
    if (folder / "config.json").is_file():
        check_weights(folder)
        return folder, None
    if (folder / "checkpoints").is_dir():
        manager = CheckpointManager(folder / "checkpoints")
        skipped = []
        for _, checkpoint in reversed(manager.checkpoints()):
            damage = manager.verify(checkpoint)  # UnsafeCheckpointError propagates: tampering is not damage
            try:
                if damage:
                    raise CheckpointFileError(damage[0].path, damage_summary(damage, checkpoint))
                model_dir = _export_checked(checkpoint, stack)
            except UnsafeCheckpointError:
                raise
            except CheckpointFileError as exc:
                skipped.append(f"{checkpoint.name}: {exc}")
                continue
            for line in skipped:
                print(f"rltk serve: WARNING: skipping damaged checkpoint {line}", file=sys.stderr)
            if skipped:
                print(f"rltk serve: serving the newest intact checkpoint, {checkpoint.name}", file=sys.stderr)
            return model_dir, folder
        if skipped:
            raise ConfigError(f"rltk serve: every checkpoint of run folder '{path}' is damaged: " + "; ".join(skipped))
        raise ConfigError(f"rltk serve: run folder '{path}' has no complete checkpoint under checkpoints/ "
                          "(train with checkpoint.every > 0, or serve an exported model folder)")
    if (folder / STATE_FILE).is_file():
        return _export_checked(folder, stack), folder.parent.parent
    present = sorted(p.name for p in folder.iterdir())[:12]
    raise ConfigError(f"rltk serve: '{path}' is neither a model folder (no config.json), a checkpoint (no "
                      f"{STATE_FILE}) nor a run folder (no checkpoints/); it holds {present}")


def _export_checked(checkpoint: Path, stack: contextlib.ExitStack) -> Path:
    """The checkpoint exported to a temporary folder, its weights checked (named in the checkpoint) first."""
    from rltk.models.integrity import check_weights
    from rltk.training.scaffold.export import export_checkpoint

    if (checkpoint / "model").is_dir():
        check_weights(checkpoint / "model")
    out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rltk-serve-"))) / "model"
    exported = export_checkpoint(checkpoint, out)
    check_weights(exported)  # what a sharded checkpoint consolidated to
    return exported


def _engine_args(run_dir: Path | None, engine: str | None, overrides: list[str]) -> tuple[str, dict]:
    from omegaconf import OmegaConf

    name, args = "hf", {}
    config = run_dir / CONFIG_FILE if run_dir is not None else None
    if config is not None and config.is_file():
        saved = OmegaConf.load(config)
        name = OmegaConf.select(saved, "rollout.engine", default="hf")
        saved_args = OmegaConf.select(saved, "rollout.engine_args", default=None)
        args = OmegaConf.to_container(saved_args, resolve=True) if saved_args is not None else {}
    if engine is not None and engine != name:
        name, args = engine, {}  # another engine's arguments would not fit this one
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"rltk serve: --engine-arg takes key=value, got {item!r}")
        args[key] = _parse_value(value)
    return name, args


def _parse_value(value: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


def build_server_app(args) -> tuple[Any, contextlib.ExitStack, str]:
    """The app for ``rltk serve`` arguments, the stack holding its temporary files, and the model id."""
    import torch

    import rltk
    from rltk.models.loading import load_model, load_tokenizer
    from rltk.rollout.base import SamplingParams
    from rltk.serve.app import create_app
    from rltk.serve.auth import api_keys_from
    from rltk.serve.limits import Limits
    from rltk.serve.sessions import SessionStore

    if args.max_tokens < 1:
        raise ConfigError(f"rltk serve: --max-tokens must be >= 1, got {args.max_tokens}")
    if args.slice_tokens < 0:
        raise ConfigError(f"rltk serve: --slice-tokens must be >= 0 (0: whole completions), got {args.slice_tokens}")
    for flag in ("max_batch", "max_batch_tokens", "max_share_tokens", "max_sessions", "session_max_records",
                 "session_max_bytes"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"rltk serve: --{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    try:
        limits = Limits(**{name: getattr(args, name) for name in LIMIT_FLAGS})
    except ValueError as exc:
        name = str(exc).split(": ")[1].split(" must")[0]
        raise ConfigError(f"rltk serve: --{name.replace('_', '-')} must be an integer >= 1, got "
                          f"{getattr(args, name)}") from None
    stack = contextlib.ExitStack()
    try:
        model_dir, run_dir = resolve_model_dir(args.path, stack)
        if model_dir is None:
            from rltk.models.tiny import build_char_tokenizer, build_tiny_model

            tokenizer = build_char_tokenizer(tool_role=True)  # agents send tool results
            model = build_tiny_model(tokenizer)
            name = args.model_name or "tiny"
            print("rltk: no PATH given: serving the untrained tiny model of the embedded default", file=sys.stderr)
        else:
            tokenizer = load_tokenizer(model_dir, config_key="rltk serve PATH")
            model = load_model(model_dir, dtype=args.dtype, config_key="rltk serve PATH")
            name = args.model_name or Path(args.path).expanduser().resolve().name
        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        model.to(device)
        model.eval()
        engine_name, engine_args = _engine_args(run_dir, args.engine, args.engine_arg or [])
        engine_cls = rltk.get_component("rollout_engine", engine_name)
        if model_dir is not None and "model_path" in inspect.signature(engine_cls).parameters:
            engine_args.setdefault("model_path", str(model_dir))  # vllm loads the weights from the folder itself
        engine = engine_cls(model=model, tokenizer=tokenizer, **engine_args)
        max_len = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        limit = min(args.max_tokens, max_len - 1) if max_len else args.max_tokens
        if limit < args.max_tokens:
            print(f"rltk: --max-tokens {args.max_tokens} is more than the model's context of {max_len} tokens "
                  f"leaves after a one-token prompt: a request may ask for at most {limit}", file=sys.stderr)
        store = None
        if args.record_sessions:
            store = SessionStore(max_sessions=args.max_sessions, max_records=args.session_max_records,
                                 max_bytes=args.session_max_bytes)
        app = create_app(engine, tokenizer, model_name=name, defaults=SamplingParams(max_new_tokens=limit),
                         max_tokens_limit=limit, max_model_len=max_len, tool_parser=args.tool_parser,
                         store=store, window_s=args.batch_window, max_batch=args.max_batch,
                         api_keys=api_keys_from(args.api_key), limits=limits, docs=args.docs,
                         slice_tokens=args.slice_tokens or None, max_batch_tokens=args.max_batch_tokens,
                         max_share_tokens=args.max_share_tokens, accept_weights=args.accept_weights)
        return app, stack, name
    except BaseException:
        stack.close()
        raise


def cmd_serve(args) -> int:
    """Serve until interrupted; prints the base URL (with the real port when ``--port 0``) on stdout."""
    from rltk.serve import require_serve_dependencies

    try:
        require_serve_dependencies(feature="rltk serve")
    except ImportError as exc:  # a usage problem with one fix, not a traceback
        raise ConfigError(str(exc)) from None
    import uvicorn

    from rltk.serve.auth import api_keys_from, exposure_warning
    from rltk.serve.server import free_socket

    app, stack, name = build_server_app(args)
    warning = exposure_warning(args.host, api_keys_from(args.api_key))
    if warning:
        print(warning, file=sys.stderr, flush=True)
    with stack:
        try:
            sock = free_socket(args.host, args.port)
        except OSError as exc:  # taken port, an address not on this machine: one line, not a traceback
            raise ConfigError(f"rltk serve: cannot listen on {args.host}:{args.port} (--host/--port): "
                              f"{exc.strerror or exc}") from None
        port = sock.getsockname()[1]
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"rltk: serving model '{name}' at http://{host}:{port}/v1 (Ctrl-C stops)", flush=True)
        config = uvicorn.Config(app, log_level=args.log_level, timeout_keep_alive=30)
        uvicorn.Server(config).run(sockets=[sock])
    return 0


def add_parser(sub) -> None:
    """The ``serve`` subcommand's arguments."""
    from rltk.serve.limits import Limits  # no web stack needed

    p = sub.add_parser("serve", help="serve a model folder, checkpoint or run on an OpenAI-compatible endpoint")
    p.add_argument("path", nargs="?", metavar="CHECKPOINT_OR_MODEL_DIR",
                   help="a model folder, a checkpoint step_XXXXXX folder or a run's output_dir "
                        "(default: the untrained tiny model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one and prints it)")
    p.add_argument("--model-name", help="the model id clients pass (default: the folder's name)")
    p.add_argument("--engine", help="rollout engine (default: the run's rollout.engine, else hf)")
    p.add_argument("--engine-arg", action="append", metavar="KEY=VALUE", help="rollout engine argument (repeatable)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="most new tokens per request (default 256; at most the model's context minus one)")
    p.add_argument("--dtype", default="float32", help="weights dtype: float32, bfloat16, float16, auto")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    p.add_argument("--tool-parser", default="hermes", help="tool-call parser for requests with tools")
    p.add_argument("--batch-window", type=float, default=0.05,
                   help="seconds the batcher waits after a request for another (default 0.05)")
    p.add_argument("--max-batch", type=int, default=64, help="most sequences per engine call from several requests")
    p.add_argument("--slice-tokens", type=int, default=16,
                   help="most tokens generated per engine call: longer completions continue in later calls, so a "
                        "large request shares the engine with others and a cancelled one stops soon "
                        "(default 16; 0 generates whole completions per call)")
    p.add_argument("--max-batch-tokens", type=int, default=4096,
                   help="with --slice-tokens, the most work per engine call: over its rows, the context re-read "
                        "plus the tokens it may make (default 4096)")
    p.add_argument("--max-share-tokens", type=int, default=512,
                   help="with --slice-tokens, the most of that work one session gets per engine call (default 512: "
                        "a large request runs in short calls, so others wait little; raise it for throughput). "
                        "Rows are shared round-robin between sessions; a request without X-Session-Id is its own")
    p.add_argument("--accept-weights", action="store_true",
                   help="serve POST /rltk/weights: load a safetensors file on this machine into the model by path "
                        "(a trainer's server engine sends each new version so; off by default)")
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="a key every route but /health requires as 'Authorization: Bearer KEY' (repeatable: each "
                        "key then reads only its own sessions; default: $RLTK_API_KEY, comma-separated)")
    p.add_argument("--docs", action="store_true", help="serve /docs and /openapi.json (off by default)")
    p.add_argument("--record-sessions", action="store_true",
                   help="record every choice's token ids and log-probs under its X-Session-Id, readable by the "
                        "key that wrote it at GET /rltk/sessions/{id} (off by default)")
    p.add_argument("--max-sessions", type=int, default=1000,
                   help="recorded sessions kept (oldest dropped; default 1000)")
    p.add_argument("--session-max-records", type=int, default=4096,
                   help="records kept per recorded session, oldest dropped (default 4096)")
    p.add_argument("--session-max-bytes", type=int, default=64 << 20,
                   help="estimated bytes kept per recorded session, oldest dropped (default 64 MiB)")
    limits = Limits()
    p.add_argument("--max-body-bytes", type=int, default=limits.max_body_bytes,
                   help=f"largest request body; more is a 413 (default {limits.max_body_bytes})")
    p.add_argument("--max-json-depth", type=int, default=limits.max_json_depth,
                   help=f"deepest JSON nesting of a body (default {limits.max_json_depth})")
    p.add_argument("--max-prompt-chars", type=int, default=limits.max_prompt_chars,
                   help="characters of a request's prompts, checked before tokenizing "
                        f"(default {limits.max_prompt_chars})")
    p.add_argument("--max-prompts", type=int, default=limits.max_prompts,
                   help=f"prompts in one /v1/completions request (default {limits.max_prompts})")
    p.add_argument("--max-choices", type=int, default=limits.max_choices,
                   help=f"prompts x n in one request (default {limits.max_choices})")
    p.add_argument("--max-request-tokens", type=int, default=limits.max_request_tokens,
                   help=f"prompts x n x max_tokens in one request (default {limits.max_request_tokens})")
    p.add_argument("--log-level", default="info", help="uvicorn log level")
