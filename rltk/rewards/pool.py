"""Worker processes for reward functions, where a timeout really stops the call.

A thread cannot be stopped from outside: a reward that spins in a timed-out
thread keeps the CPU (and, in pure Python, the GIL) until it returns, and
every later step pays for it. :class:`RewardWorkerPool` instead runs each call
in one of ``size`` long-lived worker processes. All calls of a step are
submitted at once and run in parallel on the workers, handed out in chunks
that shrink as the work runs out (a worker runs a chunk back to back and
streams each result, so it never waits for the trainer to be scheduled
between two calls); a call still running ``timeout_s`` after it started is
abandoned, the rest of its chunk goes to other workers, its worker is killed
(with its whole process group, so a reward's own subprocesses go too) and a
new one is started in the background. A worker that dies (a segfault in a C
extension, ``os._exit``) fails the call it was running and is replaced the
same way. So one hung sample costs one timeout in its step, and the next step
runs at full speed on fresh workers.

Why the timeout clock starts when the call starts, not when the step starts:
a single step-wide deadline would time out legitimate calls that merely
queued behind others, so a batch twice as large would start failing a reward
that never hung. With per-call clocks one hung sample costs one timeout, and
``k`` hung samples about ``ceil(k / size)`` (one more when two of them were
handed to the same worker in one chunk: the second starts once the first is
killed).

Start method: ``forkserver`` where the platform has it (Linux, macOS), else
``spawn``; never ``fork``, which copies a trainer's threads and locks (torch's
OpenMP pool, NCCL, tokenizers) into a child that may then deadlock. The fork
server is started once, with the main module and this module preloaded, so a
replacement worker is one ``fork`` of a process that already imported them
(~10 ms here) rather than a fresh interpreter. Workers get each reward
function by reference (pickle): it must be importable in a new process, i.e.
defined at the top level of a module. Workers start when the pool first runs
and are reused by every later step; :meth:`RewardWorkerPool.close` (also run
at interpreter exit, and when a wait is interrupted by Ctrl-C) kills them, and
on Linux the kernel kills them when the trainer is killed outright (SIGKILL,
the out-of-memory killer), hung ones included.
"""

from __future__ import annotations

import atexit
import collections
import multiprocessing
import multiprocessing.util  # noqa: F401 - imported before our atexit hook, so that hook runs first (LIFO)
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

# Longest a worker may take from process start to loading the reward functions (imports included).
WORKER_START_TIMEOUT_S = 120.0
# Longest a step that replaced a worker waits, at its end, for the replacement to load.
REPLACEMENT_WAIT_S = 1.0


class RewardWorkerError(RuntimeError):
    """Reward functions cannot run in worker processes (they fail to load there, or workers do not start).

    A configuration problem, not a bad sample: it stops training rather than
    giving every sample the fallback score.
    """


@dataclass
class CallOutcome:
    """What became of one call: its return value, or why there is none."""

    ok: bool
    value: Any = None
    error_type: str = ""  # the exception's class name, e.g. "ValueError", "RewardTimeout"
    error: str = ""  # its message
    where: str = ""  # the last frames of its traceback, for the first warning
    timed_out: bool = False


class RewardWorkerPool:
    """``size`` worker processes that call the given functions, each call under ``timeout_s``.

    Args:
        functions: ``(name, fn)`` pairs; calls name a function by its index.
            Each ``fn`` must pickle by reference (a top-level function) or by
            value (a picklable object), checked with :func:`picklable_error`;
            ``None`` holds the place of one that never runs here.
        size: number of worker processes (>= 1).
        timeout_s: longest a call may run once a worker has taken it.
    """

    def __init__(self, functions: Sequence[tuple[str, Callable]], *, size: int, timeout_s: float):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"reward.workers must be an integer >= 1, got {size!r}")
        self.names = [name for name, _ in functions]
        self._blobs = [pickle.dumps(fn) for _, fn in functions]
        self.size = size
        self.timeout_s = timeout_s
        self.restarts = 0  # workers killed after a timeout or found dead, and replaced
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._context = None
        self._owner = os.getpid()
        _LIVE_POOLS.add(self)
        # Garbage-collected without close(): still no orphaned processes.
        weakref.finalize(self, _stop_workers, self._workers, self._owner)

    # ------------------------------------------------------------------ public

    def start(self) -> None:
        """Start the workers (without waiting for them to load); a no-op when they are running."""
        with self._lock:
            self._fill()

    def run(
        self, calls: Sequence[tuple[int, dict]], while_waiting: Callable[[], None] | None = None
    ) -> list[CallOutcome]:
        """Run ``calls`` (``(function index, kwargs)``) on the workers; one outcome per call, in order.

        ``while_waiting`` runs in this process once the first calls are on
        their way, so in-process work overlaps the workers'. Raises
        :class:`RewardWorkerError` when the functions cannot be loaded in a
        worker. On any exception (Ctrl-C included) the pool is closed before
        it propagates, so no call outlives the caller's interest in it.
        """
        with self._lock:
            try:
                return self._run(calls, while_waiting)
            except BaseException:
                self._close_locked()
                raise

    def close(self) -> None:
        """Stop every worker: idle ones are asked to exit, anything still running is killed."""
        with self._lock:
            self._close_locked()

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (for tests and diagnostics)."""
        return [w.process.pid for w in self._workers if w.process.pid is not None]

    # ------------------------------------------------------------------ the loop

    def _run(self, calls: Sequence[tuple[int, dict]], while_waiting: Callable[[], None] | None) -> list[CallOutcome]:
        outcomes: list[CallOutcome | None] = [None] * len(calls)
        pending = collections.deque(range(len(calls)))
        self._fill()
        first = True
        while pending or any(w.queue for w in self._workers):
            self._dispatch(calls, pending)
            if first and while_waiting is not None:
                while_waiting()  # in-process work, while the workers run theirs
            first = False
            self._wait_and_collect(outcomes, pending)
        if first and while_waiting is not None:
            while_waiting()
        self._await_starting(outcomes)
        return outcomes  # type: ignore[return-value]

    def _await_starting(self, outcomes: list) -> None:
        """Give workers started during this call (replacements) up to ``REPLACEMENT_WAIT_S`` to load.

        A step that lost a worker has already paid a timeout; letting its replacement load
        now, rather than during the next step, keeps that next step at full speed.
        """
        deadline = time.monotonic() + REPLACEMENT_WAIT_S
        while any(w.state == "starting" for w in self._workers) and time.monotonic() < deadline:
            starting = {w.conn: w for w in self._workers if w.state == "starting"}
            starting.update({w.process.sentinel: w for w in starting.values()})
            ready = wait(list(starting), max(0.0, deadline - time.monotonic()))
            for worker in {starting[r] for r in ready}:
                if not self._drain(worker, outcomes) or not worker.process.is_alive():
                    self._on_death(worker, outcomes, collections.deque())

    def _dispatch(self, calls: Sequence[tuple[int, dict]], pending: collections.deque) -> None:
        """Hand each idle worker a chunk of pending calls.

        Chunks shrink as the work runs out (a share of what is left per worker, halved), so
        a worker runs several calls per message without waiting for this process to be
        scheduled between them, and the last calls still spread over every worker.
        """
        for worker in self._workers:
            if not pending:
                return
            if worker.state != "idle":
                continue
            size = max(1, len(pending) // (2 * self.size))
            chunk = [pending.popleft() for _ in range(min(size, len(pending)))]
            try:
                worker.conn.send([(index, *calls[index]) for index in chunk])
            except (BrokenPipeError, EOFError, OSError):
                pending.extendleft(reversed(chunk))  # never started: they go to another worker
                self._replace(worker)
                continue
            worker.state, worker.queue, worker.task_started = "busy", collections.deque(chunk), time.monotonic()
            worker.fn_index = calls[chunk[0]][0]

    def _wait_and_collect(self, outcomes: list, pending: collections.deque) -> None:
        now = time.monotonic()
        deadlines = [w.task_started + self.timeout_s for w in self._workers if w.queue]
        deadlines += [w.started + WORKER_START_TIMEOUT_S for w in self._workers if w.state == "starting"]
        timeout = max(0.0, min(deadlines) - now) if deadlines else None
        waitables = {}
        for worker in self._workers:
            waitables[worker.conn] = worker
            waitables[worker.process.sentinel] = worker
        ready = wait(list(waitables), timeout)
        # Messages first: a worker that answered and then exited has both its pipe and sentinel ready.
        for worker in {waitables[r] for r in ready}:
            alive = self._drain(worker, outcomes)
            if not alive or (worker.process.sentinel in ready and not worker.process.is_alive()):
                self._on_death(worker, outcomes, pending)
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.queue and now - worker.task_started >= self.timeout_s:
                name = self.names[worker.fn_index]
                outcomes[worker.queue.popleft()] = CallOutcome(
                    ok=False, error_type="RewardTimeout", timed_out=True,
                    error=f"reward '{name}' took longer than timeout_s={self.timeout_s}")
                pending.extendleft(reversed(worker.queue))  # the rest of its chunk never started
                worker.queue.clear()
                self._replace(worker)
            elif worker.state == "starting" and now - worker.started >= WORKER_START_TIMEOUT_S:
                raise RewardWorkerError(
                    f"a reward worker process did not load reward(s) {self.names} within "
                    f"{WORKER_START_TIMEOUT_S:.0f} s; importing their module must not block (look for "
                    f"network calls or locks at import time)")

    def _drain(self, worker: _Worker, outcomes: list) -> bool:
        """Read every message the worker has sent; ``False`` when its pipe is closed (it died)."""
        try:
            while worker.conn.poll():
                message = worker.conn.recv()
                kind = message[0]
                if kind == "ready":
                    worker.state, worker.owns_group = "idle", message[1]
                elif kind == "load_error":
                    _, name, error_type, error, where = message
                    raise RewardWorkerError(
                        f"reward '{name}' cannot be loaded in a reward worker process: {error_type}: {error}. "
                        f"Workers import reward functions by reference, so the function must be defined at the "
                        f"top level of an importable module (a plugin, or a script run as a file). Or mark it "
                        f"@bounded (from rltk.rewards import bounded) if its work is bounded on any input (it "
                        f"then runs in-process), or set reward.timeout_s=null to run every reward in-process "
                        f"without a timeout.\n{where}")
                else:  # ("done", task, ok, payload, fn index of the next call in the chunk or None)
                    _, task, ok, payload, next_fn = message
                    if not worker.queue or task != worker.queue[0]:
                        continue  # calls finish in the order they were sent; never misfile a result
                    worker.queue.popleft()
                    outcomes[task] = _outcome(ok, payload)
                    # The worker started its next call as it sent this result: that call's clock starts now.
                    worker.task_started = time.monotonic()
                    if next_fn is not None:
                        worker.fn_index = next_fn
                    if not worker.queue:
                        worker.state = "idle"
        except (EOFError, OSError):
            return False
        return True

    def _on_death(self, worker: _Worker, outcomes: list, pending: collections.deque) -> None:
        worker.process.join(1.0)
        code = worker.process.exitcode
        if worker.state == "starting":
            self._kill(worker)
            raise RewardWorkerError(
                f"a reward worker process exited with code {_describe_exit(code)} before loading reward(s) "
                f"{self.names}; its error is printed above (stderr). Workers import the main module first: a "
                f"script that scores rewards at its top level needs an `if __name__ == \"__main__\":` guard, "
                f"as any program using multiprocessing does")
        if worker.queue:
            name = self.names[worker.fn_index]
            outcomes[worker.queue.popleft()] = CallOutcome(
                ok=False, error_type="RewardWorkerDied",
                error=f"the worker process running reward '{name}' died with exit code {_describe_exit(code)} "
                      f"(a crash in native code, os._exit, or the out-of-memory killer); it was replaced")
            pending.extendleft(reversed(worker.queue))  # the rest of its chunk never started
            worker.queue.clear()
        self._replace(worker)

    # ------------------------------------------------------------------ workers

    @property
    def _ctx(self):
        if self._context is None:
            self._context = _worker_context()
        return self._context

    def _fill(self) -> None:
        while len(self._workers) < self.size:
            self._workers.append(self._spawn())

    def _spawn(self) -> _Worker:
        ctx = self._ctx
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=_worker_main, name="rltk-reward-worker",
            args=(child_conn, self.names, self._blobs, ctx.get_start_method() == "forkserver"))
        process.start()
        child_conn.close()  # the child holds its end; ours must close so its death reads as EOF
        return _Worker(process, parent_conn, time.monotonic())

    def _replace(self, worker: _Worker) -> None:
        self._kill(worker)
        self._workers.remove(worker)
        self.restarts += 1
        self._workers.append(self._spawn())

    @staticmethod
    def _kill(worker: _Worker) -> None:
        _kill_worker(worker)

    def _close_locked(self) -> None:
        _stop_workers(self._workers, self._owner)


# ---------------------------------------------------------------------- process handling


@dataclass(eq=False)
class _Worker:
    process: Any
    conn: Any
    started: float
    state: str = "starting"  # starting -> idle <-> busy
    queue: collections.deque = field(default_factory=collections.deque)  # calls sent, not yet answered
    task_started: float = 0.0  # when the call at the head of the queue started
    fn_index: int = 0  # which function that call runs, for messages
    owns_group: bool = False


def _kill_worker(worker: _Worker) -> None:
    pid = worker.process.pid
    try:
        if worker.owns_group and pid is not None:
            os.killpg(pid, signal.SIGKILL)  # the reward's own subprocesses too
        else:
            worker.process.kill()
    except (ProcessLookupError, PermissionError, OSError):
        pass  # already dead (it exited or crashed): nothing left to kill
    try:
        worker.conn.close()
    except OSError:
        pass  # the pipe broke with the worker: closing it is only tidying
    worker.process.join(5.0)


def _stop_workers(workers: list[_Worker], owner: int) -> None:
    """Ask idle workers to exit, kill the rest, and reap them all; empties ``workers``.

    Only in the process that started them (``owner``): a forked copy of the trainer exiting
    must not stop the trainer's workers.
    """
    if os.getpid() != owner:
        return
    for worker in workers:
        if worker.state == "idle":
            try:
                worker.conn.send(None)
            except (OSError, ValueError):
                pass  # it could not hear the request: the kill below stops it
    deadline = time.monotonic() + 1.0
    for worker in workers:
        if worker.state == "idle":
            worker.process.join(max(0.0, deadline - time.monotonic()))
        if worker.process.is_alive() or worker.state != "idle":
            _kill_worker(worker)
        else:
            try:
                worker.conn.close()
            except OSError:
                pass  # it exited as asked; a pipe already closed is fine
    workers.clear()


_LIVE_POOLS: weakref.WeakSet[RewardWorkerPool] = weakref.WeakSet()


@atexit.register
def _close_live_pools() -> None:
    # Runs before multiprocessing's own exit hook, which would otherwise join our idle
    # (non-daemonic) workers forever. Workers are not daemonic so a reward may use
    # multiprocessing itself.
    for pool in list(_LIVE_POOLS):
        _stop_workers(pool._workers, pool._owner)


def _worker_context():
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    if ctx.get_start_method() == "forkserver":
        # Effective only if the fork server is not running yet; it then imports these once and
        # every worker is forked from it with them loaded.
        ctx.set_forkserver_preload(["__main__", __name__])
    return ctx


def picklable_error(fn: Any) -> str | None:
    """Why ``fn`` cannot be sent to a worker process, or ``None`` when it can."""
    try:
        pickle.dumps(fn)
    except Exception as exc:  # PicklingError, AttributeError (local objects), TypeError
        return f"{type(exc).__name__}: {exc}"
    return None


# ---------------------------------------------------------------------- in the worker


def _worker_main(conn, names: list[str], blobs: list[bytes], die_with_parent: bool) -> None:
    """A worker's life: load the functions, say ready, then run chunks of ``(task, fn index, kwargs)``.

    Each result is sent as soon as its call returns, so the trainer can time the next call.
    """
    # Ctrl-C belongs to the trainer, which kills us; a KeyboardInterrupt here would only be
    # reported as one sample's failure.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if die_with_parent:
        _die_with_parent()
    owns_group = _own_process_group()
    fns = []
    for name, blob in zip(names, blobs):
        try:
            fns.append(pickle.loads(blob))
        except BaseException as exc:
            conn.send(("load_error", name, *_describe(exc)))
            return
    conn.send(("ready", owns_group))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the trainer is gone
        if message is None:
            return
        for position, (task, fn_index, kwargs) in enumerate(message):
            try:
                # Pickled here, so a result that cannot travel fails this call, not the worker.
                ok, payload = True, pickle.dumps(fns[fn_index](**kwargs))
            except BaseException as exc:  # even sys.exit() in a reward only fails its sample
                ok, payload = False, _describe(exc)
            upcoming = message[position + 1][1] if position + 1 < len(message) else None
            conn.send(("done", task, ok, payload, upcoming))


def _describe(exc: BaseException) -> tuple[str, str, str]:
    where = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-3))
    return type(exc).__name__, str(exc), where


def _outcome(ok: bool, payload: Any) -> CallOutcome:
    if ok:
        try:
            return CallOutcome(ok=True, value=pickle.loads(payload))
        except Exception as exc:  # e.g. a result of a class this process cannot import
            return CallOutcome(ok=False, error_type=type(exc).__name__,
                               error=f"its result could not be read in the trainer: {exc}")
    error_type, error, where = payload
    return CallOutcome(ok=False, error_type=error_type, error=error, where=where)


def _own_process_group() -> bool:
    try:
        os.setpgid(0, 0)
        return True
    except (AttributeError, OSError):
        return False


def _die_with_parent() -> None:
    """Linux, forkserver: be killed by the kernel when the trainer dies, even by SIGKILL.

    Our parent is the fork server, which exits once every holder of its "alive" pipe has
    closed it: the trainer, and (by multiprocessing's design) each process it forked. Closing
    our copy lets the server exit with the trainer, and PR_SET_PDEATHSIG then has the kernel
    kill us, however hung; no exit hook or GIL is needed. A reward that uses the fork server
    itself gets a new one of its own.
    """
    if not sys.platform.startswith("linux"):
        return
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        try:
            os.close(server._forkserver_alive_fd)
        except OSError:
            pass  # already closed: the server has been told to exit either way
        server._forkserver_alive_fd = None
    try:
        import ctypes

        parent = os.getppid()
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() != parent:  # the server died before the line above
            os._exit(1)
    except (OSError, AttributeError):
        pass  # no prctl (not glibc): workers then end with close() or interpreter exit, not a SIGKILLed trainer


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "unknown"
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)
