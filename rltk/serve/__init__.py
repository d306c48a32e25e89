"""An OpenAI-compatible endpoint served from a rollout engine (the ``serve`` extra).

* :mod:`rltk.serve.app`: the FastAPI app (``/v1/models``, ``/v1/chat/completions``,
  ``/v1/completions``) and :class:`~rltk.serve.app.BackgroundServer`, uvicorn in
  a thread of the current process.
* :mod:`rltk.serve.batcher`: coalesces concurrent requests into batched engine calls
  made by one worker thread (engines are not thread-safe).
* :mod:`rltk.serve.sessions`: records every request's exact token ids and log-probs
  under a session id, and stitches a session into trajectories by token prefix.

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
