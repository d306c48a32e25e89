"""An OpenAI-compatible endpoint served from a rollout engine (the ``serve`` extra).

* :mod:`rltk.serve.app`: the FastAPI app (``/v1/models``, ``/v1/chat/completions``,
  ``/v1/completions``, ``/rltk/sessions``, ``/health``) and the state its routes share.
* :mod:`rltk.serve.auth`: API keys and whose sessions a caller may read.
* :mod:`rltk.serve.limits`: body size, JSON depth and per-request bounds, checked first.
* :mod:`rltk.serve.requests`: validation, chat rendering and tokenization of a request.
* :mod:`rltk.serve.responses`: choices, stop strings, tool calls, server-sent events.
* :mod:`rltk.serve.errors`: OpenAI-shaped errors.
* :mod:`rltk.serve.server`: uvicorn on a socket, or in a thread of the current process
  (:class:`~rltk.serve.server.BackgroundServer`, what training uses).
* :mod:`rltk.serve.batcher`: coalesces concurrent requests into batched engine calls
  made by one worker thread (engines are not thread-safe), sharing contended calls
  fairly and dropping requests whose clients left.
* :mod:`rltk.serve.sessions`: records a request's exact token ids and log-probs under
  its session id (bounded), and stitches a session into trajectories by token prefix.

The endpoint sits beside the rollout engines and workflows (the ``agentic`` workflow runs one in its
own process) and imports nothing above them; the ``rltk serve`` command, which finds and checks a
run's weights first, is :mod:`rltk.commands.serve`.

The web stack (FastAPI, uvicorn, and the ``openai`` client agents use) is an optional
dependency: ``import rltk`` never needs it, and :func:`require_serve_dependencies`
turns its absence into one error naming the extra to install.
"""

from __future__ import annotations

import importlib

SERVE_EXTRA_HINT = "pip install 'rltk[serve]'"


def require_serve_dependencies(*modules: str, feature: str = "the OpenAI-compatible endpoint") -> None:
    """Import ``modules`` (default: fastapi and uvicorn) or raise one ``ImportError`` naming the extra.

    Called before anything that needs the web stack, so a missing package is
    reported as what to install, not as a traceback from deep inside a run.
    """
    missing = []
    for name in modules or ("fastapi", "uvicorn"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ImportError(
            f"{feature} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed; "
            f"install the serve extra: {SERVE_EXTRA_HINT}"
        )
