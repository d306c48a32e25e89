"""Marking reward functions whose work is bounded, so they may run in the trainer's own process.

:class:`rltk.rewards.compose.RewardComposer` runs a reward function in a
worker process, where a timeout can really stop it (the process is killed and
replaced), unless the function is marked :func:`bounded`: then it is called
in-process, once per sample in a single pass over the step's samples, with no
timeout and no per-call thread or process cost.

The mark is a promise, and a strong one: on *any* input, however long or
hostile (a 10 MB response, a 10**6-digit number, a regex-bait string), the
function finishes quickly, because it caps its own work (bounded prefixes or
tails of the text, digit limits, linear-time parsing), never because inputs
happen to be small. An in-process call that hangs hangs training, and one long
C call holding the GIL (a backtracking regex, ``9**9**9``) cannot be
interrupted by anything short of killing the process. Mark a function only
when a test proves the bound (see ``tests/rewards`` for the builtins'); when
in doubt leave it unmarked and let it run under the timeout.

Plugin authors use it the same way as rltk's builtins::

    from rltk.rewards import bounded

    @bounded
    def my_reward(*, response, ground_truth, **_):
        return float(response[-64:].strip() == ground_truth)

    @bounded(unless_args=("pattern",))  # a user-given regex may backtrack without end
    def my_format(*, response, pattern=None, **_): ...
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, overload

_MARK = "__rltk_bounded__"


@overload
def bounded(fn: Callable, /) -> Callable: ...
@overload
def bounded(*, unless_args: Iterable[str] = ()) -> Callable[[Callable], Callable]: ...


def bounded(fn: Callable | None = None, /, *, unless_args: Iterable[str] = ()):
    """Mark ``fn`` as a reward function whose work is bounded on any input (see the module docs).

    Used bare (``@bounded``) or with ``unless_args``: the names of arguments
    that void the promise when configured to anything but ``None`` (e.g. a
    user-supplied regex ``pattern``); with such an argument set the function
    runs in a worker process under the timeout like any unmarked reward.
    Returns ``fn`` itself, marked.
    """
    unless = tuple(unless_args)
    if isinstance(unless_args, str):
        raise TypeError(f"bounded(unless_args=...) takes a list of argument names, got the string {unless_args!r}")

    def mark(f: Callable) -> Callable:
        if not callable(f):
            raise TypeError(f"@bounded marks reward functions; got {type(f).__name__}: {f!r}")
        setattr(f, _MARK, unless)
        return f

    return mark(fn) if fn is not None else mark


def is_bounded(fn: Callable, args: Mapping[str, Any] | None = None) -> bool:
    """Whether ``fn`` called with the configured ``args`` keeps the :func:`bounded` promise.

    Looks through :func:`functools.partial` (whose bound keywords count as
    configured arguments). Unmarked functions are not bounded.
    """
    configured = dict(args or {})
    while isinstance(fn, functools.partial):
        configured = {**fn.keywords, **configured}
        fn = fn.func
    unless = getattr(fn, _MARK, None)
    if unless is None:
        return False
    return all(configured.get(name) is None for name in unless)


_BATCHED = "__rltk_batched__"


def batched(fn: Callable) -> Callable:
    """Mark ``fn`` as a batched reward function: one call scores all of a step's samples.

    For rewards whose cost is per call, not per sample: a model forward pass
    over a padded batch, requests to a server that batches. The composer calls
    it once per :meth:`~rltk.rewards.compose.RewardComposer.score_batch`, in the
    trainer's process, with the usual keyword names each holding a *list*, one
    entry per sample (as ``datasets.map(batched=True)`` passes columns)::

        @batched
        def my_rm(*, prompt: list[str], response: list[str], ground_truth: list[str],
                  extras: list[dict], **args) -> list[float | dict | BaseException]: ...

    It returns one entry per sample: a score (float or dict, as for any
    reward function) or an exception instance for a sample it could not score;
    that sample gets the composer's ``fallback`` and the failure is counted in
    ``stats()["failures/<name>"]`` (a ``TimeoutError`` in ``"timeouts/<name>"``
    too). If the call itself raises, every sample of the batch fails that way.

    Like :func:`bounded`, the mark is a promise that the call's time is capped
    by the function itself (truncated inputs, network timeouts), since it runs
    in-process where the composer's ``timeout_s`` cannot stop it. Returns
    ``fn`` itself, marked.
    """
    if not callable(fn):
        raise TypeError(f"@batched marks reward functions; got {type(fn).__name__}: {fn!r}")
    setattr(fn, _BATCHED, True)
    return fn


def is_batched(fn: Callable) -> bool:
    """Whether ``fn`` (or the function under a :func:`functools.partial`) is marked :func:`batched`."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return bool(getattr(fn, _BATCHED, False))
