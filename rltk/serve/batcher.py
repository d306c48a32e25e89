"""Coalesce concurrent requests into batched rollout-engine calls, all made by one thread.

A rollout engine is not thread-safe (the ``hf`` engine toggles the model's
train/eval mode and forks the RNG around ``generate``), and one batched call
for many prompts is far cheaper than one call each. So every request the
endpoint receives becomes a job on a queue, and a single worker thread:

1. blocks for the first job, then keeps collecting jobs while they keep
   arriving (each within ``window_s`` of the last, so a burst of concurrent
   requests lands in one call), for at most ``max_wait_s`` after the first, or
   until ``max_batch`` sequences (prompts x ``n``) are waiting, or until it
   holds as many jobs as the caller said requesters are live (:meth:`Batcher.expect`:
   the agentic workflow knows how many episodes are running, each waiting on at
   most one request, so once all of them have asked there is nobody left to wait
   for and the round goes out at once; while a count is set, a round waits for
   it, up to ``max_wait_s``, instead of closing after a ``window_s`` gap);
2. groups the jobs by sampling parameters (everything but ``n``: each job's
   prompts are repeated ``n`` times and sampled with ``n=1``, so requests that
   differ only in ``n`` still share a call); a job with a ``seed`` is never
   grouped with another, so its seed reproduces *that request*;
3. orders each round's jobs by the requester name given to :meth:`Batcher.submit`
   (the session id), so that their rows meet the engine's random draws in the
   same order however the requesting threads were scheduled, and
   makes one ``engine.generate`` call per group (a group above ``max_batch``
   sequences is split at job boundaries) and resolves each job's future with
   its own completions, ``n`` per prompt, in order.

Jobs queued while the engine is busy are picked up at once by the next round,
so under load batches fill without waiting for the window.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from rltk.rollout.base import Completion, RolloutEngine, SamplingParams


@dataclass
class _Job:
    prompt_ids: list[list[int]]
    params: SamplingParams
    order: str | None = None  # the requester's name: rows of a round are sampled in this order
    future: Future = field(default_factory=Future)

    @property
    def rows(self) -> int:
        return len(self.prompt_ids) * self.params.n

    def key(self) -> tuple:
        single = dataclasses.replace(self.params, n=1)
        values = dataclasses.astuple(single)
        values = tuple(tuple(v) if isinstance(v, list) else v for v in values)
        return values if self.params.seed is None else (*values, id(self))


_STOP = object()
_WAKE = object()  # re-check the round's closing condition (the expected count changed)


class Batcher:
    """One worker thread that owns ``engine`` and batches the jobs given to :meth:`submit`.

    Args:
        engine: the rollout engine; nothing else may call it while the batcher runs.
        window_s: the gap after the latest job the worker waits for another
            before it calls the engine (a short wait buys a fuller batch).
        max_batch: most sequences (prompts x ``n``) one engine call gets from
            several jobs; one job larger than that still goes in one call.
        max_wait_s: the longest a round keeps collecting after its first job;
            ``None`` means ``5 * window_s``.

    ``stats()`` counts jobs, engine calls and sequences, for metrics and tests.
    :meth:`expect` lets a caller that knows how many requesters are live close
    rounds early.
    """

    def __init__(self, engine: RolloutEngine, *, window_s: float = 0.05, max_batch: int = 64,
                 max_wait_s: float | None = None):
        if not isinstance(window_s, (int, float)) or isinstance(window_s, bool) or window_s < 0:
            raise ValueError(f"Batcher: window_s must be a number of seconds >= 0, got {window_s!r}")
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise ValueError(f"Batcher: max_batch must be an integer >= 1 (sequences per engine call), got {max_batch!r}")
        if max_wait_s is not None and (not isinstance(max_wait_s, (int, float)) or isinstance(max_wait_s, bool)
                                       or max_wait_s < window_s):
            raise ValueError(f"Batcher: max_wait_s must be a number of seconds >= window_s ({window_s}), "
                             f"got {max_wait_s!r}")
        self.engine = engine
        self.window_s = float(window_s)
        self.max_wait_s = float(max_wait_s) if max_wait_s is not None else 5 * self.window_s
        self.max_batch = max_batch
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._jobs = self._calls = self._sequences = 0
        self._thread = threading.Thread(target=self._loop, name="rltk-serve-batcher", daemon=True)
        self._closed = False
        self._expected: int | None = None
        self._thread.start()

    def expect(self, count: int | None) -> None:
        """Close each round as soon as it holds ``count`` jobs, without waiting out the window.

        The caller knows ``count`` requesters are live, each of which sends at
        most one request at a time (the agentic workflow's running episodes), so
        a round holding ``count`` jobs cannot grow by waiting. ``None`` (the
        default) turns this off: rounds close by the window, ``max_wait_s`` and
        ``max_batch`` only. While a count is set the gap window does not close a
        round (requesters that were all answered at once ask again spread over
        more than a window when they share one GIL): the count, ``max_wait_s`` or
        ``max_batch`` do. Calling it again (an episode ended) re-checks the round
        being collected. A wrong count costs time, never correctness: too high
        and a round waits ``max_wait_s``, too low and a round goes out before a
        late job, which the next round serves.
        """
        if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 0):
            raise ValueError(f"Batcher.expect: count must be an integer >= 0 or None, got {count!r}")
        self._expected = count
        if not self._closed:
            self._queue.put(_WAKE)

    def submit(self, prompt_ids: list[list[int]], params: SamplingParams, order: str | None = None) -> Future:
        """Queue ``params.n`` samples of each prompt; the future gives ``list[list[Completion]]`` as
        :meth:`RolloutEngine.generate` would (one list per prompt, ``n`` each, ``prompt_index`` set).

        ``order`` (the endpoint passes the session id) places the job's rows in its round: jobs are
        sampled sorted by it, then by arrival, and jobs without one after those with one. Threads
        send their requests in whatever order the scheduler runs them; sorted, the same requests
        get the same random draws from a seeded engine, so a run with a fixed seed repeats itself.
        """
        if self._closed:
            raise RuntimeError("Batcher.submit after close(): the endpoint is shutting down")
        job = _Job([list(p) for p in prompt_ids], params, order)
        self._queue.put(job)
        return job.future

    def stats(self) -> dict[str, int]:
        """``{"jobs", "engine_calls", "sequences"}`` since the batcher started."""
        with self._lock:
            return {"jobs": self._jobs, "engine_calls": self._calls, "sequences": self._sequences}

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish queued jobs, then stop the worker thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ worker

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is _STOP:
                return
            if first is _WAKE:
                continue
            jobs = [first]
            rows = first.rows
            start = time.monotonic()
            # With live requesters announced (expect()), the round waits for all of them, up to max_wait_s, and
            # not for a gap: 128 agent threads answered at once send their next requests over a few hundred ms
            # (they share the GIL), with pauses longer than the window, which would split them into rounds.
            gap = self._expected is None
            deadline = min(start + self.window_s, start + self.max_wait_s) if gap else start + self.max_wait_s
            while rows < self.max_batch:
                expected = self._expected
                if expected is not None and len(jobs) >= expected:
                    break  # every live requester has asked: nobody left to wait for
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    try:
                        job = self._queue.get(timeout=remaining)
                    except queue.Empty:
                        break
                if job is _STOP:
                    stopping = True  # serve what was queued before close(), then stop
                    break
                if job is _WAKE:
                    continue
                jobs.append(job)
                rows += job.rows
                if gap:
                    deadline = min(time.monotonic() + self.window_s, start + self.max_wait_s)
            self._run_round(jobs)

    def _run_round(self, jobs: list[_Job]) -> None:
        groups: dict[tuple, list[_Job]] = {}
        for job in sorted(jobs, key=lambda job: (job.order is None, job.order or "")):  # stable: then arrival
            groups.setdefault(job.key(), []).append(job)
        for group in groups.values():
            call, rows = [], 0
            for job in group:
                if call and rows + job.rows > self.max_batch:
                    self._call(call)
                    call, rows = [], 0
                call.append(job)
                rows += job.rows
            self._call(call)

    def _call(self, jobs: list[_Job]) -> None:
        params = dataclasses.replace(jobs[0].params, n=1)
        flat = [prompt for job in jobs for prompt in job.prompt_ids for _ in range(job.params.n)]
        with self._lock:
            self._jobs += len(jobs)
            self._calls += 1
            self._sequences += len(flat)
        try:
            results = self.engine.generate(flat, params)
            if len(results) != len(flat) or any(len(r) != 1 for r in results):
                raise RuntimeError(
                    f"rollout engine {type(self.engine).__name__} broke its contract: asked for 1 completion "
                    f"for each of {len(flat)} prompts, got group sizes {[len(r) for r in results]}"
                )
        except Exception as exc:  # every waiting request learns of the failure; the worker lives on
            for job in jobs:
                job.future.set_exception(exc)
            return
        position = 0
        for job in jobs:
            out: list[list[Completion]] = []
            for index in range(len(job.prompt_ids)):
                samples = []
                for _ in range(job.params.n):
                    completion = results[position][0]
                    samples.append(dataclasses.replace(completion, prompt_index=index))
                    position += 1
                out.append(samples)
            job.future.set_result(out)
