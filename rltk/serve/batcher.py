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

Sharing the engine (``slice_tokens``, what ``rltk serve`` uses; off for training,
and whenever a requester count is set). The engines generate whole completions per
call, so one large request would hold the engine for its whole length. With
``slice_tokens`` set, every call generates at most that many tokens per row; a row
that has budget left continues in a later call from its prompt plus the tokens so
far (sampling is causal, so the continuation has the distribution of one long call;
a seeded job's later slices get seeds derived from its own). Between calls new jobs
join, withdrawn ones leave, and each call takes rows round-robin, one at a time,
between requesters (the endpoint's sessions), starting with the one served least
recently, each requester up to ``max_share_tokens`` of work (over its rows, the
context re-read plus the tokens it may make), the call up to ``max_batch`` rows and
``max_batch_tokens`` of work. A large request therefore runs in short calls, and a
small one waits for at most the call running when it arrived, then shares the next;
many small requesters still share one call.

Cancellation. A job whose future was cancelled (the client disconnected) is
dropped before the next call; the call running then finishes and its rows for
that job are discarded.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from rltk.rollout.base import Completion, RolloutEngine, SamplingParams


@dataclass
class _Job:
    prompt_ids: list[list[int]]
    params: SamplingParams
    order: str | None = None  # the requester's name: rows of a round are sampled in this order
    requester: object = None  # who shares the engine fairly with others (the endpoint: key and session)
    future: Future = field(default_factory=Future)
    seq: int = 0  # arrival order
    # Per row (prompt x sample, prompt-major): tokens and log-probs so far, finish reason once done.
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish: list = field(default_factory=list)
    texts: list = field(default_factory=list)
    versions: list = field(default_factory=list)  # per row: the weight version that sampled each token
    slices: int = 0  # engine calls this job's rows were in (seeds a sliced job's later calls apart)
    served_at: int = -1  # the engine call that last took rows of it

    def __post_init__(self):
        self.tokens = [[] for _ in range(self.rows)]
        self.logprobs = [[] for _ in range(self.rows)]
        self.finish = [None] * self.rows
        self.texts = [""] * self.rows
        self.versions = [[] for _ in range(self.rows)]

    @property
    def rows(self) -> int:
        return len(self.prompt_ids) * self.params.n

    @property
    def left(self) -> int:
        """Rows not finished."""
        return sum(1 for reason in self.finish if reason is None)

    def open_rows(self, count: int) -> list[int]:
        """The first ``count`` unfinished rows."""
        return [row for row, reason in enumerate(self.finish) if reason is None][:count]

    def key(self, sliced: bool = False) -> tuple:
        single = dataclasses.replace(self.params, n=1)
        values = tuple(tuple(v) if isinstance(v, list) else v
                       for f, v in zip(dataclasses.fields(single), dataclasses.astuple(single))
                       if not (sliced and f.name == "max_new_tokens"))  # sliced calls set their own
        return values if self.params.seed is None else (*values, id(self))

    def sort_key(self) -> tuple:
        return (self.order is None, self.order or "", self.seq)


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
                 max_wait_s: float | None = None, slice_tokens: int | None = None,
                 max_batch_tokens: int | None = None, max_share_tokens: int | None = None):
        if not isinstance(window_s, (int, float)) or isinstance(window_s, bool) or window_s < 0:
            raise ValueError(f"Batcher: window_s must be a number of seconds >= 0, got {window_s!r}")
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise ValueError(f"Batcher: max_batch must be an integer >= 1 (sequences per engine call), got {max_batch!r}")
        if max_wait_s is not None and (not isinstance(max_wait_s, (int, float)) or isinstance(max_wait_s, bool)
                                       or max_wait_s < window_s):
            raise ValueError(f"Batcher: max_wait_s must be a number of seconds >= window_s ({window_s}), "
                             f"got {max_wait_s!r}")
        if slice_tokens is not None and (not isinstance(slice_tokens, int) or isinstance(slice_tokens, bool)
                                         or slice_tokens < 1):
            raise ValueError(f"Batcher: slice_tokens must be an integer >= 1 or None, got {slice_tokens!r}")
        for name, value in (("max_batch_tokens", max_batch_tokens), ("max_share_tokens", max_share_tokens)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"Batcher: {name} must be an integer >= 1 or None, got {value!r}")
        self.slice_tokens = slice_tokens
        self.max_batch_tokens = max_batch_tokens
        self.max_share_tokens = max_share_tokens
        self.engine = engine
        self.window_s = float(window_s)
        self.max_wait_s = float(max_wait_s) if max_wait_s is not None else 5 * self.window_s
        self.max_batch = max_batch
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._jobs = self._calls = self._sequences = self._cancelled = self._arrivals = 0
        self._thread = threading.Thread(target=self._loop, name="rltk-serve-batcher", daemon=True)
        self._closed = False
        self._expected: int | None = None
        #: The label of the weights the engine samples with (:meth:`load_weights`); each token records it.
        self.weight_version = 0
        self._engine_lock = threading.Lock()  # an engine call, or a weight load, at a time
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

    def submit(self, prompt_ids: list[list[int]], params: SamplingParams, order: str | None = None,
               requester: object = None) -> Future:
        """Queue ``params.n`` samples of each prompt; the future gives ``list[list[Completion]]`` as
        :meth:`RolloutEngine.generate` would (one list per prompt, ``n`` each, ``prompt_index`` set).

        ``order`` (the endpoint passes the session id) places the job's rows in its round: jobs are
        sampled sorted by it, then by arrival, and jobs without one after those with one. Threads
        send their requests in whatever order the scheduler runs them; sorted, the same requests
        get the same random draws from a seeded engine, so a run with a fixed seed repeats itself.
        ``requester`` (default: ``order``) is who gets a fair share of a contended engine call.

        Cancelling the future (``future.cancel()``: the client went away) withdraws the job's rows
        not yet given to the engine; its rows in a call already running are discarded.
        """
        if self._closed:
            raise RuntimeError("Batcher.submit after close(): the endpoint is shutting down")
        with self._lock:
            self._arrivals += 1
            seq = self._arrivals
        job = _Job([list(p) for p in prompt_ids], params, order, order if requester is None else requester, seq=seq)
        self._queue.put(job)
        return job.future

    def load_weights(self, load, version: int) -> None:
        """Run ``load()`` (which changes the engine's weights) between two engine calls, then label the tokens
        of later calls ``version``; called from another thread (a weight-loading route)."""
        with self._engine_lock:
            load()
            self.weight_version = int(version)

    def stats(self) -> dict[str, int]:
        """``{"jobs", "engine_calls", "sequences", "cancelled"}`` since the batcher started (``jobs``: those
        given to the engine; ``cancelled``: those withdrawn before they were done)."""
        with self._lock:
            return {"jobs": self._jobs, "engine_calls": self._calls, "sequences": self._sequences,
                    "cancelled": self._cancelled}

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish queued jobs, then stop the worker thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ worker

    def _loop(self) -> None:
        active: list[_Job] = []  # jobs with rows left, in arrival order
        stopping = False
        while True:
            if not active:
                if stopping:
                    return
                jobs, stopping = self._collect_round()
                active.extend(jobs)
            elif self._expected is None:
                # Free-running (rltk serve): requests that came in during the last call join the next one, so a
                # large request shares the engine with them instead of running to its end first. With a count
                # of live requesters set (training) a round's jobs are finished first, as they were collected.
                stopping = self._drain(active) or stopping
            active = [job for job in active if not self._withdrawn(job)]
            if active:
                try:
                    self._call(self._next_call(active))
                except Exception as exc:  # a bug here must not leave requests waiting on a dead thread
                    for job in active:
                        _resolve(job.future, exception=exc)
                    active = []
                active = [job for job in active if job.left and not self._withdrawn(job) and not job.future.done()]

    def _drain(self, active: list[_Job]) -> bool:
        """Move queued jobs to ``active`` without waiting; ``True`` if close() was asked for."""
        stopping = False
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return stopping
            if job is _STOP:
                stopping = True
            elif job is not _WAKE:
                active.append(job)

    def _withdrawn(self, job: _Job) -> bool:
        if not job.future.cancelled():
            return False
        with self._lock:
            self._cancelled += 1
        return True

    def _collect_round(self) -> tuple[list[_Job], bool]:
        """Block for a first job, then collect a round (see the module docstring); ``(jobs, stopping)``."""
        while True:
            first = self._queue.get()
            if first is _STOP:
                return [], True
            if first is not _WAKE:
                break
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
                return jobs, True  # serve what was queued before close(), then stop
            if job is _WAKE:
                continue
            jobs.append(job)
            rows += job.rows
            if gap:
                deadline = min(time.monotonic() + self.window_s, start + self.max_wait_s)
        return jobs, False

    def _next_call(self, active: list[_Job]) -> list[tuple[_Job, list[int]]]:
        """The rows of the next engine call, as ``(job, rows)`` pieces in sampling order.

        One sampling group per call. Collected rounds (a requester count is set) go group by group
        in requester order, whole jobs up to ``max_batch`` rows (a larger job alone), as before.
        Otherwise (sliced calls) the group of the job served least recently goes, and its rows are
        taken round-robin between requesters (see below), each requester's from its jobs in arrival
        order, a job's unfinished rows first to last.
        """
        if self._expected is not None or self.slice_tokens is None:
            ordered = sorted(active, key=_Job.sort_key)
            key = ordered[0].key()
            pieces, rows = [], 0
            for job in ordered:
                if job.key() != key:
                    continue
                if pieces and rows + job.left > self.max_batch:
                    break
                pieces.append((job, job.open_rows(job.left)))
                rows += job.left
            return pieces
        # The group of the job served least recently (never served first, then by arrival): groups take turns.
        oldest = min(active, key=lambda job: (job.served_at, job.seq))
        key = oldest.key(sliced=True)
        by_requester: dict = {}
        for job in sorted((job for job in active if job.key(sliced=True) == key), key=lambda job: job.seq):
            by_requester.setdefault(job.requester, []).append(job)
        # Round robin, one row at a time, starting with the requester served least recently: each gets an
        # equal number of rows (or all it has left) up to max_share_tokens of work (the context each row is
        # re-read with plus the tokens it may make), and the call stops at max_batch rows or max_batch_tokens
        # of work, at least one row.
        queues = sorted(by_requester.values(), key=lambda jobs: (min(j.served_at for j in jobs), jobs[0].seq))
        pending = [[(job, row) for job in jobs for row in job.open_rows(job.left)] for jobs in queues]
        shares = [0] * len(pending)
        taken: dict[int, tuple[_Job, list[int]]] = {}
        rows = work = 0
        while rows < self.max_batch and any(pending):
            for number, queue_rows in enumerate(pending):
                if not queue_rows or rows >= self.max_batch:
                    continue
                job, row = queue_rows[0]
                cost = len(job.prompt_ids[row // job.params.n]) + len(job.tokens[row]) + self.slice_tokens
                if shares[number] and self.max_share_tokens is not None \
                        and shares[number] + cost > self.max_share_tokens:
                    queue_rows.clear()  # this requester's share of the call is full
                    continue
                if rows and self.max_batch_tokens is not None and work + cost > self.max_batch_tokens:
                    pending = []
                    break
                queue_rows.pop(0)
                taken.setdefault(id(job), (job, []))[1].append(row)
                rows += 1
                work += cost
                shares[number] += cost
        pieces = list(taken.values())
        return sorted(pieces, key=lambda piece: piece[0].sort_key())

    def _call(self, pieces: list[tuple[_Job, list[int]]]) -> None:
        first = pieces[0][0]
        sliced = self._expected is None and self.slice_tokens is not None
        params = dataclasses.replace(first.params, n=1)
        if sliced:
            # The least budget left of any row: no row goes past its max_tokens (nor the context the request was
            # checked against); rows with more left go on in a later call.
            budget = min(job.params.max_new_tokens - len(job.tokens[row]) for job, rows in pieces for row in rows)
            params = dataclasses.replace(params, max_new_tokens=min(self.slice_tokens, budget))
            if first.params.seed is not None and first.slices:
                # A seeded job's later slices: their own draws, still a function of the seed alone.
                params = dataclasses.replace(params, seed=(first.params.seed + first.slices * _GOLDEN) % (1 << 63))
        flat = []
        for job, rows in pieces:
            flat += [job.prompt_ids[row // job.params.n] + job.tokens[row] for row in rows]
        with self._lock:
            self._jobs += sum(1 for job, _ in pieces if job.slices == 0)
            self._calls += 1
            self._sequences += len(flat)
        for job, _ in pieces:
            job.slices += 1
            job.served_at = self._calls
        try:
            with self._engine_lock:
                version = self.weight_version
                results = self.engine.generate(flat, params)
            if len(results) != len(flat) or any(len(r) != 1 for r in results):
                raise RuntimeError(
                    f"rollout engine {type(self.engine).__name__} broke its contract: asked for 1 completion "
                    f"for each of {len(flat)} prompts, got group sizes {[len(r) for r in results]}"
                )
        except Exception as exc:  # every waiting request learns of the failure; the worker lives on
            for job, _ in pieces:
                job.finish = ["error"] * job.rows
                _resolve(job.future, exception=exc)
            return
        position = 0
        for job, rows in pieces:
            for row in rows:
                completion = results[position][0]
                position += 1
                room = job.params.max_new_tokens - len(job.tokens[row])
                job.tokens[row] += list(completion.token_ids[:room])
                job.logprobs[row] += list(completion.logprobs[:room])
                job.texts[row] += completion.text
                job.versions[row] += [version] * min(room, len(completion.token_ids))
                if completion.finish_reason == "stop" and len(completion.token_ids) <= room:
                    job.finish[row] = "stop"
                elif len(completion.token_ids) >= room or not sliced:
                    job.finish[row] = "length" if completion.finish_reason == "stop" else completion.finish_reason
                # else: a slice ended with budget left; the row goes on from its prompt + tokens so far
            if job.left == 0:
                n = job.params.n
                out = [[Completion(index, job.tokens[index * n + sample], job.logprobs[index * n + sample],
                                   job.finish[index * n + sample], job.texts[index * n + sample],
                                   versions=job.versions[index * n + sample])
                        for sample in range(n)] for index in range(len(job.prompt_ids))]
                _resolve(job.future, result=out)


_GOLDEN = 0x9E3779B97F4A7C15  # spreads a sliced seeded job's per-slice seeds apart


def _resolve(future: Future, *, result=None, exception: BaseException | None = None) -> None:
    """Settle ``future`` unless its requester cancelled it meanwhile (then nobody waits for it)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
