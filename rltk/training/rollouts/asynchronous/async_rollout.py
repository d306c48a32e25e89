"""The trainer's side of asynchronous RL (``trainer.mode`` ``one_step_off`` or ``async``): the producer
processes (``trainer.producers``, one by default), the experience queue between them and the trainer, and
the weights file they follow.

:class:`AsyncRollouts` is the rollout source of such a stage (an RL loop reaches it through
:func:`rltk.training.rollouts.rollout_source.open_rollout_source`, as it reaches the synchronous one)::

    rollouts = AsyncRollouts.start(stage, strategy, resumed_step=loop.step)
    for step in ...:
        lease = rollouts.take(step)           # the step's experiences, sampled by an older policy
        ... train on lease.experiences ...
        rollouts.after_update(step)           # every trainer.sync_every steps: publish the weights
        ... checkpoint ... rollouts.commit(step)
    rollouts.close()

Versions count RL steps: the weights before step ``s`` are version ``s - 1``;
the stage's starting weights are version 0 (after a resume, the resumed
step). The producer (:mod:`rltk.training.rollouts.asynchronous.producer`) never runs more than
``trainer.max_staleness`` versions ahead, and the queue drops (or waits past)
anything staler, so every trained token lags the trainer by at most that.

Nothing hangs: a take waits at most ``buffer.queue_timeout_s`` in total, and
between short polls checks the producers. A producer that exits is started
again once (its log says why it stopped; a restarted producer goes on where
its last put ended); a second exit is reported, naming the producer, its exit
status and its log, with the log's last lines, and training goes on with the
other producers (``producers/alive`` counts them); when none is left the run
stops with that report.

Exactly once: the queue's leases are committed with each checkpoint and
settled on resume (:meth:`rltk.training.rollouts.asynchronous.queue.ExperienceQueue.recover`). Each
checkpoint also keeps the queue's cursor (what its steps took from the queue,
:meth:`AsyncRollouts.cursor`, in the loop state), and a resume refuses a queue
that does not hold it: deleted, empty, damaged, another file, rows missing
(:func:`open_stage_queue`; ``rltk run`` exits 2 naming the file). The two ways
on are in the message: start the stage over, or ``buffer.queue_resume=fresh``,
which resumes from the checkpoint with a new queue whose producers go on after
the last experiences the checkpoint trained, so none is trained twice (what
the old queue held untrained is lost and sampled anew).

Several trainer ranks (torchrun, accelerate, deepspeed; DDP, FSDP2, ZeRO):
rank 0 alone opens the queue, starts the producers, takes each step's lease,
publishes weights and commits. It hands every rank its share of the lease's
groups as the synchronous loop splits a step's prompts (group ``g`` to rank
``g % world_size``, whole groups: :func:`rank_shares`), with the lease's
metrics (computed once, over the whole batch) for every rank. A sharded
strategy gathers the full weights on every rank (collective) before rank 0
writes them. The hand-over runs on a gloo group of its own whose timeout is
``buffer.queue_timeout_s`` plus :data:`HANDOFF_MARGIN_S`, so a rank never
waits on rank 0 without end, and the error says what it waited for; an error
on rank 0 (a timeout, a failed producer) is handed to every rank instead of
a share, so all of them stop with the same message.

Producers the trainer did not start (``trainer.producers: 0``, or more beside
the local ones): ``rltk produce RUN_DIR`` on any machine that shares the run
folder (:mod:`rltk.commands.produce`). The trainer writes
``async/stage_<i>/producer.json`` (where the config, queue and weights are) for
them, and when the stage ends records it in the queue, so they exit.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from omegaconf import OmegaConf

from rltk.buffer.buffer import trainer_version
from rltk.training.rollouts.asynchronous.queue import ExperienceQueue, Lease, QueueFileError, QueueTimeout
from rltk.distributed import share_cores
from rltk.errors import ConfigError, ProcessWaitError
from rltk.training.rollouts.engine_weights import write_weights_file, write_weights_state
from rltk.training.rollouts.collect import produced_metrics
from rltk.training.rollouts.asynchronous.producer import EXIT_TIMEOUT, batch_size

#: How often a waiting take looks at the producer process.
CHECK_S = 2.0
#: How many times a producer that exited is started again before the run stops.
RESTARTS = 1
#: Seconds a rank waits for rank 0's hand-over beyond buffer.queue_timeout_s (rank 0's own wait on the queue):
#: what rank 0 does between two hand-overs besides waiting (publishing weights, committing) fits in it.
HANDOFF_MARGIN_S = 120.0
#: The file in an asynchronous stage's folder that tells ``rltk produce`` where the stage's queue, weights and
#: config are.
RENDEZVOUS = "producer.json"
#: ``buffer.queue_resume=fresh`` renames the replaced queue's file to its name plus this (SQLite's ``-wal`` or
#: ``-journal`` beside it keeps its own suffix, so the pair still opens), replacing an earlier one.
DISCARDED = ".discarded"


class ProducerFailed(ProcessWaitError):
    """A producer process stopped and could not be kept running; the message names it and its log."""


class TrainerWaitTimeout(ProcessWaitError, QueueTimeout):
    """The trainer waited ``buffer.queue_timeout_s`` for a step's experiences."""


class HandoffTimeout(ProcessWaitError):
    """A trainer rank waited too long for rank 0 to hand it its share of a step's experiences."""


def rank_shares(lease: Lease, world_size: int) -> list[Lease]:
    """``lease`` cut into one lease per rank: group ``g`` (in batch order) goes to rank ``g % world_size``.

    Whole groups, as the synchronous loop gives rank ``r`` the prompts
    ``r, r + world_size, ...`` of a step; group ids stay the batch's (the
    estimator tells ranks' groups apart). Every share carries the whole
    lease's ``metrics``.
    """
    order: dict[int, int] = {}
    for e in lease.experiences:
        order.setdefault(e.group_id, len(order))
    shares = [Lease(lease.id, lease.step, lease.version, [], [], [], [], dict(lease.metrics))
              for _ in range(world_size)]
    for i, e in enumerate(lease.experiences):
        share = shares[order[e.group_id] % world_size]
        share.experiences.append(e)
        share.ids.append(lease.ids[i])
        share.versions.append(lease.versions[i])
        share.group_keys.append(lease.group_keys[i])
        share.sampled_versions.append(lease.sampled_versions[i])
    return shares


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").rstrip().splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text[-lines:])


class ProducerProcess:
    """One local rollout worker process (:mod:`rltk.training.rollouts.asynchronous.producer`), its log, and its
    restarts."""

    def __init__(self, name: str, args: list[str], log: Path, threads: int | None = None):
        self.name, self.args, self.log = name, args, log
        # its share of the cores (None: OMP_NUM_THREADS as the user set it)
        self.env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        with open(self.log, "a", encoding="utf-8") as out:
            out.write(f"--- start {self.starts} ---\n")
            out.flush()
            self.proc = subprocess.Popen([sys.executable, "-m", "rltk.training.rollouts.asynchronous.producer",
                                          *self.args, "--name", self.name], stdout=out, stderr=subprocess.STDOUT,
                                         env=self.env)

    def check(self) -> None:
        """Restart the producer if it exited (once); raise :class:`ProducerFailed` the next time."""
        code = self.proc.poll() if self.proc is not None else None
        if code is None:
            return
        why = " (a wait of buffer.queue_timeout_s ran out)" if code == EXIT_TIMEOUT else ""
        if self.starts > RESTARTS:
            raise ProducerFailed(
                f"rollout producer '{self.name}' (pid {self.proc.pid}) exited with status {code}{why} after "
                f"{self.starts} starts; its log is {self.log}, which ends:\n{_tail(self.log)}")
        print(f"rltk: rollout producer '{self.name}' exited with status {code}{why}; starting it again "
              f"(log: {self.log})", file=sys.stderr, flush=True)
        self.start()

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _queue_files(path: Path, suffixes=("", "-wal", "-journal")) -> list[Path]:
    """The queue's file and SQLite's files beside it (a write-ahead log, a rollback journal) that exist."""
    return [Path(f"{path}{suffix}") for suffix in suffixes if Path(f"{path}{suffix}").exists()]


def _discard(path: Path) -> list[Path]:
    """Rename the queue's file and its journal to ``<name>`` + :data:`DISCARDED` (an earlier discarded one is
    removed first, so no stale journal pairs with it); remove the shared-memory index. Returns the new names."""
    target = path.with_name(path.name + DISCARDED)
    for old in _queue_files(target, ("", "-wal", "-journal", "-shm")):
        old.unlink()
    moved = []
    for file in _queue_files(path):
        new = Path(f"{target}{file.name[len(path.name):]}")
        os.replace(file, new)
        moved.append(new)
    Path(f"{path}-shm").unlink(missing_ok=True)
    return moved


def open_stage_queue(path: Path, *, resumed_step: int, cursor: dict | None, queue_resume: str = "keep",
                     start_over: str = "checkpoint.resume=never", **queue_args) -> ExperienceQueue:
    """The experience queue of an asynchronous stage that starts at ``resumed_step`` (0: afresh), its open
    leases settled (:meth:`ExperienceQueue.recover`).

    ``cursor`` is what the resumed checkpoint took from the queue (:meth:`ExperienceQueue.cursor`; None for
    a fresh stage, or a checkpoint of an rltk that saved none, which is not checked). With
    ``queue_resume="keep"`` (``buffer.queue_resume``) a resumed stage trains on from the queue only if it
    holds that cursor; a queue deleted, empty, damaged, another file or missing rows raises
    :class:`QueueFileError` (a ``ConfigError``: ``rltk run`` exits 2) naming the file and the two ways on:
    start the stage over (``start_over`` says how), or ``fresh``, which renames the old files aside
    (:data:`DISCARDED`) and opens a new queue that carries the cursor's last ids over (its producers go on
    after them: nothing the checkpoint trained is trained again). ``queue_args`` go to the queue.
    """
    if not resumed_step:
        try:
            queue = ExperienceQueue(path, **queue_args)
        except QueueFileError as exc:
            raise QueueFileError(f"{exc}. The stage starts afresh: remove the file, or give buffer.queue_path "
                                 f"another one") from None
        return _recovered(queue, 0)
    if queue_resume == "fresh":
        if cursor is None:
            raise ConfigError(
                f"buffer.queue_resume=fresh: the checkpoint this stage resumes from (training step {resumed_step}) "
                f"keeps no cursor of the experience queue {path} (an older rltk wrote it), so where the producers "
                f"would go on without retraining what it trained is unknown. Resume from the queue as it is "
                f"(buffer.queue_resume=keep), or start the stage over ({start_over})")
        moved = _discard(path)
        queue = ExperienceQueue(path, **queue_args)
        queue.carry_over(cursor["last_ids"])
        queue = _recovered(queue, resumed_step)
        old = f"the old one renamed to {moved[0]}" if moved else "there was no old one"
        goes_on = ", ".join(f"{name} after {last}" for name, last in cursor["last_ids"].items()) or "from the start"
        print(f"rltk: buffer.queue_resume=fresh: a new experience queue {path} ({old}); training goes on after "
              f"step {resumed_step} without the old queue's untrained experiences, the producers going on "
              f"where the checkpoint's trained ones end ({goes_on})", file=sys.stderr, flush=True)
        return queue
    ways = (f"Either start the stage over ({start_over}), or resume from this checkpoint without the queue's "
            f"leftovers with buffer.queue_resume=fresh: a new queue whose producers go on after the last "
            f"experiences the checkpoint trained, so none is trained twice (what the old queue held untrained "
            f"is sampled anew)")
    if cursor is not None:
        # refused before SQLite opens it: an empty file would become a new queue (its write-ahead log,
        # if a killed trainer left one, reset)
        lost = ("does not exist (deleted?)" if not path.exists() else
                "is empty (0 bytes)" if path.stat().st_size == 0 else None)
        if lost:
            raise QueueFileError(
                f"experience queue {path} {lost}, but the checkpoint this run resumes from (training step "
                f"{cursor['step']}) trained {cursor['experiences']} experiences from it; resuming with it "
                f"would train them again. {ways}")
    try:
        queue = ExperienceQueue(path, **queue_args)
        try:
            if cursor is not None:
                queue.check_cursor(cursor)
        except BaseException:
            queue.close()
            raise
        return _recovered(queue, resumed_step)
    except QueueFileError as exc:
        raise QueueFileError(f"{exc}. {ways}") from None


def _recovered(queue: ExperienceQueue, resumed_step: int) -> ExperienceQueue:
    try:
        queue.recover(resumed_step)
    except BaseException:
        queue.close()
        raise
    return queue


def start_over_hint(stage) -> str:
    """How ``stage`` starts over, for messages: from the previous stage's last checkpoint when it has one
    (kept whatever ``checkpoint.keep_last``), else the whole run."""
    if stage.index > 0:
        before = stage.run.ckpt.path_for(stage.first_step)
        if before.is_dir():
            return f"checkpoint.resume={before}, the end of the stage before it"
    return "checkpoint.resume=never: the run starts over, its checkpoints deleted"


def stage_folder(run_dir: Path, stage_index: int) -> Path:
    """Where an asynchronous stage keeps its queue (unless ``buffer.queue_path``), weights, logs and
    :data:`RENDEZVOUS` file."""
    return Path(run_dir) / "async" / f"stage_{stage_index}"


def open_trainer_queue(stage, resumed_step: int, cursor: dict | None) -> tuple[ExperienceQueue, Path]:
    """Rank 0's experience queue of an asynchronous ``stage`` (:func:`open_stage_queue` with the stage's
    ``buffer.queue_*`` and ``trainer`` keys) and its path, in the stage's folder unless ``buffer.queue_path``;
    a stage started afresh there first removes the old run's queue, logs and rendezvous file."""
    cfg, t = stage.cfg, stage.cfg.trainer
    folder = stage_folder(stage.run.run_dir, stage.index)
    queue_path = Path(cfg.buffer.queue_path) if cfg.buffer.queue_path else folder / "experience_queue.sqlite"
    folder.mkdir(parents=True, exist_ok=True)
    if stage.resume is None and not cfg.buffer.queue_path:
        # a stage started afresh in this folder (checkpoint.resume=never): the old run's queue is not its own
        for old in folder.iterdir():
            if old.name.startswith("experience_queue.sqlite") or old.suffix == ".log" or old.name == RENDEZVOUS:
                old.unlink()
    max_staleness = 1 if t.mode == "one_step_off" else int(t.max_staleness)
    queue = open_stage_queue(queue_path, resumed_step=resumed_step, cursor=cursor,
                             queue_resume=cfg.buffer.queue_resume, start_over=start_over_hint(stage),
                             max_staleness=max_staleness, stale_policy=t.stale_policy,
                             timeout_s=cfg.buffer.queue_timeout_s, journal_mode=cfg.buffer.queue_journal)
    return queue, queue_path


def _handoff_group(strategy, timeout_s: float):
    """A gloo group of every rank for the hand-over (objects on CPU whatever the backend), with its own
    timeout; None with one process."""
    if strategy.world_size == 1 or not torch.distributed.is_initialized():
        return None
    return torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


class AsyncRollouts:
    """The experience queue, the weights file and the producers of one asynchronous RL stage.

    On ranks other than 0 ``queue`` is None: they only receive their shares and join weight gathers.
    """

    def __init__(self, stage, strategy, queue: ExperienceQueue | None, producers: list[ProducerProcess],
                 weights: Path, trainer_threads: int | None = None, group=None):
        self.stage, self.strategy, self.queue, self.weights = stage, strategy, queue, weights
        self.group = group
        self.threads_before = torch.get_num_threads()
        if trainer_threads is not None:  # the trainer's share while the producers run (restored by close)
            torch.set_num_threads(trainer_threads)
        self.producers = list(producers)  # the ones still running; a failed one is reported and removed
        self.local = len(self.producers)  # how many rank 0 started (0: every producer is external)
        t = stage.cfg.trainer
        self.sync_every = int(t.sync_every)
        self.total_steps = int(t.total_steps)
        self.count = batch_size(stage.cfg)
        self.timeout_s = float(stage.cfg.buffer.queue_timeout_s)
        self.handoff_s = self.timeout_s + HANDOFF_MARGIN_S  # the hand-over group's timeout

    @classmethod
    def start(cls, stage, strategy, *, resumed_step: int, cursor: dict | None = None) -> "AsyncRollouts":
        """Settle the queue for a stage at ``resumed_step`` (0: a fresh stage), publish the weights as that
        version, and start the producers. ``cursor``: what the resumed checkpoint took from the queue (see
        :func:`open_stage_queue`). Collective: every rank calls it; rank 0 does the file work."""
        run, cfg = stage.run, stage.cfg
        t = cfg.trainer
        folder = stage_folder(run.run_dir, stage.index)
        weights = folder / "policy.safetensors"
        group = _handoff_group(strategy, float(cfg.buffer.queue_timeout_s) + HANDOFF_MARGIN_S)
        if not strategy.is_main:
            rollouts = cls(stage, strategy, None, [], weights, group=group)
            rollouts._publish(resumed_step)  # a sharded strategy gathers on every rank
            return rollouts
        queue, queue_path = open_trainer_queue(stage, resumed_step, cursor)
        count = int(t.producers)
        threads = share_cores(count + 1) if count else None
        rollouts = cls(stage, strategy, queue, [], weights, trainer_threads=threads, group=group)
        rollouts._publish(resumed_step)
        queue.publish_version(resumed_step)
        config = folder / "producer_config.yaml"
        OmegaConf.save(cfg, config, resolve=True)
        # what `rltk produce RUN_DIR` reads on another machine: written last, once the weights are there
        _write_json(folder / RENDEZVOUS, {
            "stage": stage.index, "config": str(config.resolve()), "queue": str(queue_path.resolve()),
            "weights": str(weights.resolve()), "timeout_s": float(cfg.buffer.queue_timeout_s),
            "journal_mode": cfg.buffer.queue_journal, "local_producers": count})
        rollouts.producers = [ProducerProcess(
            f"producer-{k}", ["--config", str(config), "--stage", str(stage.index), "--queue", str(queue_path),
                              "--weights", str(weights), "--timeout", str(cfg.buffer.queue_timeout_s),
                              "--index", str(k), "--count", str(count)],
            folder / f"producer-{k}.log", threads) for k in range(count)]
        rollouts.local = count
        for producer in rollouts.producers:
            producer.start()
        return rollouts

    def _publish(self, version: int) -> None:
        """Write the weights file as ``version`` (rank 0). Collective under a strategy that shards parameters:
        every rank gathers the full weights, rank 0 writes them."""
        if self.strategy.shards_parameters:
            state = self.strategy.export_state_dict()
            if self.strategy.is_main:
                write_weights_state(state, self.weights, version)
        elif self.strategy.is_main:
            write_weights_file(self.strategy.unwrap(), self.weights, version)

    def check_producers(self) -> None:
        """Restart or report each producer that exited; raise :class:`ProducerFailed` when none is left."""
        for producer in list(self.producers):
            try:
                producer.check()
            except ProducerFailed as exc:
                self.producers.remove(producer)
                if not self.producers:
                    raise
                print(f"rltk: {exc}\nrltk: training goes on with {len(self.producers)} producer(s): "
                      f"{', '.join(p.name for p in self.producers)}", file=sys.stderr, flush=True)

    def take(self, step: int) -> Lease:
        """The experiences of training step ``step`` (trainer version ``step - 1``) for this rank, with
        ``staleness/*`` metrics of the whole batch; waits at most ``buffer.queue_timeout_s``, checking the
        producers meanwhile. Collective with several ranks: rank 0 takes and hands out the shares."""
        if self.group is None:
            return self._take(step)
        world, rank = self.strategy.world_size, self.strategy.rank
        error = outgoing = None
        if rank == 0:
            try:
                lease = self._take(step)
                # one share per data rank; the ranks of a sequence/tensor group get the same one
                shares = rank_shares(lease, self.strategy.data_world_size)
                layout = self.strategy.layout
                outgoing = [shares[layout.data_rank(r)] for r in range(world)]
            except Exception as exc:  # every rank stops with rank 0's message, none waits for a share
                error = exc
                try:
                    pickle.dumps(exc)
                    outgoing = [exc] * world
                except Exception:
                    outgoing = [RuntimeError(f"rank 0: {type(exc).__name__}: {exc}")] * world
        received: list = [None]
        try:
            torch.distributed.scatter_object_list(received, outgoing, src=0, group=self.group)
        except RuntimeError as exc:
            raise HandoffTimeout(
                f"trainer rank {rank} waited up to {self.handoff_s:g} s (buffer.queue_timeout_s + "
                f"{HANDOFF_MARGIN_S:g}) "
                f"for rank 0 to hand it its share of training step {step}'s experiences from the queue; rank 0 "
                f"is gone or stuck (its own output says why): {exc}") from None
        if error is not None:
            raise error
        share = received[0]
        if isinstance(share, BaseException):
            raise share
        return share

    def _take(self, step: int) -> Lease:
        start = time.monotonic()
        dropped_before = self.queue.counts()["dropped"]
        while True:
            self.check_producers()
            left = self.timeout_s - (time.monotonic() - start)
            try:
                lease = self.queue.take(self.count, step=step, version=trainer_version(step),
                                        timeout_s=max(min(CHECK_S, left), 1e-3))
            except QueueTimeout as exc:
                if time.monotonic() - start >= self.timeout_s:
                    raise TrainerWaitTimeout(self._timeout_message(exc)) from None
                continue
            lease.metrics["staleness/dropped"] = float(self.queue.counts()["dropped"] - dropped_before)
            lease.metrics["staleness/waited_s"] = time.monotonic() - start
            lease.metrics["producers/alive"] = float(len(self.producers))
            # rollout/*: the whole batch's, once, whatever share each rank trains
            lease.metrics.update(produced_metrics(lease.experiences))
            # reward_fn/*: the producers' counts (put with their batches) plus the trainer's own (evaluations)
            for name, value in self.stage.run.workflow.reward.stats().items():
                lease.metrics[f"reward_fn/{name}"] = lease.metrics.get(f"reward_fn/{name}", 0.0) + value
            return lease

    def _timeout_message(self, exc: QueueTimeout) -> str:
        what = f"waited {self.timeout_s:g} s (buffer.queue_timeout_s) for "
        if self.producers:
            names = ", ".join(f"'{p.name}' (log {p.log})" for p in self.producers)
            return f"{what}rollout producer(s) {names}: {exc}"
        seen = self.queue.producers()
        run_dir = self.stage.run.run_dir
        if self.local == 0 and not seen:
            return (f"{what}an external rollout producer: none has put an experience into {self.queue.path} "
                    f"(trainer.producers=0: the producers are yours to start, e.g. `rltk produce {run_dir}` on a "
                    f"machine that shares this folder): {exc}")
        names = ", ".join(f"'{name}' ({n} put)" for name, n in sorted(seen.items())) or "none"
        return (f"{what}rollout producers; the local ones are gone and the producers seen so far are {names} "
                f"(external ones run `rltk produce {run_dir}`): {exc}")

    def after_update(self, step: int) -> None:
        """After step ``step``'s update: every ``trainer.sync_every`` steps the producers get version ``step``.
        Collective under a strategy that shards parameters."""
        if step % self.sync_every == 0:
            self._publish(step)
            if self.queue is not None:
                self.queue.publish_version(step)

    def cursor(self, step: int) -> dict | None:
        """Right before the checkpoint of ``step`` is saved: what steps ``1..step`` took from the queue, for
        the loop state to keep (:meth:`ExperienceQueue.cursor`); None on ranks other than 0."""
        return self.queue.cursor(step) if self.queue is not None else None

    def commit(self, step: int) -> None:
        """Right after the checkpoint of ``step`` is saved: its steps' experiences are consumed (rank 0)."""
        if self.queue is not None:
            self.queue.commit(step)

    def close(self) -> None:
        for producer in self.producers:
            producer.stop()
        if self.queue is not None:
            if self.queue.committed_step >= self.total_steps:  # the stage's end: external producers stop
                self.queue.finish(self.queue.committed_step)
            self.queue.close()
        if self.group is not None:
            torch.distributed.destroy_process_group(self.group)
            self.group = None
        torch.set_num_threads(self.threads_before)
