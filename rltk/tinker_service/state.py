"""What the routes share: the service's state, queueing work and answering with a future, and the
failed-request shape the SDK reads. The routes (:mod:`rltk.tinker_service.routes`) and the app
(:mod:`rltk.tinker_service.app`) import it; it imports neither.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from rltk.serve.errors import APIError
from rltk.tinker_service.adapters import Workspace
from rltk.tinker_service.hub import ServedTokenizer
from rltk.tinker_service.futures import FutureStore, TooBusy, UserError
from rltk.tinker_service.losses import LossError
from rltk.tinker_service.sessions import NotFound, Registry, owner_of
from rltk.tinker_service.validation import TinkerLimits

logger = logging.getLogger("rltk.tinker_service")
API_KEY_HEADER = "x-api-key"
#: Seconds ``retrieve_future`` waits for a result before answering ``try_again`` (the SDK's own timeout is 45).
RETRIEVE_WAIT_S = 20.0


@dataclass
class ServiceState:
    """What the routes share: the model workspace, the futures, who owns what, and the bounds."""

    workspace: Workspace
    model_name: str
    tokenizer: ServedTokenizer
    registry: Registry
    futures: FutureStore
    limits: TinkerLimits = field(default_factory=TinkerLimits)
    lock: threading.Lock = field(default_factory=threading.Lock)
    counters: dict = field(default_factory=lambda: {"errors": 0})
    _reaper: threading.Thread | None = None
    _closed: threading.Event = field(default_factory=threading.Event)

    def owner(self, request) -> str:
        return owner_of(request.headers.get(API_KEY_HEADER))

    def release(self, session_id: str) -> bool:
        """End a session: its queued work is cancelled, then its adapters and samplers are dropped."""
        with self.lock:
            ended = self.registry.end_session(session_id)
            if ended is None:
                return False
            self.futures.drop_session(session_id)
        models, samplers = ended

        def drop():
            for sampler_id in samplers:
                self.workspace.drop_sampler(sampler_id)
            for model_id in models:
                self.workspace.drop(model_id)

        self.futures.run(drop)
        logger.info("released session %s: %d training clients, %d samplers", session_id, len(models), len(samplers))
        return True

    def start_reaper(self, every_s: float = 2.0) -> None:
        """A daemon thread that releases sessions whose heartbeats stopped."""

        def loop():
            while not self._closed.wait(every_s):
                with self.lock:
                    expired = self.registry.expired()
                for session_id in expired:
                    self.release(session_id)

        self._reaper = threading.Thread(target=loop, name="rltk-tinker-reaper", daemon=True)
        self._reaper.start()

    def close(self) -> None:
        self._closed.set()
        self.futures.close()


def submit(state: ServiceState, owner: str, session: str, fn, *, proto: bool = False, **extra) -> dict:
    """Queue ``fn``; the SDK's ``UntypedAPIFuture`` for it."""
    try:
        request_id = state.futures.submit(owner, session, fn, proto=proto)
    except TooBusy as exc:
        raise APIError(429, str(exc), code="too_many_queued") from None
    return {"request_id": request_id, **extra}


async def on_worker(state: ServiceState, fn) -> Any:
    """Run ``fn`` on the worker thread (behind queued work) and wait for it."""
    return await asyncio.wrap_future(state.futures.run(fn))


def served_model(state: ServiceState, field_name: str, base_model: str | None) -> str:
    if base_model != state.model_name:
        raise APIError(400, f"{field_name}: this service serves only {state.model_name!r}, got {base_model!r}",
                       param=field_name)
    return base_model


def retrieve_payload(entry) -> tuple[Any, bool]:
    """``(body, is_protobuf)`` for a finished entry: its result, or the SDK's failed-request shape."""
    future = entry.future
    if future.cancelled():
        return {"error": "cancelled: its session ended before the work ran", "category": "server"}, False
    exc = future.exception()
    if exc is None:
        return future.result(), entry.proto
    if isinstance(exc, (UserError, LossError, NotFound, KeyError, ValueError)):
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        return {"error": str(message), "category": "user"}, False
    logger.error("tinker operation failed", exc_info=exc)
    return {"error": f"{type(exc).__name__}: {exc}", "category": "server"}, False
