"""A JSON POST with a timeout, for reward functions that call a server (``reward_model`` by URL, ``llm_judge``).

The standard library's ``urllib`` rather than ``httpx``: these rewards then work in a base install,
without the ``serve`` extra. Errors come out as three kinds a caller can count apart:
``TimeoutError`` (no whole answer within ``timeout_s``), ``ConnectionError`` (nothing listens, the
connection broke) and ``ValueError`` (an HTTP error status or a body that is not the JSON expected;
:class:`ServerError`, a subclass, for the statuses worth retrying: 5xx and 429).
"""

from __future__ import annotations

import functools
import http.client
import io
import json
import socket
import time
import urllib.error
import urllib.request
from typing import Any


def post_json(url: str, body: Any, *, timeout_s: float, headers: dict[str, str] | None = None) -> Any:
    """POST ``body`` as JSON to ``url`` and return the decoded JSON answer, all within ``timeout_s``.

    ``timeout_s`` is a deadline for the whole request: connecting, sending, and reading the status,
    the headers and the full body (redirects included). A server that accepts and never answers,
    or that trickles its answer a byte at a time, costs ``timeout_s`` and a ``TimeoutError``, not
    a score. (Looking up the host's name is the one step the deadline does not bound: the
    system's resolver has its own timeouts; give an IP address to avoid it.)
    """
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    deadline = time.monotonic() + timeout_s
    # urllib's own opener (proxies, redirects, HTTP errors as before), with connections that keep the deadline
    opener = urllib.request.build_opener(_DeadlineHTTPHandler(deadline), _DeadlineHTTPSHandler(deadline))
    try:
        with opener.open(request, timeout=timeout_s) as reply:
            raw = reply.read()
    except urllib.error.HTTPError as exc:
        try:
            detail = exc.read()[:300].decode(errors="replace")
        except OSError as read_error:  # a body that ran past the deadline, or broke off: the status still says it
            detail = f"(body not read: {read_error})"
        kind = ServerError if exc.code >= 500 or exc.code == 429 else ValueError
        raise kind(f"{url} answered HTTP {exc.code}: {detail}") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, (socket.timeout, TimeoutError)):
            raise TimeoutError(f"{url} did not answer within {timeout_s:g} s") from None
        raise ConnectionError(f"cannot reach {url}: {exc.reason}") from None
    except (socket.timeout, TimeoutError):
        raise TimeoutError(f"{url} did not answer within {timeout_s:g} s") from None
    except (ConnectionError, OSError) as exc:
        raise ConnectionError(f"connection to {url} failed: {exc}") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise ValueError(f"{url} answered with a body that is not JSON: {raw[:200]!r}") from None


def with_retries(call, *, retries: int, backoff_s: float, retry_on: tuple[type[BaseException], ...]):
    """``call()``, tried again up to ``retries`` times on ``retry_on`` errors, after ``backoff_s * 2**k`` s.

    The last error propagates. Exponential backoff so that a server restarting, or shedding load
    with 5xx answers, is not hammered by every sample of a step at once.
    """
    for attempt in range(retries + 1):
        try:
            return call()
        except retry_on:
            if attempt == retries:
                raise
            time.sleep(backoff_s * 2 ** attempt)
    raise AssertionError("unreachable")  # pragma: no cover


class ServerError(ValueError):
    """A server answered with an error status worth retrying (HTTP 5xx, 429)."""


# ---------------------------------------------------------------------------- the deadline of one request
# A socket timeout bounds one wait for bytes, not a request: a server sending a byte a second meets any
# timeout over 1 s forever. So each step of the request gets the time left before the deadline as its
# timeout, and each read of the answer (status line, headers, body) does too, just before it blocks: no
# read can wait past the deadline, and one that starts after it fails at once. (Connecting, the TLS
# handshake and ``sendall`` are each bounded as a whole by the timeout they start with.)

def _time_left(deadline: float) -> float:
    """Seconds to ``deadline``; ``TimeoutError`` once it has passed (a timeout of 0 would mean non-blocking)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the request's deadline passed")
    return left


class _DeadlineReader(io.RawIOBase):
    """The raw bytes of a response, each read waiting at most until ``deadline``.

    Reads through the buffered file ``http.client`` made of the socket (``inner``), so the socket's
    lifetime stays that file's: kept open while the response is, closed with it.
    """

    def __init__(self, sock: socket.socket, inner: io.BufferedReader, deadline: float):
        super().__init__()
        self._sock, self._inner, self._deadline = sock, inner, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self._sock.settimeout(_time_left(self._deadline))
        return self._inner.readinto1(buffer)  # one receive, at most

    def close(self) -> None:
        if not self.closed:
            self._inner.close()
        super().close()


class _DeadlineResponse(http.client.HTTPResponse):
    def __init__(self, sock: socket.socket, *args: Any, deadline: float, **kwargs: Any):
        super().__init__(sock, *args, **kwargs)
        self.fp = io.BufferedReader(_DeadlineReader(sock, self.fp, deadline))


class _DeadlineConnection:
    """Mixed into ``http.client``'s connections: connect and send with the time left, answer by the deadline."""

    def __init__(self, *args: Any, deadline: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._deadline = deadline
        self.response_class = functools.partial(_DeadlineResponse, deadline=deadline)

    def connect(self) -> None:
        self.timeout = _time_left(self._deadline)
        super().connect()

    def send(self, data) -> None:
        if self.sock is not None:  # without one, send() connects first (with the time left, above)
            self.sock.settimeout(_time_left(self._deadline))
        super().send(data)


class _DeadlineHTTPConnection(_DeadlineConnection, http.client.HTTPConnection):
    pass


class _DeadlineHTTPSConnection(_DeadlineConnection, http.client.HTTPSConnection):
    pass


class _DeadlineHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: float):
        super().__init__()
        self._deadline = deadline

    def http_open(self, req):
        return self.do_open(functools.partial(_DeadlineHTTPConnection, deadline=self._deadline), req)


class _DeadlineHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: float):
        super().__init__()
        self._deadline = deadline

    def https_open(self, req):
        return self.do_open(functools.partial(_DeadlineHTTPSConnection, deadline=self._deadline), req,
                            context=self._context)


def call_all(jobs: list, *, concurrency: int, unreachable: tuple[type[BaseException], ...] = (TimeoutError,
                                                                                             ConnectionError)) -> list:
    """Run the zero-argument ``jobs`` ``concurrency`` at a time; each one's return value or exception, in order.

    Once a job fails with an ``unreachable`` error (its own retries spent: the server is down or
    hangs), the jobs not yet started are not sent; each gets a ``ConnectionError`` naming that
    failure. So a step with a dead server waits for one round of tries, not one per sample:
    about ``(retries + 1) * timeout_s`` plus the backoff, whatever the number of samples.
    """
    from concurrent.futures import ThreadPoolExecutor

    if not jobs:
        return []
    failed: list[BaseException] = []

    def run(job):
        if failed:
            return ConnectionError(f"not sent: the server failed earlier in this step ({failed[0]})")
        try:
            return job()
        except unreachable as exc:
            failed.append(exc)
            return exc
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(max_workers=min(concurrency, len(jobs)), thread_name_prefix="rltk-reward-http") as pool:
        return list(pool.map(run, jobs))
