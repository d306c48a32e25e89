"""How long a test waits: every fixed wait of the suite goes through here, stretched by one setting.

A wait in a test is either event-driven (a line a process prints, a file it writes, an ``Event``) or a bound
that only a hang should reach. The bounds are written for a quiet 2-core machine and multiplied by
``RLTK_TEST_TIME_SCALE``: set it to 4 on a machine four times slower (a loaded CI runner, an emulator). Unset,
the suite takes the machine's load per core when it starts, if that is above 1 (a load of 8 on 2 cores: 4), and
hands the value to its workers and subprocesses through the same variable, so all of them stretch alike.

Lower bounds ("waited at least the timeout") and the timeouts rltk itself is configured with where a test
reads them back from a message are not scaled: a slow machine only ever makes those waits longer.
"""

from __future__ import annotations

import os
import time
from typing import Callable, TypeVar

VARIABLE = "RLTK_TEST_TIME_SCALE"

T = TypeVar("T")


def _time_scale() -> float:
    raw = os.environ.get(VARIABLE)
    if raw is None or not raw.strip():
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
        os.environ[VARIABLE] = f"{max(1.0, load):.2f}"  # workers and subprocesses see the same value
        return max(1.0, load)
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise RuntimeError(f"{VARIABLE}={raw!r}: must be a number of times slower than a quiet 2-core machine, > 0 "
                           f"(e.g. {VARIABLE}=4)")
    return value


TIME_SCALE = _time_scale()


def scaled(seconds: float) -> float:
    """``seconds`` (a bound for a quiet 2-core machine) for this machine."""
    return seconds * TIME_SCALE


def wait_until(condition: Callable[[], T], what: str, timeout_s: float, *, poll_s: float = 0.05,
               alive: Callable[[], bool] | None = None, details: Callable[[], str] | None = None) -> T:
    """Poll ``condition`` until it returns something true, and return that.

    Fails naming ``what`` after :func:`scaled` ``(timeout_s)``, or at once when ``alive`` (the process that
    should bring it about still runs) turns false; ``details`` (a log's tail) is added to the message.
    """
    bound = scaled(timeout_s)
    deadline = time.monotonic() + bound
    while not (result := condition()):
        ended = alive is not None and not alive()
        if ended or time.monotonic() > deadline:
            why = ("what should bring it about ended" if ended
                   else f"not within {bound:.0f} s ({VARIABLE}={TIME_SCALE:g})")
            raise AssertionError(f"waited for {what}: {why}" + (f"\n{details()}" if details else ""))
        time.sleep(poll_s)
    return result
