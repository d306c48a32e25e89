"""``rltk serve-tinker [MODEL_DIR_OR_CHECKPOINT]``: the Tinker API over a local model, for the ``tinker`` SDK.

Point the SDK at it with ``TINKER_BASE_URL=http://HOST:PORT`` and ``TINKER_API_KEY=tml-...`` (one of
``--api-key``); training clients get LoRA adapters on the served model, see
:mod:`rltk.tinker_service`. PATH is what ``rltk serve`` takes (a model folder, a checkpoint, a run
folder); without it the untrained tiny model of the embedded default is served, under the name
``tiny``.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

from rltk.errors import ConfigError

#: The tiny default's random embeddings are scaled up this much. LoRA leaves the embeddings and the final norm
#: frozen, and at the default initialisation (std 0.02, tied head) every logit stays within about +-1.5: no
#: adapter could make any token likelier than about exp(-3). Scaled, a LoRA training client learns.
TINY_EMBEDDING_SCALE = 25.0
SDK_HEARTBEAT_S = 10.0
SERVED_TOKENIZER_DIR = "served-tokenizer"  # under --state-dir: what clients download (rltk.tinker_service.hub)  # tinker's InternalClientHolder._session_heartbeat
LIMIT_FLAGS = ("max_body_bytes", "max_datums", "max_batch_tokens", "max_samples", "max_sample_tokens",
               "max_lora_rank")


def _load(args, stack: contextlib.ExitStack):
    """``(model, tokenizer, served name, processor)`` for PATH (the processor a vision-language folder's, else
    None), or the tiny default."""
    from rltk.commands.serve import resolve_model_dir
    from rltk.models.loading import is_vision_language_folder, load_model, load_tokenizer

    model_dir, _ = resolve_model_dir(args.path, stack)
    if model_dir is None:
        from rltk.models.tiny import build_char_tokenizer, build_tiny_model

        import torch

        tokenizer = build_char_tokenizer()
        model = build_tiny_model(tokenizer)
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(TINY_EMBEDDING_SCALE)
        print("rltk: no PATH given: serving the untrained tiny model of the embedded default as 'tiny' (embeddings scaled for LoRA)",
              file=sys.stderr)
        return model, tokenizer, args.model_name or "tiny", None
    tokenizer = load_tokenizer(model_dir, config_key="rltk serve-tinker PATH")
    model = load_model(model_dir, dtype=args.dtype, config_key="rltk serve-tinker PATH")
    name = args.model_name or Path(args.path).expanduser().resolve().name
    processor = None
    if is_vision_language_folder(model_dir):  # its image chunks are read (rltk.tinker_service.images)
        from rltk.models.loading import load_processor

        processor = load_processor(model_dir, tokenizer)
    return model, tokenizer, name, processor


def _limits(args):
    from rltk.tinker_service.validation import TinkerLimits

    for name in LIMIT_FLAGS + ("max_models_per_key", "max_samplers", "max_queued"):
        if getattr(args, name) < 1:
            raise ConfigError(f"rltk serve-tinker: --{name.replace('_', '-')} must be an integer >= 1, "
                              f"got {getattr(args, name)}")
    if not args.session_timeout > SDK_HEARTBEAT_S:
        raise ConfigError(f"rltk serve-tinker: --session-timeout must be more than the SDK's heartbeat period of "
                          f"{SDK_HEARTBEAT_S:.0f} s, got {args.session_timeout}")
    return TinkerLimits(**{name: getattr(args, name) for name in LIMIT_FLAGS})


def build_service(args):
    """``(app, state, stack)`` for ``rltk serve-tinker`` arguments; ``stack`` holds temporary folders."""
    import torch

    from rltk.serve.auth import api_keys_from
    from rltk.tinker_service.adapters import Workspace
    from rltk.tinker_service.app import create_app
    from rltk.tinker_service.state import ServiceState
    from rltk.tinker_service.futures import FutureStore
    from rltk.tinker_service.hub import ServedTokenizer
    from rltk.tinker_service.sessions import Registry

    keys = api_keys_from(args.api_key)
    bad = [k for k in keys if not k.startswith("tml-")]
    if bad:
        raise ConfigError("rltk serve-tinker: --api-key values must start with 'tml-' (the tinker SDK refuses other "
                          f"keys), got {len(bad)} that do not")
    limits = _limits(args)
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"rltk serve-tinker: --threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    stack = contextlib.ExitStack()
    try:
        if args.state_dir:
            state_dir = Path(args.state_dir).expanduser()
            state_dir.mkdir(parents=True, exist_ok=True)
        else:
            state_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rltk-tinker-")))
        model, tokenizer, name, processor = _load(args, stack)
        served = ServedTokenizer.write(name, tokenizer, getattr(model, "config", None), state_dir / SERVED_TOKENIZER_DIR)
        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        model.to(device)
        for p in model.parameters():
            p.requires_grad_(False)
        state = ServiceState(
            workspace=Workspace(model, tokenizer, processor), model_name=name, tokenizer=served,
            registry=Registry(state_dir, session_timeout_s=args.session_timeout,
                              max_models_per_owner=args.max_models_per_key, max_samplers_per_session=args.max_samplers),
            futures=FutureStore(max_queued_per_owner=args.max_queued), limits=limits)
        state.start_reaper()
        stack.callback(state.close)
        return create_app(state, api_keys=keys, docs=args.docs), state, stack
    except BaseException:
        stack.close()
        raise


def cmd_serve_tinker(args) -> int:
    """Serve until interrupted; prints the base URL (with the real port when ``--port 0``) on stdout."""
    from rltk.tinker_service import require_tinker_dependencies

    try:
        require_tinker_dependencies()
    except ImportError as exc:
        raise ConfigError(str(exc)) from None
    import uvicorn

    from rltk.serve.auth import api_keys_from, exposure_warning
    from rltk.serve.server import free_socket

    app, state, stack = build_service(args)
    warning = exposure_warning(args.host, api_keys_from(args.api_key))
    if warning:
        print(warning.replace("rltk serve:", "rltk serve-tinker:").replace("generate with", "train and sample"),
              file=sys.stderr, flush=True)
    with stack:
        try:
            sock = free_socket(args.host, args.port)
        except OSError as exc:
            raise ConfigError(f"rltk serve-tinker: cannot listen on {args.host}:{args.port} (--host/--port): "
                              f"{exc.strerror or exc}") from None
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"rltk: serving the Tinker API for model '{state.model_name}' at http://{host}:"
              f"{sock.getsockname()[1]} (TINKER_BASE_URL; Ctrl-C stops)", flush=True)
        config = uvicorn.Config(app, log_level=args.log_level, timeout_keep_alive=30)
        uvicorn.Server(config).run(sockets=[sock])
    return 0


def add_parser(sub) -> None:
    """The ``serve-tinker`` subcommand's arguments."""
    from rltk.tinker_service.validation import TinkerLimits  # no web stack needed

    p = sub.add_parser("serve-tinker", help="serve the Tinker API (the tinker SDK's training and sampling calls) "
                                            "over a local model, with LoRA adapters per training client")
    p.add_argument("path", nargs="?", metavar="MODEL_DIR_OR_CHECKPOINT",
                   help="a model folder, a checkpoint or a run's output_dir (default: the tiny model, as 'tiny')")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one and prints it)")
    p.add_argument("--model-name", help="the base_model name clients pass (default: the folder's name, or tiny)")
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="a key (tml-...) the SDK must send as TINKER_API_KEY (repeatable; default: $RLTK_API_KEY, "
                        "comma-separated; none: any key is accepted). Each key sees only its own clients")
    p.add_argument("--state-dir", help="where save_state / save_weights_for_sampler write (default: a temporary "
                                       "folder removed on exit)")
    p.add_argument("--dtype", default="float32", help="weights dtype: float32, bfloat16, float16, auto")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; 1 is fastest on a busy machine)")
    p.add_argument("--session-timeout", type=float, default=120.0,
                   help="seconds without a heartbeat (the SDK sends one every 10 s) after which a session's "
                        "adapters and samplers are released (default 120)")
    p.add_argument("--max-models-per-key", type=int, default=4, help="training clients one key may hold (default 4)")
    p.add_argument("--max-samplers", type=int, default=8,
                   help="samplers a session keeps; the oldest is released past it (default 8)")
    p.add_argument("--max-queued", type=int, default=256, help="queued operations per key; more is a 429 (default 256)")
    limits = TinkerLimits()
    for name in LIMIT_FLAGS:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(limits, name),
                       help=f"(default {getattr(limits, name)})")
    p.add_argument("--docs", action="store_true", help="serve /docs and /openapi.json (off by default)")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
