"""A JSON POST with a timeout, for reward functions that call a server (``reward_model`` by URL, ``llm_judge``).

The standard library's ``urllib`` rather than ``httpx``: these rewards then work in a base install,
without the ``serve`` extra. Errors come out as three kinds a caller can count apart:
``TimeoutError`` (no answer within ``timeout_s``), ``ConnectionError`` (nothing listens, the
connection broke) and ``ValueError`` (an HTTP error status or a body that is not the JSON expected;
:class:`ServerError`, a subclass, for the statuses worth retrying: 5xx and 429).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from typing import Any


def post_json(url: str, body: Any, *, timeout_s: float, headers: dict[str, str] | None = None) -> Any:
    """POST ``body`` as JSON to ``url`` and return the decoded JSON answer.

    ``timeout_s`` bounds connecting and each wait for bytes from the server (a server that
    accepts and never answers costs ``timeout_s``; one that trickles a byte per ``timeout_s``
    could hold a call longer, which callers that must bound a step wrap in their own deadline).
    """
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            raw = reply.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode(errors="replace")
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
