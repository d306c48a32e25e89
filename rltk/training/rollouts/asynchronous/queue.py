"""A persistent experience queue for asynchronous RL: producers put, the trainer leases and commits.

Producers (rollout worker processes, each with its engine and workflow) and
the trainer meet in one SQLite file (stdlib ``sqlite3``, WAL mode, so readers
never block the writer and several producer processes may write at once; each
write is one short ``BEGIN IMMEDIATE`` transaction, serialised by SQLite's
lock and retried for ``busy_timeout_s``)::

    # a producer process
    q = ExperienceQueue(path)
    q.put(group, ids=[...], versions=[...], producer="worker-0")  # one group, one transaction

    # the trainer (rank 0)
    q = ExperienceQueue(path, max_staleness=1, stale_policy="drop", timeout_s=600)
    q.recover(resumed_step)                  # once, at start: resumed checkpoint's step (0 if none)
    sync_weights(); q.publish_version(resumed_step)  # a crash may have come before the last sync
    for step in range(resumed_step + 1, ...):
        lease = q.take(batch_size, step=step, version=policy_version)
        ... train on lease.experiences; log lease.metrics ...
        if checkpoint_due(step):
            save_checkpoint(step)            # atomic (written aside, then renamed)
            q.commit(step)                   # every lease of steps <= step is consumed

**Exactly once across a trainer crash.** An experience moves ``ready ->
leased -> consumed`` (or ``ready -> dropped`` when too stale). A lease
belongs to the training step that took it; :meth:`commit` marks every lease of
the steps a checkpoint covers as consumed, in one transaction. The
checkpoint's step is the truth: on restart :meth:`recover` consumes the
leases of steps the resumed checkpoint covers (the crash may have hit between
the checkpoint's rename and :meth:`commit`), and returns the leases of later
steps to the queue (their updates were lost with the process), in their
original order. A checkpoint saved every ``k`` steps commits ``k`` steps'
leases at once. Resuming from a checkpoint older than the queue's last commit
is refused: experiences that checkpoint never trained on were consumed. So is
a take or commit by a new trainer process while a dead one's leases are still
open (it forgot :meth:`recover`).

**Exactly once across a producer crash.** Every experience has a unique id
(``UNIQUE`` in the table); a put of an id already stored is skipped, so a
restarted producer may put its last groups again. A group is put in one
transaction: all of it or none of it is visible, and :meth:`take` never
splits a group (group advantages need every member in one batch).

**Staleness.** Each experience carries the policy version that sampled it,
per token where a rollout spans a weight update (``versions`` a list as long
as the response); its staleness at take time is the trainer's ``version``
minus its *oldest* token's version (:func:`rltk.buffer.buffer.staleness`),
and a group's is its stalest member's.
With ``max_staleness = k``, groups staler than ``k`` are never trained:

* ``stale_policy="drop"``: they are marked ``dropped`` (kept in the file,
  never returned) and counted in ``staleness/dropped``;
* ``stale_policy="wait"``: they stay in the queue and the take waits for
  fresh data; if ``count`` fresh experiences do not arrive within
  ``timeout_s`` it raises :class:`QueueTimeout` naming what it waited for and
  the stale experiences it would not train on.

Any take waits at most ``timeout_s`` for producers to supply ``count``
experiences, then raises :class:`QueueTimeout` (never a silent hang).

Only one process should take and commit (the trainer's rank 0; it then
hands each rank its share); any number may put.

**A lost or damaged file.** Exactly once holds only while the checkpoint and
the queue it trained from go together. Each queue file has an id of its own
(random, set when the file is created); :meth:`cursor` is what the steps up
to a checkpoint's took from it (that id, how many experiences, the last one's
arrival number, each producer's last id), saved in the checkpoint, and
:meth:`check_cursor` refuses a queue that does not hold it: another (or a new,
empty) file, missing rows, a cursor past the queue's end. A file SQLite
cannot read (truncated, overwritten) or that is not an experience queue is
refused when opened, or by whichever call first reads the damage, with
:class:`QueueFileError` naming it, never a raw ``sqlite3`` error. A queue
that replaces a lost one is told, with :meth:`carry_over`, each producer's
last id the checkpoint trained: :meth:`last_id` hands it to a producer that
has put nothing into the new file yet, so it goes on after it and nothing
already trained is put (and trained) again.

**Across machines.** WAL mode keeps its index in shared memory, which works
only between processes of one machine: SQLite's documentation says WAL "does
not work over a network filesystem". A queue that producers on other machines
write through a shared file system (NFS, Lustre) uses ``journal_mode="delete"``
(SQLite's rollback journal; every process that opens the file must use the
same mode), which relies on the file system's POSIX locks (NFSv3+ with its
lock manager, NFSv4, Lustre mounted with ``flock``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import secrets
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from rltk.batch import Experience
from rltk.buffer.buffer import staleness
from rltk.errors import ConfigError

__all__ = ["ExperienceQueue", "JOURNAL_MODES", "Lease", "QueueFileError", "QueueTimeout", "STALE_POLICIES",
           "token_staleness"]

STALE_POLICIES = ("drop", "wait")
#: SQLite journal modes the queue runs in: ``wal`` (one machine) or ``delete`` (a network file system).
JOURNAL_MODES = ("wal", "delete")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS experiences (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,   -- arrival order
    id TEXT NOT NULL UNIQUE,
    producer TEXT NOT NULL,
    group_key TEXT NOT NULL,                 -- producer/first id of its put/group_id: puts never mix
    min_version INTEGER NOT NULL,            -- the oldest token's policy version
    max_version INTEGER NOT NULL,
    versions TEXT,                           -- JSON list per response token, NULL when one version
    payload TEXT NOT NULL,                   -- the Experience as JSON
    status TEXT NOT NULL DEFAULT 'ready',    -- ready | leased | consumed | dropped
    lease INTEGER,
    put_time REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS experiences_status ON experiences (status, seq);
-- a lease's rows, and the cursor's count of what the steps up to a checkpoint took, without reading payloads
CREATE INDEX IF NOT EXISTS experiences_lease ON experiences (lease, producer);
CREATE TABLE IF NOT EXISTS leases (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    step INTEGER NOT NULL,
    version INTEGER NOT NULL,
    state TEXT NOT NULL DEFAULT 'open',      -- open | committed | returned
    take_time REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS producer_counters (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    producer TEXT NOT NULL,
    counters TEXT NOT NULL,                  -- JSON {name: number} of the put that stored them
    reported INTEGER NOT NULL DEFAULT 0      -- 1 once a take has handed them to the trainer
);
CREATE TABLE IF NOT EXISTS carried_ids (    -- a queue that replaced a lost one: where each producer goes on
    producer TEXT PRIMARY KEY,
    last_id TEXT NOT NULL                    -- its last id the resumed checkpoint trained (carry_over)
);
"""

#: The columns this version reads of each table; a file whose tables lack them is not (this version's) queue.
_COLUMNS = {
    "experiences": {"seq", "id", "producer", "group_key", "min_version", "max_version", "versions", "payload",
                    "status", "lease", "put_time"},
    "leases": {"id", "step", "version", "state", "take_time"},
    "meta": {"key", "value"},
    "producer_counters": {"seq", "producer", "counters", "reported"},
    "carried_ids": {"producer", "last_id"},
}
#: The meta key of the queue file's own random id (see ExperienceQueue.queue_id).
QUEUE_ID = "queue_id"


class QueueTimeout(TimeoutError):
    """A wait on the experience queue ran out; the message says what was waited for and what was there."""


class QueueFileError(ConfigError):
    """The queue's file cannot be trained from: damaged, not an experience queue, or not holding what a
    checkpoint took from it. The message names the file and what is wrong with it (``rltk run`` exits 2)."""


def _damaged(exc: sqlite3.DatabaseError) -> bool:
    """Whether SQLite's error says the file is damaged or no database (not a lock, a full disk, a bug)."""
    name = getattr(exc, "sqlite_errorname", None)  # Python 3.11+
    if name is not None:
        return name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB"))
    return type(exc) is sqlite3.DatabaseError


def _damage_message(path: Path, exc: sqlite3.DatabaseError) -> str:
    return (f"experience queue {path} is damaged: SQLite cannot read it ({exc}); the file was truncated or "
            f"overwritten, or is no SQLite database")


def _reads_the_file(method):
    """Wrap a public method: a damaged file found by any of its statements is a :class:`QueueFileError`
    naming the file, not a raw ``sqlite3.DatabaseError``."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except sqlite3.DatabaseError as exc:
            if _damaged(exc):
                raise QueueFileError(_damage_message(self.path, exc)) from None
            raise
    return wrapper


@dataclass
class Lease:
    """What one :meth:`ExperienceQueue.take` handed the trainer for training step ``step``.

    ``experiences`` are copies whose ``group_id`` is renumbered ``0 .. G-1`` in
    batch order (producers number their groups independently);
    ``ids[i]``, ``versions[i]`` (per token, a list as long as the response) and
    ``group_keys[i]`` describe ``experiences[i]``. ``metrics`` are the
    ``staleness/*`` numbers of this take: ``mean`` and ``max`` over the taken
    experiences (trainer version minus oldest token version), the per-token
    ones of :func:`token_staleness` (``token_mean``, ``mixed``), ``dropped``
    (experiences dropped as too stale by this take) and ``waited_s``, and the
    sum of the ``counters`` producers put since the last take (``put``).
    ``sampled_versions[i]`` is the version of ``experiences[i]``'s oldest
    token, the one its staleness counts from (the trainer's buffer keeps it,
    and the rollout traces report it).
    """

    id: int
    step: int
    version: int
    experiences: list[Experience]
    ids: list[str]
    versions: list[list[int]]
    group_keys: list[str]
    metrics: dict[str, float] = field(default_factory=dict)
    sampled_versions: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.experiences)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def token_staleness(version: int, versions: Sequence[Sequence[int]]) -> dict[str, float]:
    """Per-token ``staleness/*`` of a batch trained by trainer ``version``: ``token_mean`` (trainer version
    minus the version that sampled the token, averaged over every response token) and ``mixed`` (the
    fraction of experiences whose tokens span a weight update: a rollout interrupted and continued)."""
    tokens = [staleness(version, v) for token_versions in versions for v in token_versions]
    spans = [token_versions for token_versions in versions if token_versions]
    return {
        "staleness/token_mean": sum(tokens) / len(tokens) if tokens else 0.0,
        "staleness/mixed": (sum(min(v) != max(v) for v in spans) / len(versions)) if versions else 0.0,
    }


def _payload(exp: Experience) -> str:
    """``exp`` as JSON: its fields as they are (the JSON ``dataclasses.asdict`` would give, without the deep
    copy, which cost a multi-turn batch's put ~5x the encoding); a field holding a dataclass goes through
    ``asdict``."""
    try:
        return json.dumps({name: getattr(exp, name) for name in exp.__dataclass_fields__})
    except TypeError:
        return json.dumps(dataclasses.asdict(exp))


class ExperienceQueue:
    """The persistent experience queue at ``path`` (created when missing); see the module docstring.

    Args:
        path: the SQLite file. Every process opens its own queue object on it.
        max_staleness: the most policy versions a trained token may lag the
            trainer's version (``None``: no bound; ``0``: on-policy only).
        stale_policy: ``drop`` or ``wait`` (module docstring).
        timeout_s: the longest :meth:`take` waits for ``count`` trainable
            experiences before raising :class:`QueueTimeout`.
        poll_s: how often a waiting take looks again.
        busy_timeout_s: how long one statement waits for another process's
            write lock before failing with :class:`QueueTimeout`.
        journal_mode: ``wal`` (processes of one machine) or ``delete`` (a
            file on a network file system shared by machines); module docstring.
    """

    def __init__(self, path: str | os.PathLike, *, max_staleness: int | None = None, stale_policy: str = "drop",
                 timeout_s: float = 600.0, poll_s: float = 0.005, busy_timeout_s: float = 30.0,
                 journal_mode: str = "wal"):
        if max_staleness is not None and not (_is_int(max_staleness) and max_staleness >= 0):
            raise ValueError(f"ExperienceQueue: max_staleness must be an integer >= 0 or None, got {max_staleness!r}")
        if stale_policy not in STALE_POLICIES:
            raise ValueError(f"ExperienceQueue: stale_policy must be one of {', '.join(STALE_POLICIES)}, "
                             f"got {stale_policy!r}")
        if journal_mode not in JOURNAL_MODES:
            raise ValueError(f"ExperienceQueue: journal_mode must be one of {', '.join(JOURNAL_MODES)}, "
                             f"got {journal_mode!r}")
        self.journal_mode = journal_mode
        for name, value in (("timeout_s", timeout_s), ("poll_s", poll_s), ("busy_timeout_s", busy_timeout_s)):
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                    and value > 0):
                raise ValueError(f"ExperienceQueue: {name} must be a number of seconds > 0, got {value!r}")
        self.path = Path(path)
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        self.timeout_s = float(timeout_s)
        self.poll_s = float(poll_s)
        self.busy_timeout_s = float(busy_timeout_s)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._own_leases: set[int] = set()  # leases this object took: any other open one is a crashed run's
        # autocommit mode: transactions are opened explicitly with BEGIN IMMEDIATE, so a writer takes the
        # lock before it reads what it will change (no lost updates between processes)
        self._db = sqlite3.connect(str(self.path), timeout=self.busy_timeout_s, isolation_level=None)
        try:
            self._setup()
        except sqlite3.OperationalError as exc:
            self._db.close()
            raise QueueTimeout(f"experience queue {self.path}: could not open it within {self.busy_timeout_s:g} s "
                               f"(another process holds its lock?): {exc}") from exc
        except sqlite3.DatabaseError as exc:
            self._db.close()
            if _damaged(exc):
                raise QueueFileError(_damage_message(self.path, exc)) from None
            raise
        except BaseException:
            self._db.close()
            raise

    def _check_schema(self) -> None:
        """Refuse, before writing anything, a database that holds tables but no experiences (a file of
        another program), or queue tables without the columns this version reads."""
        tables = {name for (name,) in self._db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")}
        if tables and "experiences" not in tables:
            raise QueueFileError(
                f"experience queue {self.path} is an SQLite database but no experience queue: it holds the tables "
                f"{', '.join(sorted(tables))} and no 'experiences'. Give the queue a file of its own "
                f"(buffer.queue_path)")
        for table in sorted(tables & set(_COLUMNS)):
            columns = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            missing = _COLUMNS[table] - columns
            if missing:
                raise QueueFileError(
                    f"experience queue {self.path} is not a queue this rltk can read: its table '{table}' lacks "
                    f"the column(s) {', '.join(sorted(missing))} (written by another rltk version, or another "
                    f"program)")

    def _setup(self) -> None:
        # a damaged file fails here, at its first read, and a foreign database is refused untouched
        self._check_schema()
        # journal mode and the schema are set outside a transaction (SQLite refuses WAL inside one); each
        # statement is atomic and idempotent, so processes opening the file together do not conflict
        mode = self._db.execute(f"PRAGMA journal_mode={self.journal_mode.upper()}").fetchone()[0]
        if mode.lower() != self.journal_mode:
            raise RuntimeError(
                f"ExperienceQueue: {self.path} could not be put in {self.journal_mode} journal mode (got {mode!r})"
                + ("; it needs a local file system that supports shared memory (a queue shared by machines "
                   "over a network file system: buffer.queue_journal=delete)" if self.journal_mode == "wal" else
                   "; another process may hold it open in WAL mode"))
        # FULL: a commit is on disk when commit() returns, so a checkpoint's commit survives a power cut too
        self._db.execute("PRAGMA synchronous=FULL")
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                self._db.execute(statement)
        if self._meta(QUEUE_ID) is None:  # a new file (or one an older rltk made): its own id, set once
            self._db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)",
                             (QUEUE_ID, secrets.randbits(62) + 1))

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "ExperienceQueue":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------
    # transactions

    def _execute_locked(self, what: str, fn, *args):
        """``fn(*args)`` inside one write transaction; a lock held past ``busy_timeout_s`` is a QueueTimeout."""
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise QueueTimeout(
                    f"experience queue {self.path}: waited {self.busy_timeout_s:g} s for the write lock to {what} "
                    f"(another process holds it): {exc}") from exc
            raise
        try:
            result = fn(*args)
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        return result

    def _meta(self, key: str, default: int | None = None) -> int | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return default if row is None else int(row[0])

    def _set_meta(self, key: str, value: int) -> None:
        self._db.execute("INSERT INTO meta (key, value) VALUES (?, ?) "
                         "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (key, int(value)))

    # ------------------------------------------------------------------
    # producers

    @_reads_the_file
    def put(self, experiences: Iterable[Experience], *, ids: Sequence[str],
            versions: int | Sequence[int | Sequence[int]], producer: str = "producer",
            counters: dict[str, float] | None = None) -> int:
        """Store ``experiences`` in one transaction; returns how many were new (ids already stored are skipped).

        ``ids`` are unique strings, one per experience. ``versions`` is the policy
        version that sampled them: one int for all, one per experience, or per
        experience a list with one version per response token (a rollout
        interrupted by a weight update). Experiences with the same ``group_id``
        in one call form one group (workflows number groups afresh for every
        batch, so equal ids in two calls are two groups): put a group whole, in
        one call. Experiences must be JSON-able (``info`` included).

        ``counters`` (``{name: number}``, e.g. the producer's ``reward_fn/*``
        counts while it made this batch) are stored with the put, unless every
        id was stored before (a restarted producer's repeat), and summed into
        the metrics of the next :meth:`take`.
        """
        experiences = list(experiences)
        ids = list(ids)
        if not isinstance(producer, str) or not producer or "/" in producer:
            raise ValueError(f"ExperienceQueue.put: producer must be a non-empty name without '/', got {producer!r}")
        if len(ids) != len(experiences):
            raise ValueError(f"ExperienceQueue.put: {len(ids)} ids for {len(experiences)} experiences")
        if len(set(ids)) != len(ids) or not all(isinstance(i, str) and i for i in ids):
            raise ValueError("ExperienceQueue.put: ids must be distinct non-empty strings")
        if _is_int(versions):
            per_experience = [versions] * len(experiences)
        else:
            per_experience = list(versions)
            if len(per_experience) != len(experiences):
                raise ValueError(f"ExperienceQueue.put: {len(per_experience)} versions for "
                                 f"{len(experiences)} experiences")
        rows, now = [], time.time()
        for index, (exp, exp_id, version) in enumerate(zip(experiences, ids, per_experience)):
            if not isinstance(exp, Experience):
                raise TypeError(f"ExperienceQueue.put: item {index} is a {type(exp).__name__}, "
                                f"not a rltk.batch.Experience")
            if _is_int(version):
                token_versions = None
                low = high = version
            else:
                token_versions = list(version)
                if len(token_versions) != len(exp.response_ids) or not all(_is_int(v) for v in token_versions):
                    raise ValueError(
                        f"ExperienceQueue.put: versions of experience {exp_id!r} must be one int or one int per "
                        f"response token ({len(exp.response_ids)}), got {version!r}")
                low, high = (min(token_versions), max(token_versions)) if token_versions else (0, 0)
            if low < 0:
                raise ValueError(f"ExperienceQueue.put: policy versions are >= 0, got {low} for {exp_id!r}")
            try:
                payload = _payload(exp)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"ExperienceQueue.put: experience {exp_id!r} cannot be stored as JSON ({exc}); "
                                f"its info must hold JSON-able values") from exc
            rows.append((exp_id, producer, f"{producer}/{ids[0]}/{exp.group_id}", low, high,
                         None if token_versions is None else json.dumps(token_versions), payload, now))

        if counters is not None and not all(isinstance(k, str) and isinstance(v, (int, float))
                                            and not isinstance(v, bool) and math.isfinite(v)
                                            for k, v in counters.items()):
            raise ValueError(f"ExperienceQueue.put: counters must map names to finite numbers, got {counters!r}")

        def insert() -> int:
            before = self._db.total_changes
            self._db.executemany(
                "INSERT OR IGNORE INTO experiences (id, producer, group_key, min_version, max_version, versions, "
                "payload, put_time) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
            new = self._db.total_changes - before
            if counters and new:
                self._db.execute("INSERT INTO producer_counters (producer, counters) VALUES (?, ?)",
                                 (producer, json.dumps(counters)))
            return new

        return self._execute_locked("put experiences", insert)

    @_reads_the_file
    def publish_version(self, version: int) -> None:
        """Record the trainer's current policy version, for producers to read with :attr:`policy_version`."""
        if not _is_int(version) or version < 0:
            raise ValueError(f"ExperienceQueue.publish_version: version must be an integer >= 0, got {version!r}")
        self._execute_locked("publish the policy version", self._set_meta, "policy_version", version)

    @property
    @_reads_the_file
    def policy_version(self) -> int:
        """The last version :meth:`publish_version` recorded (0 before any)."""
        return self._meta("policy_version", 0)

    # ------------------------------------------------------------------
    # the trainer

    @_reads_the_file
    def take(self, count: int, *, step: int, version: int, timeout_s: float | None = None) -> Lease:
        """Lease whole groups, oldest first, totalling ``count`` experiences, for training step ``step``.

        ``version`` is the trainer's policy version (the one being updated).
        Groups staler than ``max_staleness`` are dropped or waited past, by
        ``stale_policy``. A first group larger than ``count`` is still taken
        whole; otherwise groups are added while they fit, and the take waits
        until they fill ``count`` exactly (put groups of a size that divides
        it). Raises :class:`QueueTimeout` after ``timeout_s`` (the queue's
        default when ``None``).
        """
        if not _is_int(count) or count < 1:
            raise ValueError(f"ExperienceQueue.take: count must be an integer >= 1, got {count!r}")
        if not _is_int(step) or step < 1:
            raise ValueError(f"ExperienceQueue.take: step must be an integer >= 1 (training steps count from 1), "
                             f"got {step!r}")
        if not _is_int(version) or version < 0:
            raise ValueError(f"ExperienceQueue.take: version must be an integer >= 0, got {version!r}")
        committed = self.committed_step
        if step <= committed:
            raise ValueError(f"ExperienceQueue.take: step {step} is already committed (the queue's committed step "
                             f"is {committed}); steps after a resume start at the resumed step + 1")
        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        start = time.monotonic()
        dropped = 0
        while True:
            lease, dropped_now, seen = self._execute_locked("take experiences", self._try_take, count, step, version)
            dropped += dropped_now
            waited = time.monotonic() - start
            if lease is not None:
                lease.metrics["staleness/dropped"] = float(dropped)
                lease.metrics["staleness/waited_s"] = waited
                return lease
            if waited >= limit:
                raise QueueTimeout(self._timeout_message(count, step, version, waited, dropped, seen))
            time.sleep(self.poll_s)

    def _refuse_foreign_leases(self, what: str) -> None:
        """Open leases this object did not take belong to a trainer that died; training on (or committing)
        around them before :meth:`recover` settles them would lose or repeat their experiences."""
        foreign = [(i, s) for i, s in self._db.execute("SELECT id, step FROM leases WHERE state = 'open'")
                   if i not in self._own_leases]
        if foreign:
            steps = sorted({s for _, s in foreign})
            raise RuntimeError(
                f"experience queue {self.path}: cannot {what}: {len(foreign)} lease(s) of step(s) {steps} are open "
                f"from an earlier trainer process; call recover(resumed_step) with the step of the checkpoint "
                f"this run resumed from (0 if none) first")

    def _try_take(self, count: int, step: int, version: int):
        self._refuse_foreign_leases("take experiences")
        # the payloads are read only for the rows chosen
        rows = self._db.execute(
            "SELECT seq, id, group_key, min_version FROM experiences WHERE status = 'ready' ORDER BY seq").fetchall()
        groups: dict[str, list[tuple]] = {}
        for row in rows:
            groups.setdefault(row[2], []).append(row)
        bound = self.max_staleness
        fresh, stale = [], []
        for members in groups.values():
            lag = staleness(version, min(r[3] for r in members))
            (stale if bound is not None and lag > bound else fresh).append(members)
        dropped = 0
        if stale and self.stale_policy == "drop":
            seqs = [(r[0],) for members in stale for r in members]
            self._db.executemany("UPDATE experiences SET status = 'dropped' WHERE seq = ?", seqs)
            dropped = len(seqs)
        chosen, total = [], 0
        for members in fresh:
            if total + len(members) > count and chosen:
                break
            chosen.append(members)
            total += len(members)
            if total >= count:
                break
        seen = {"fresh": sum(len(m) for m in fresh), "stale": sum(len(m) for m in stale),
                "stale_versions": sorted({r[3] for m in stale for r in m})}
        if total < count:
            return None, dropped, seen
        cursor = self._db.execute("INSERT INTO leases (step, version, take_time) VALUES (?, ?, ?)",
                                  (step, version, time.time()))
        lease_id = cursor.lastrowid
        self._own_leases.add(lease_id)
        taken = [r for members in chosen for r in members]
        self._db.executemany("UPDATE experiences SET status = 'leased', lease = ? WHERE seq = ?",
                             [(lease_id, r[0]) for r in taken])
        stored = {seq: (token_versions, payload) for seq, token_versions, payload in self._db.execute(
            "SELECT seq, versions, payload FROM experiences WHERE lease = ?", (lease_id,))}
        lease = self._lease(lease_id, step, version, chosen, stored)
        lease.metrics.update(self._unreported_counters())
        return lease, dropped, seen

    def _unreported_counters(self) -> dict[str, float]:
        """The sum of the counters put since the last take's, each name on its own; marks them reported."""
        total: dict[str, float] = {}
        rows = self._db.execute("SELECT seq, counters FROM producer_counters WHERE reported = 0").fetchall()
        for _, counters in rows:
            for name, value in json.loads(counters).items():
                total[name] = total.get(name, 0.0) + float(value)
        self._db.executemany("UPDATE producer_counters SET reported = 1 WHERE seq = ?", [(r[0],) for r in rows])
        return total

    def _lease(self, lease_id: int, step: int, version: int, groups: list[list[tuple]],
               stored: dict[int, tuple]) -> Lease:
        experiences, ids, versions, keys, oldest, lags = [], [], [], [], [], []
        for new_group_id, members in enumerate(groups):
            for seq, exp_id, key, low in members:
                token_versions, payload = stored[seq]
                fields = json.loads(payload)
                fields["group_id"] = new_group_id
                exp = Experience(**fields)
                experiences.append(exp)
                ids.append(exp_id)
                versions.append(json.loads(token_versions) if token_versions is not None
                                else [low] * len(exp.response_ids))
                keys.append(key)
                oldest.append(low)
                lags.append(staleness(version, low))
        metrics = {"staleness/mean": sum(lags) / len(lags), "staleness/max": float(max(lags)),
                   **token_staleness(version, versions)}
        return Lease(lease_id, step, version, experiences, ids, versions, keys, metrics, oldest)

    def _timeout_message(self, count, step, version, waited, dropped, seen) -> str:
        bound = "no staleness bound" if self.max_staleness is None else (
            f"policy version >= {version - self.max_staleness} (trainer version {version}, "
            f"max_staleness {self.max_staleness})")
        msg = (f"experience queue {self.path}: waited {waited:.1f} s for {count} experiences of {bound} for "
               f"training step {step}; {seen['fresh']} trainable ones are there")
        if seen["stale"] and self.stale_policy == "wait":
            msg += (f", and {seen['stale']} older ones (policy versions {seen['stale_versions']}) that "
                    f"stale_policy=wait will not train on")
        if dropped:
            msg += f"; {dropped} were dropped as too stale while waiting"
        return msg + ". Are the producers running, and syncing weights often enough?"

    @_reads_the_file
    def commit(self, step: int) -> int:
        """Mark every open lease of steps ``<= step`` consumed, and ``step`` the committed step, atomically.

        Call it right after the checkpoint of ``step`` is saved. Returns how many
        experiences it consumed.
        """
        if not _is_int(step) or step < 0:
            raise ValueError(f"ExperienceQueue.commit: step must be an integer >= 0, got {step!r}")
        return self._execute_locked("commit a checkpoint", self._commit, step)

    def _commit(self, step: int, recovering: bool = False) -> int:
        if not recovering:
            self._refuse_foreign_leases("commit")
        committed = self._meta("committed_step", 0)
        if step < committed:
            raise ValueError(f"ExperienceQueue.commit: step {step} is before the committed step {committed}")
        consumed = self._db.execute(
            "UPDATE experiences SET status = 'consumed' WHERE status = 'leased' AND lease IN "
            "(SELECT id FROM leases WHERE state = 'open' AND step <= ?)", (step,)).rowcount
        self._db.execute("UPDATE leases SET state = 'committed' WHERE state = 'open' AND step <= ?", (step,))
        self._set_meta("committed_step", step)
        return consumed

    @_reads_the_file
    def recover(self, resumed_step: int) -> dict[str, int]:
        """After a (re)start from the checkpoint of ``resumed_step`` (0: none): settle the open leases.

        Leases of steps ``<= resumed_step`` are committed (that checkpoint holds
        their update even if the crash came before :meth:`commit`); leases of
        later steps return their experiences to the queue, in arrival order.
        Returns ``{"committed": n, "returned": m}`` (experiences). Raises
        ``ValueError`` when the queue already committed a later step than
        ``resumed_step``: those experiences were trained into a checkpoint that
        is not the one being resumed.
        """
        if not _is_int(resumed_step) or resumed_step < 0:
            raise ValueError(f"ExperienceQueue.recover: resumed_step must be an integer >= 0, got {resumed_step!r}")

        def settle() -> dict[str, int]:
            committed = self._meta("committed_step", 0)
            if committed > resumed_step:
                raise QueueFileError(
                    f"experience queue {self.path}: its experiences are committed up to training step {committed}, "
                    f"but the run resumes from step {resumed_step}; the experiences of steps {resumed_step + 1}.."
                    f"{committed} were consumed by a checkpoint this run does not start from. Resume from the "
                    f"newest checkpoint, or give a fresh buffer.queue_path")
            n = self._commit(resumed_step, recovering=True)
            returned = self._db.execute(
                "UPDATE experiences SET status = 'ready', lease = NULL WHERE status = 'leased' AND lease IN "
                "(SELECT id FROM leases WHERE state = 'open')").rowcount
            self._db.execute("UPDATE leases SET state = 'returned' WHERE state = 'open'")
            return {"committed": n, "returned": returned}

        return self._execute_locked("recover open leases", settle)

    @property
    @_reads_the_file
    def committed_step(self) -> int:
        """The last step :meth:`commit` (or :meth:`recover`) recorded; 0 before any."""
        return self._meta("committed_step", 0)

    @property
    @_reads_the_file
    def taken_step(self) -> int:
        """The last training step that took a lease still standing (open or committed), else the committed
        step: a producer reads it to know how far ahead of the trainer its next group would train."""
        row = self._db.execute("SELECT MAX(step) FROM leases WHERE state != 'returned'").fetchone()
        return max(int(row[0]) if row[0] is not None else 0, self.committed_step)

    @_reads_the_file
    def finish(self, step: int) -> None:
        """Record that the trainer ended its stage at training step ``step``: producers that read
        :attr:`finished_step` stop (an external producer exits 0 instead of waiting out its timeout)."""
        self._execute_locked("record the trainer's end", self._set_meta, "finished_step", int(step))

    @property
    @_reads_the_file
    def finished_step(self) -> int | None:
        """The step :meth:`finish` recorded, or None while the trainer has not ended its stage."""
        return self._meta("finished_step")

    @_reads_the_file
    def producers(self) -> dict[str, int]:
        """Experiences put so far, by producer name (any status): who has shown up."""
        return dict(self._db.execute("SELECT producer, COUNT(*) FROM experiences GROUP BY producer"))

    @_reads_the_file
    def progress(self) -> tuple[int, int]:
        """``(taken_step, ready experiences)`` read in one snapshot, for a producer's staleness gate: read
        apart, a take between them is half seen (the old step with the new, smaller ready count)."""
        self._db.execute("BEGIN")
        try:
            ready = self._db.execute("SELECT COUNT(*) FROM experiences WHERE status = 'ready'").fetchone()[0]
            return self.taken_step, int(ready)
        finally:
            self._db.execute("COMMIT")

    @_reads_the_file
    def last_id(self, producer: str) -> str | None:
        """The id of ``producer``'s most recent put (any status), or None: where a restarted producer goes on.

        A producer that has put nothing into a queue that replaced a lost one gets its last id the resumed
        checkpoint trained (:meth:`carry_over`), so it goes on after that.
        """
        row = self._db.execute("SELECT id FROM experiences WHERE producer = ? ORDER BY seq DESC LIMIT 1",
                               (producer,)).fetchone()
        if row is None:
            row = self._db.execute("SELECT last_id FROM carried_ids WHERE producer = ?", (producer,)).fetchone()
        return None if row is None else row[0]

    # ------------------------------------------------------------------
    # the checkpoint's cursor

    @property
    @_reads_the_file
    def queue_id(self) -> int:
        """This file's own id, random, set when it was created: a cursor names the queue it was taken from."""
        return self._meta(QUEUE_ID)

    @_reads_the_file
    def cursor(self, step: int) -> dict:
        """What training steps ``1..step`` took from this queue, for the checkpoint of ``step`` to keep.

        ``{"queue_id", "step", "experiences", "last_seq", "last_ids"}``: the file's id, how many
        experiences the standing (open or committed) leases of those steps hold, the arrival number of the
        last of them (0 for none), and per producer the last id they took (or the one carried over into
        this queue, see :meth:`carry_over`). JSON-able; :meth:`check_cursor` compares a queue against it.
        """
        if not _is_int(step) or step < 0:
            raise ValueError(f"ExperienceQueue.cursor: step must be an integer >= 0, got {step!r}")
        taken = "SELECT id FROM leases WHERE step <= ? AND state IN ('open', 'committed')"
        count, last_seq = self._db.execute(
            f"SELECT COUNT(*), COALESCE(MAX(seq), 0) FROM experiences WHERE lease IN ({taken})", (step,)).fetchone()
        last_ids = dict(self._db.execute("SELECT producer, last_id FROM carried_ids"))
        last_ids.update(self._db.execute(
            f"SELECT producer, id FROM experiences WHERE seq IN (SELECT MAX(seq) FROM experiences WHERE lease IN "
            f"({taken}) GROUP BY producer)", (step,)))
        return {"queue_id": self.queue_id, "step": step, "experiences": int(count), "last_seq": int(last_seq),
                "last_ids": dict(sorted(last_ids.items()))}

    @_reads_the_file
    def check_cursor(self, cursor: dict) -> None:
        """Raise :class:`QueueFileError` unless this queue holds what ``cursor`` (:meth:`cursor` of a
        checkpoint's step) says those steps took from it: the same file (its id), every one of those
        experiences, and none of them beyond the queue's end. Reads only."""
        step = int(cursor["step"])
        what = (f"the checkpoint of training step {step} trained {cursor['experiences']} experiences from it "
                f"(the last one arrival number {cursor['last_seq']})")
        if self.queue_id != cursor["queue_id"]:
            stored = self._db.execute("SELECT COUNT(*) FROM experiences").fetchone()[0]
            leases = self._db.execute("SELECT COUNT(*) FROM leases").fetchone()[0]
            which = ("is a new, empty queue" if not stored and not leases else
                     f"is another queue (id {self.queue_id:x}, not the checkpoint's {int(cursor['queue_id']):x}: "
                     f"a replaced file, or another run's or stage's queue)")
            raise QueueFileError(f"experience queue {self.path} {which}, but {what}")
        now = self.cursor(step)
        if (now["experiences"], now["last_seq"]) != (cursor["experiences"], cursor["last_seq"]):
            end = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM experiences").fetchone()[0]
            beyond = (f"; the queue ends at arrival number {end}, before the checkpoint's cursor"
                      if end < cursor["last_seq"] else "")
            raise QueueFileError(
                f"experience queue {self.path} does not hold what the checkpoint trained from it: it holds "
                f"{now['experiences']} experiences taken by steps 1..{step} (the last one arrival number "
                f"{now['last_seq']}), but {what}{beyond}. Rows are missing: the file was replaced by an older "
                f"copy, or damaged")

    @_reads_the_file
    def carry_over(self, last_ids: dict[str, str]) -> None:
        """Record, in a queue that replaces a lost one, each producer's last id the resumed checkpoint trained
        (a cursor's ``last_ids``): :meth:`last_id` hands it to a producer that has put nothing here yet."""
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in last_ids.items()):
            raise ValueError(f"ExperienceQueue.carry_over: last_ids must map producer names to ids, got {last_ids!r}")

        def record() -> None:
            self._db.executemany("INSERT INTO carried_ids (producer, last_id) VALUES (?, ?) ON CONFLICT(producer) "
                                 "DO UPDATE SET last_id = excluded.last_id", sorted(last_ids.items()))

        self._execute_locked("record where the producers go on", record)

    # ------------------------------------------------------------------
    # inspection

    @_reads_the_file
    def counts(self) -> dict[str, int]:
        """Experiences per status: ``ready``, ``leased``, ``consumed``, ``dropped``."""
        out = {s: 0 for s in ("ready", "leased", "consumed", "dropped")}
        for status, n in self._db.execute("SELECT status, COUNT(*) FROM experiences GROUP BY status"):
            out[status] = n
        return out

    @_reads_the_file
    def ids(self, status: str) -> list[str]:
        """The ids with ``status``, in arrival order."""
        return [r[0] for r in self._db.execute("SELECT id FROM experiences WHERE status = ? ORDER BY seq", (status,))]
