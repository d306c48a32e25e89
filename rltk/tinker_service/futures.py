"""Futures as the Tinker SDK polls them: every model operation is queued, answered by a request id,
and fetched with ``/api/v1/retrieve_future``.

All model work runs on one worker thread, in the order the requests arrived: the SDK submits a
training client's operations one at a time (``forward_backward`` chunks together, then
``optim_step``), so arrival order is the order it asked for, and peft's active adapter (global
state of the module) is never switched under a running pass. ``retrieve`` waits up to ``wait_s``
for a result and otherwise answers ``try_again``, which the SDK polls again at once.

A result is kept until ``result_ttl_s`` after it finished (the SDK may fetch it again after a
dropped connection), and every future of a session is dropped, queued work cancelled, when the
session ends or stops sending heartbeats (:mod:`rltk.tinker_service.sessions`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

logger = logging.getLogger("rltk.tinker_service")


class UserError(ValueError):
    """Bad input found while the work ran; the SDK gets it as a failed request of category ``user``."""


class TooBusy(Exception):
    """More queued work for one key than the service allows (answered 429: the SDK backs off and retries)."""


@dataclass
class Entry:
    """One queued operation: who may fetch it, how its result is encoded, and its future."""

    owner: str
    session: str
    proto: bool  # the result is protobuf bytes (fwd/bwd, samples); else a JSON dict
    future: concurrent.futures.Future
    finished_at: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class FutureStore:
    """Queues work on the single worker thread and keeps each result until fetched (and a while after)."""

    def __init__(self, *, max_queued_per_owner: int = 256, result_ttl_s: float = 600.0):
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rltk-tinker-worker")
        self.entries: dict[str, Entry] = {}
        self._lock = threading.Lock()  # the routes and the session reaper (another thread) both change entries
        self.max_queued_per_owner = max_queued_per_owner
        self.result_ttl_s = result_ttl_s

    def submit(self, owner: str, session: str, fn: Callable[[], Any], *, proto: bool = False) -> str:
        """Queue ``fn`` for ``owner``; returns its request id. Raises :class:`TooBusy` over the limit."""
        self.sweep()
        with self._lock:
            queued = sum(1 for e in self.entries.values() if e.owner == owner and not e.future.done())
            if queued >= self.max_queued_per_owner:
                raise TooBusy(f"{queued} operations of this API key are queued, this service's limit "
                              f"(--max-queued {self.max_queued_per_owner}); retry after some finish")
            request_id = uuid.uuid4().hex
            future = self.executor.submit(fn)
            entry = Entry(owner=owner, session=session, proto=proto, future=future)
            future.add_done_callback(lambda _: setattr(entry, "finished_at", time.monotonic()))
            self.entries[request_id] = entry
        return request_id

    def run(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the worker thread, behind the queued work, with no request id (bookkeeping)."""
        return self.executor.submit(fn)

    def get(self, request_id: str, owner: str) -> Entry | None:
        """The entry, or ``None`` when it does not exist or belongs to another key (indistinguishable)."""
        entry = self.entries.get(request_id)
        return entry if entry is not None and entry.owner == owner else None

    async def wait(self, entry: Entry, wait_s: float) -> bool:
        """Whether ``entry`` finished within ``wait_s`` seconds."""
        if not entry.future.done():
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(entry.future)), wait_s)
            except (asyncio.TimeoutError, concurrent.futures.CancelledError, asyncio.CancelledError):
                pass
            except Exception:  # the work's own failure: reported by the caller from the future
                pass
        return entry.future.done()

    def drop_session(self, session: str) -> int:
        """Cancel the session's queued work and forget its results; returns how many entries went."""
        with self._lock:
            gone = [self.entries.pop(rid) for rid, e in list(self.entries.items()) if e.session == session]
        for entry in gone:
            entry.future.cancel()
        return len(gone)

    def sweep(self) -> None:
        """Forget results finished more than ``result_ttl_s`` ago."""
        now = time.monotonic()
        with self._lock:
            stale = [rid for rid, e in self.entries.items()
                     if e.finished_at is not None and now - e.finished_at > self.result_ttl_s]
            for rid in stale:
                del self.entries[rid]

    def queued(self, owner: str) -> int:
        with self._lock:
            return sum(1 for e in self.entries.values() if e.owner == owner and not e.future.done())

    def close(self) -> None:
        with self._lock:
            entries = list(self.entries.values())
        for entry in entries:
            entry.future.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)
