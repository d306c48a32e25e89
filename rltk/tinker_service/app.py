"""The FastAPI app the Tinker SDK talks to: ``/api/v1/...`` as ``tinker`` 0.38 calls it.

Routes answer at once; model work is queued (:mod:`rltk.tinker_service.futures`) and fetched by
``/api/v1/retrieve_future``. Request bodies are parsed with the SDK's own pydantic types (JSON) and
protobuf schema (:mod:`rltk.tinker_service.wire`), so the wire format is the SDK's by construction.
The state the routes share is :mod:`rltk.tinker_service.state`.
"""

from __future__ import annotations

from rltk.serve.errors import APIError
from rltk.tinker_service.sessions import NotFound
from rltk.tinker_service.state import API_KEY_HEADER, ServiceState

__all__ = ["ServiceState", "create_app"]


def create_app(state: ServiceState, *, api_keys: list[str] | None = None, docs: bool = False):
    """The app over ``state``; with ``api_keys``, every route but ``/api/v1/healthz`` needs one as ``X-API-Key``."""
    from fastapi import FastAPI

    from rltk.serve.auth import APIKeyMiddleware
    from rltk.serve.errors import install_error_handlers
    from rltk.tinker_service import routes
    from rltk.tinker_service.hub import add_hub_routes

    app = FastAPI(title="rltk serve-tinker", docs_url="/docs" if docs else None,
                  openapi_url="/openapi.json" if docs else None, redoc_url=None)
    app.state.rltk_tinker = state
    install_error_handlers(app, state.counters)

    @app.exception_handler(NotFound)
    async def _not_found(request, exc: NotFound):
        from rltk.serve.errors import error_response

        state.counters["errors"] += 1
        return error_response(APIError(404, str(exc), code="not_found"))

    routes.add_service_routes(app, state)
    routes.add_training_routes(app, state)
    routes.add_sampling_routes(app, state)
    routes.add_future_routes(app, state)
    add_hub_routes(app, state.tokenizer)
    app.add_middleware(APIKeyMiddleware, keys=list(api_keys or []), key_header=API_KEY_HEADER.encode(),
                       open_paths=frozenset({"/api/v1/healthz"}))
    return app
