"""The trainer's side of asynchronous RL (``trainer.mode`` ``one_step_off`` or ``async``): the producer
processes (``trainer.producers``, one by default), the experience queue between them and the trainer, and
the weights file they follow.

:class:`AsyncRollouts` is what the RL loop calls instead of generating::

    rollouts = AsyncRollouts.start(stage, strategy, resumed_step=loop.step)
    for step in ...:
        lease = rollouts.take(step)           # the step's experiences, sampled by an older policy
        ... train on lease.experiences ...
        rollouts.after_update(step)           # every trainer.sync_every steps: publish the weights
        ... checkpoint ... rollouts.commit(step)
    rollouts.close()

Versions count RL steps: the weights before step ``s`` are version ``s - 1``;
the stage's starting weights are version 0 (after a resume, the resumed
step). The producer (:mod:`rltk.training.producer`) never runs more than
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
settled on resume (:meth:`rltk.buffer.queue.ExperienceQueue.recover`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from rltk.buffer.queue import ExperienceQueue, Lease, QueueTimeout
from rltk.config.errors import ConfigError
from rltk.distributed import share_cores
from rltk.errors import ProcessWaitError
from rltk.training.engine_weights import write_weights_file
from rltk.training.producer import EXIT_TIMEOUT, batch_size

#: How often a waiting take looks at the producer process.
CHECK_S = 2.0
#: How many times a producer that exited is started again before the run stops.
RESTARTS = 1


class ProducerFailed(ProcessWaitError):
    """A producer process stopped and could not be kept running; the message names it and its log."""


class TrainerWaitTimeout(ProcessWaitError, QueueTimeout):
    """The trainer waited ``buffer.queue_timeout_s`` for a step's experiences."""


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").rstrip().splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text[-lines:])


class ProducerProcess:
    """One local rollout worker process (:mod:`rltk.training.producer`), its log, and its restarts."""

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
            self.proc = subprocess.Popen([sys.executable, "-m", "rltk.training.producer", *self.args,
                                          "--name", self.name], stdout=out, stderr=subprocess.STDOUT,
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


def start_producer(stage, strategy, *, resumed_step: int) -> "AsyncRollouts | None":
    """:meth:`AsyncRollouts.start` when ``trainer.mode`` is ``one_step_off`` or ``async``; None for ``sync``."""
    if stage.cfg.trainer.mode == "sync":
        return None
    if strategy.world_size > 1:
        raise ConfigError(
            f"trainer.mode={stage.cfg.trainer.mode} runs one trainer process so far (issue 30: the queue is read "
            f"by rank 0, which does not yet hand the batch to the other {strategy.world_size - 1}); launch one "
            f"process or use trainer.mode=sync")
    return AsyncRollouts.start(stage, strategy, resumed_step=resumed_step)


class AsyncRollouts:
    """The experience queue, the weights file and the producers of one asynchronous RL stage."""

    def __init__(self, stage, strategy, queue: ExperienceQueue, producers: list[ProducerProcess], weights: Path,
                 trainer_threads: int | None = None):
        self.stage, self.strategy, self.queue, self.weights = stage, strategy, queue, weights
        self.threads_before = torch.get_num_threads()
        if trainer_threads is not None:  # the trainer's share while the producers run (restored by close)
            torch.set_num_threads(trainer_threads)
        self.producers = list(producers)  # the ones still running; a failed one is reported and removed
        t = stage.cfg.trainer
        self.sync_every = int(t.sync_every)
        self.count = batch_size(stage.cfg)
        self.timeout_s = float(stage.cfg.buffer.queue_timeout_s)

    @classmethod
    def start(cls, stage, strategy, *, resumed_step: int) -> "AsyncRollouts":
        """Settle the queue for a stage at ``resumed_step`` (0: a fresh stage), publish the weights as that
        version, and start the producer."""
        run, cfg = stage.run, stage.cfg
        t = cfg.trainer
        folder = run.run_dir / "async" / f"stage_{stage.index}"
        folder.mkdir(parents=True, exist_ok=True)
        queue_path = Path(cfg.buffer.queue_path) if cfg.buffer.queue_path else folder / "experience_queue.sqlite"
        if stage.resume is None and not cfg.buffer.queue_path:
            # a stage started afresh in this folder (checkpoint.resume=never): the old run's queue is not its own
            for old in folder.iterdir():
                if old.name.startswith("experience_queue.sqlite") or old.suffix == ".log":
                    old.unlink()
        max_staleness = 1 if t.mode == "one_step_off" else int(t.max_staleness)
        queue = ExperienceQueue(queue_path, max_staleness=max_staleness, stale_policy=t.stale_policy,
                                timeout_s=cfg.buffer.queue_timeout_s)
        queue.recover(resumed_step)
        weights = folder / "policy.safetensors"
        write_weights_file(strategy.unwrap(), weights, resumed_step)
        queue.publish_version(resumed_step)
        config = folder / "producer_config.yaml"
        OmegaConf.save(cfg, config, resolve=True)
        count = int(t.producers)
        threads = share_cores(count + 1)
        producers = [ProducerProcess(
            f"producer-{k}", ["--config", str(config), "--stage", str(stage.index), "--queue", str(queue_path),
                              "--weights", str(weights), "--timeout", str(cfg.buffer.queue_timeout_s),
                              "--index", str(k), "--count", str(count)],
            folder / f"producer-{k}.log", threads) for k in range(count)]
        for producer in producers:
            producer.start()
        return cls(stage, strategy, queue, producers, weights, trainer_threads=threads)

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
        """The experiences of training step ``step`` (trainer version ``step - 1``), with ``staleness/*``
        metrics; waits at most ``buffer.queue_timeout_s``, checking the producer meanwhile."""
        start = time.monotonic()
        dropped_before = self.queue.counts()["dropped"]
        while True:
            self.check_producers()
            left = self.timeout_s - (time.monotonic() - start)
            try:
                lease = self.queue.take(self.count, step=step, version=step - 1,
                                        timeout_s=max(min(CHECK_S, left), 1e-3))
            except QueueTimeout as exc:
                if time.monotonic() - start >= self.timeout_s:
                    names = ", ".join(f"'{p.name}' (log {p.log})" for p in self.producers)
                    raise TrainerWaitTimeout(
                        f"waited {self.timeout_s:g} s (buffer.queue_timeout_s) for rollout producer(s) {names}: "
                        f"{exc}") from None
                continue
            lease.metrics["staleness/dropped"] = float(self.queue.counts()["dropped"] - dropped_before)
            lease.metrics["staleness/waited_s"] = time.monotonic() - start
            lease.metrics["producers/alive"] = float(len(self.producers))
            # reward_fn/*: the producers' counts (put with their batches) plus the trainer's own (evaluations)
            for name, value in self.stage.run.workflow.reward.stats().items():
                lease.metrics[f"reward_fn/{name}"] = lease.metrics.get(f"reward_fn/{name}", 0.0) + value
            return lease

    def after_update(self, step: int) -> None:
        """After step ``step``'s update: every ``trainer.sync_every`` steps the producer gets version ``step``."""
        if step % self.sync_every == 0:
            write_weights_file(self.strategy.unwrap(), self.weights, step)
            self.queue.publish_version(step)

    def commit(self, step: int) -> None:
        """Right after the checkpoint of ``step`` is saved: its steps' experiences are consumed."""
        self.queue.commit(step)

    def close(self) -> None:
        for producer in self.producers:
            producer.stop()
        self.queue.close()
        torch.set_num_threads(self.threads_before)
