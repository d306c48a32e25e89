"""The Tinker API on your own machine: the service the official ``tinker`` SDK talks to
(``rltk serve-tinker``; the ``tinker`` and ``serve`` extras).

* :mod:`rltk.tinker_service.app`: the app: error handlers, API keys, the routes mounted.
* :mod:`rltk.tinker_service.state`: the state the routes share, futures and failures as the SDK
  reads them, and the session reaper.
* :mod:`rltk.tinker_service.routes`: the ``/api/v1`` routes (service and sessions, training clients
  and checkpoints, samplers, ``retrieve_future``).
* :mod:`rltk.tinker_service.wire`: the SDK's protobuf bodies (``forward_backward`` in; fwd/bwd
  outputs and samples out).
* :mod:`rltk.tinker_service.validation`: the bounds, and the checks whose 400s name the field.
* :mod:`rltk.tinker_service.sessions`: sessions, training clients, samplers and checkpoints, each
  owned by an API key; heartbeats and release.
* :mod:`rltk.tinker_service.futures`: the single worker thread and the results the SDK polls for.
* :mod:`rltk.tinker_service.adapters`: the base model with one LoRA adapter and Adam per training
  client, frozen adapter copies for samplers, log-probs, sampling, saving and loading.
* :mod:`rltk.tinker_service.losses`: Tinker's loss names mapped onto registered policy losses.
* :mod:`rltk.tinker_service.images`: the SDK's image chunks, for a vision-language model: decoded,
  counted by its processor, their tokens put in place.

It sits beside :mod:`rltk.serve` (whose API-key middleware, body limits and error shapes it
reuses) and imports nothing above the rollout engines; the command is
:mod:`rltk.commands.serve_tinker`.
"""

from __future__ import annotations

TINKER_EXTRA_HINT = "pip install 'rltk[tinker,serve]'"


def require_tinker_dependencies() -> None:
    """Import the SDK (its protobuf schema and request types) and the web stack, or raise one ImportError."""
    import importlib

    missing = []
    for name in ("tinker", "fastapi", "uvicorn", "zstandard"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ImportError(f"rltk serve-tinker needs {', '.join(missing)}, not installed; install the extras: "
                          f"{TINKER_EXTRA_HINT}")
