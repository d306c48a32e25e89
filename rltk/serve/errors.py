"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

Every refusal the endpoint makes is an :class:`APIError`; :func:`install_error_handlers`
turns it, FastAPI's own HTTP errors and anything unexpected into that shape, so the
``openai`` client raises its own error classes with the message.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("rltk.serve")


class APIError(Exception):
    """A request the endpoint refuses, answered as OpenAI's ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(error: APIError, headers: dict | None = None):
    from fastapi.responses import JSONResponse

    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def install_error_handlers(app, counters: dict) -> None:
    """Answer every error of ``app`` in OpenAI's shape, counting them in ``counters["errors"]``."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        counters["errors"] += 1
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        counters["errors"] += 1
        error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                         code="not_found" if exc.status_code == 404 else None)
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        counters["errors"] += 1
        return error_response(APIError(400, str(exc)))

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception):
        # Only the engine's own failures get here (requests are validated first); the traceback goes to the
        # server's log, the client gets the one-line cause.
        counters["errors"] += 1
        logger.error("request %s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(APIError(500, f"the rollout engine failed: {type(exc).__name__}: {exc}",
                                       type="server_error"))
