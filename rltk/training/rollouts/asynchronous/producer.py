"""A rollout producer process of an asynchronous run: sample, score, put into the experience queue, repeat.

The trainer (:mod:`rltk.training.rollouts.asynchronous.async_rollout`) starts it beside itself::

    python -m rltk.training.rollouts.asynchronous.producer --config STAGE.yaml --stage I --queue Q.sqlite \\
        --weights policy.safetensors --name producer-0 [--index 0 --count 1]

With ``trainer.producers`` = N, producer ``k`` samples only the rows ``k, k + N, ...``
(:func:`producer_rows`) and seeds its batches apart from the others'.

It builds the stage's tokenizer, policy, rows and workflow exactly as the
trainer does (:func:`rltk.training.scaffold.setup.build_workflow`; any workflow:
single-turn, multi-turn, agentic), loads the trainer's weights from the file
the trainer renames into place (:func:`rltk.training.rollouts.engine_weights.write_weights_file`),
and loops:

1. load the newest published weights (their version ``v``);
2. wait until a batch sampled now would not be too stale: it is trained at
   step ``L + r + 1`` (``L`` the last step the trainer took, ``r`` the batches
   ready in the queue before it), under trainer version ``L + r``, so it waits
   while ``L + r - v > max_staleness`` (AReaL's ``max_head_offpolicyness``
   gate, counted in steps). ``one_step_off`` is ``max_staleness = 1``: the
   batch for step ``t + 1`` is sampled by policy ``t - 1`` while step ``t``
   trains;
3. draw the next prompts, run the workflow (:func:`rltk.training.rollouts.collect.collect_experiences`,
   so greedy baselines and dynamic sampling work as in the synchronous loop),
   and put the batch, each experience with its id and per-token versions, in
   one transaction.

On the ``hf`` engine the producer's own module samples and reads the file
between batches, so a batch is version ``v`` throughout. On ``vllm_server``
(:class:`WeightsFollower`) the servers (launched by the producer, or the
addresses in ``rollout.engine_args.servers``) load the trainer's file itself,
and a version published *during* a batch is loaded at once: the servers pause
with ``mode=abort``, load it and resume, and the engine continues the
interrupted samples under it. Each token then carries the version that
sampled it (single-turn workflows; the others count a batch's tokens as
``v``, the oldest they can be), the queue bounds the oldest token's staleness,
and ``async/weight_loads_mid_batch`` / ``async/continued_samples`` count the
interruptions.

Ids are ``<name>-b<batch>-<index>``; a restarted producer reads its last
put id from the queue and goes on with the next batch (its prompt sampler
skipped to that batch; sampling seeded per batch), so nothing is put twice.

Every wait has ``--timeout`` seconds (``buffer.queue_timeout_s``) and then
exits with an error naming what it waited for. It also exits when the
process that started it is gone (the trainer died), so no producer outlives
its run, and (status 0) when the trainer records in the queue that its stage
has ended. A producer the trainer did not start (``rltk produce``,
:mod:`rltk.commands.produce`) skips the parent check (``trainer=False``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

#: Exit status of a producer whose wait ran out (the trainer reports it with the log's tail).
EXIT_TIMEOUT = 3
#: Exit status of a producer whose trainer is gone.
EXIT_ORPHANED = 4
#: Exit status of a producer whose trainer ended the stage (nothing more to produce).
EXIT_DONE = 0


def batch_size(cfg) -> int:
    """Experiences one batch (one training step) holds: prompts_per_step x rollout.n."""
    return int(cfg.trainer.prompts_per_step) * int(cfg.rollout.n)


def batch_of(exp_id: str) -> int:
    """The batch number in an id ``<name>-b<batch>-<index>``."""
    return int(exp_id.rsplit("-", 2)[1][1:])


def gate_open(taken_step: int, ready: int, per_batch: int, version: int, max_staleness: int) -> bool:
    """Whether a batch sampled now by policy ``version`` trains within ``max_staleness`` versions.

    It queues behind ``ceil(ready / per_batch)`` ready batches, so it is taken
    at step ``taken_step + r + 1`` by trainer version ``taken_step + r``.
    """
    r = -(-ready // per_batch)
    return taken_step + r - version <= max_staleness


class _Parent:
    """Whether the trainer that started this process still runs."""

    def __init__(self):
        self.pid = os.getppid()

    def alive(self) -> bool:
        return os.getppid() == self.pid


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def producer_rows(rows: list, index: int, count: int) -> list:
    """Producer ``index`` of ``count``'s share of the training rows: rows ``index, index + count, ...``
    (all of them for a lone producer), so two producers never sample the same prompt in one epoch."""
    return rows[index::count]


def run_producer(cfg, **settings) -> int:
    """Produce batches until the trainer ends the stage (:data:`EXIT_DONE`) or a wait runs out: :class:`Producer`
    built from ``cfg`` and ``settings`` (its keyword arguments), then run."""
    return Producer(cfg, **settings).run()


class Producer:
    """One producer process: sample a batch with the newest published weights whenever the staleness gate
    allows, put it into the queue, repeat.

    ``trainer``: this process was started by the trainer (it stops when that parent is gone).
    ``seed_salt`` is added to the prompt order's and the sampling's seeds, so producers outside the
    trainer that share the rows (one ``index``) still sample apart. A restarted producer goes on at the
    batch after its last put (the queue knows it), with the prompts the batches before it drew skipped.

    Where the queue and the weights are: by default the SQLite file at ``queue_path`` and the weights file
    at ``weights_path``. A producer on another machine (``launcher=ray``,
    :mod:`rltk.training.rollouts.asynchronous.ray_source`) passes ``queue``, an object with the queue methods a producer
    calls (``put``, ``progress``, ``last_id``, ``finished_step``), and ``follower_type``, a
    :class:`WeightsFollower` that fetches published weights over the network (``weights_path`` is then its
    own file, on its own machine).
    """

    def __init__(self, cfg, *, stage_index: int, queue_path: str | None, weights_path: str, name: str,
                 timeout_s: float, index: int = 0, count: int = 1, poll_s: float = 0.005, trainer: bool = True,
                 seed_salt: int = 0, queue=None, follower_type=None):
        from rltk.training.rollouts.asynchronous.queue import ExperienceQueue
        from rltk.data.sampler import RowSampler
        from rltk.distributed import limit_torch_threads, seed_everything
        from rltk.training.rollouts.collect import RolloutPlan
        from rltk.training.scaffold.rows import build_rows
        from rltk.training.scaffold.setup import build_tokenizer_and_policy, build_workflow

        self.cfg, self.stage_index, self.weights_path, self.name = cfg, stage_index, weights_path, name
        self.timeout_s, self.index, self.poll_s, self.seed_salt = timeout_s, index, poll_s, seed_salt
        self.parent = _Parent() if trainer else None
        # SIGTERM (the trainer stopping it) unwinds like an exception: a weight load under way finishes, and its
        # servers are resumed, before the process exits (a server left paused would hold every later request)
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        limit_torch_threads()
        seed_everything(cfg.seed)
        tokenizer, self.policy = build_tokenizer_and_policy(cfg)
        train_rows = producer_rows(build_rows(cfg, tokenizer)[0], index, count)
        self.workflow = build_workflow(cfg, self.policy, tokenizer)
        self.plan = RolloutPlan.from_config(cfg)
        t = cfg.trainer
        self.max_staleness = 1 if t.mode == "one_step_off" else int(t.max_staleness)
        self.per_batch = batch_size(cfg)
        self.queue = queue if queue is not None else ExperienceQueue(
            queue_path, timeout_s=timeout_s, journal_mode=cfg.buffer.get("queue_journal", "wal"))
        self.follower_type = follower_type or WeightsFollower
        self.sampler = RowSampler(train_rows, t.prompts_per_step, seed=cfg.seed + stage_index + seed_salt,
                                  shuffle=cfg.data.shuffle)
        last = self.queue.last_id(name)
        self.batch = 0 if last is None else batch_of(last) + 1
        for _ in range(self.batch):  # the prompts of the batches already put
            self.sampler.next_batch()
        self.weights_s = 0.0  # loading published weights since the last put, outside sampling (producer/weights_s)
        self.put_s = 0.0  # the last put's own time (producer/put_s of the next batch: a put cannot carry its own)
        self.follower: WeightsFollower | None = None  # keeps the engine on the newest published weights
        self.next_end_check = 0.0  # when wait() next asks the queue whether the trainer ended the stage

    def run(self) -> int:
        follower = self.follower_type(self.workflow.engine, self.policy, self.weights_path)
        self.wait(f"the trainer's first weights in {follower.source}", lambda: follower.published_version() is not None)
        self.follower = follower
        print(f"rltk producer {self.name}: pid {os.getpid()}, starting at batch {self.batch}", flush=True)
        while True:
            self.produce_batch()

    def load_newest(self) -> None:
        started = time.perf_counter()
        if self.follower.follow():
            self.weights_s += time.perf_counter() - started

    def wait(self, what: str, done) -> bool:
        """Poll ``done`` until it is true; stop the process (exit status says why) if the trainer ended the
        stage or is gone, or after ``timeout_s``."""
        start = time.monotonic()
        while not done():
            if time.monotonic() >= self.next_end_check:  # every half second, not at every 5 ms poll
                self.next_end_check = time.monotonic() + 0.5
                if self.queue.finished_step is not None:
                    print(f"rltk producer {self.name}: the trainer ended the stage at step {self.queue.finished_step}; "
                          f"stopping", flush=True)
                    raise SystemExit(EXIT_DONE)
            if self.parent is not None and not self.parent.alive():
                print(f"rltk producer {self.name}: the trainer (pid {self.parent.pid}) is gone; stopping", flush=True)
                raise SystemExit(EXIT_ORPHANED)
            if time.monotonic() - start > self.timeout_s:
                print(f"rltk producer {self.name}: error: waited {self.timeout_s:g} s (buffer.queue_timeout_s) for "
                      f"{what}", file=sys.stderr, flush=True)
                raise SystemExit(EXIT_TIMEOUT)
            time.sleep(self.poll_s)
        return True

    def may_sample(self) -> bool:
        """Whether a batch sampled now would be within the staleness bound when the trainer takes it."""
        self.load_newest()
        # one snapshot: a take between two separate reads made the gate underestimate the step the batch
        # trains at, so it sampled a batch one version too stale, which the queue then dropped
        taken, ready = self.queue.progress()
        return gate_open(taken, ready, self.per_batch, self.follower.version, self.max_staleness)

    def produce_batch(self) -> None:
        """Wait for the gate, sample one batch, put it with its versions and counters."""
        from rltk.distributed import seed_everything
        from rltk.training.rollouts.collect import collect_experiences

        cfg, follower = self.cfg, self.follower
        tick = time.perf_counter()
        self.load_newest()
        self.wait(f"the trainer to take experiences or publish weights newer than version {follower.version} (a "
                  f"batch sampled now would be more than trainer.max_staleness={self.max_staleness} versions old)",
                  self.may_sample)
        version = follower.version
        sampling = time.perf_counter()
        # the same batch is sampled the same way by a restarted producer with the same weights
        seed_everything(cfg.seed + 1_000_003 * (self.stage_index + 1) + 7_919 * self.index + self.batch
                        + self.seed_salt)
        with follower.during_generation(poll_s=max(self.poll_s, 0.05)):  # vllm_server: newer weights interrupt it
            experiences, _ = collect_experiences(self.workflow, self.sampler, self.plan)
        sampled = time.perf_counter()
        # the reward functions' calls, failures and timeouts while making this batch, and where the
        # producer's time went: the trainer logs them with the step that takes the batch
        reward = self.workflow.reward
        counters = {f"reward_fn/{k}": v for k, v in reward.stats().items()}
        counters.update(follower.take_counters())
        reward.reset_stats()
        counters.update({"producer/weights_s": self.weights_s, "producer/sample_s": sampled - sampling,
                         "producer/gate_wait_s": sampling - tick - self.weights_s, "producer/put_s": self.put_s})
        self.weights_s = 0.0
        if experiences:
            ids = [f"{self.name}-b{self.batch}-{i}" for i in range(len(experiences))]
            self.queue.put(experiences, ids=ids, versions=experience_versions(experiences, version),
                           producer=self.name, counters=counters)
        self.put_s = time.perf_counter() - sampled
        self.batch += 1


def experience_versions(experiences: list, version: int) -> list[list[int]]:
    """Per experience, the policy version of each response token: the engine's record where the workflow
    kept it (``info["policy_versions"]``, moved out of the experience), else ``version``, the weights the
    batch started with, which is the oldest any of its tokens can have (a workflow that does not keep them
    under an engine that loads weights mid-batch is counted as old as possible: the bound still holds)."""
    from rltk.rollout.base import POLICY_VERSIONS

    out = []
    for exp in experiences:
        recorded = exp.info.pop(POLICY_VERSIONS, None)
        if recorded is None or len(recorded) != len(exp.response_ids):
            recorded = [version] * len(exp.response_ids)
        out.append([int(v) for v in recorded])
    return out


class WeightsFollower:
    """Keeps the producer's rollout engine on the newest weights the trainer published.

    The ``hf`` engine samples from the producer's own module, which reads the
    file between batches. An engine with :meth:`load_weights_file`
    (``vllm_server``) has its servers load the trainer's file itself (through a
    hard link: the trainer renames newer files over the path, and a link keeps
    the one whose version was read), and does so also *during* a batch
    (:meth:`during_generation`): the servers pause with ``mode=abort``, load,
    resume, and the engine continues the interrupted samples under the new
    weights, each token labelled with the version that sampled it.
    """

    def __init__(self, engine, policy, path):
        import threading

        self.engine, self.policy, self.path = engine, policy, str(path)
        self.servers = engine.loads_weight_files
        if self.servers:
            engine.track_versions = True  # each token labelled with the version that sampled it
        self.version = -1
        self.loads_during_generation = 0
        self._continued_before = engine.continued
        self._lock = threading.Lock()

    #: where the weights come from, for messages
    @property
    def source(self) -> str:
        return self.path

    def published_version(self) -> int | None:
        """The newest version the trainer published (None before the first)."""
        from rltk.training.rollouts.engine_weights import weights_file_version

        return weights_file_version(self.path)

    def follow(self, *, interrupt: bool = False) -> bool:
        """Load the published weights if they are newer than the engine's; True if it loaded."""
        with self._lock:
            newest = self.published_version()
            if newest is None or newest <= self.version:
                return False
            self.version = self._load(interrupt)
            return True

    def _load(self, interrupt: bool) -> int:
        """Load the published weights into the module or the servers; returns their version."""
        from rltk.training.rollouts.engine_weights import read_weights_file

        if not self.servers:
            return read_weights_file(self.policy, self.path)
        link = f"{self.path}.{os.getpid()}.load"
        if os.path.lexists(link):
            os.unlink(link)
        os.link(self.path, link)
        version = self._into_servers(link, interrupt)
        # Removed only once the servers have answered. A load cut short (the trainer stopping this producer:
        # SIGTERM unwinds through here) may still be running in a server, and a vLLM worker that finds its
        # file gone takes its whole engine down; the link is left for this pid's next load, or as a stale
        # hard link of a past version in the stage's folder.
        os.unlink(link)
        return version

    def _into_servers(self, path: str, interrupt: bool) -> int:
        """Have the servers load the weights file at ``path`` (which nobody replaces meanwhile); its version."""
        from rltk.training.rollouts.engine_weights import read_weights_file, weights_file_version

        version = weights_file_version(path)
        if not self.engine.load_weights_file(path, version, interrupt=interrupt):
            # names the servers cannot load as they are (a LoRA policy): merged through the module
            read_weights_file(self.policy, path)
            self.engine.update_weights(self.policy, version=version, interrupt=interrupt)
        return version

    def during_generation(self, poll_s: float):
        """A context in which a thread loads newer weights as soon as they are published, interrupting the
        generation in flight (engines with servers only; a no-op for the others)."""
        import contextlib
        import threading

        if not self.servers:
            return contextlib.nullcontext()
        follower = self

        class _Watch:
            def __enter__(self):
                self.stop, self.error = threading.Event(), None
                self.thread = threading.Thread(target=self.run, name="rltk-weights-follower", daemon=True)
                self.thread.start()

            def run(self):
                try:
                    while not self.stop.wait(poll_s):
                        if follower.follow(interrupt=True):
                            follower.loads_during_generation += 1
                except BaseException as exc:  # raised in the producer's main thread, below
                    self.error = exc

            def __exit__(self, *exc_info):
                self.stop.set()
                # a load under way is 5 HTTP calls per server (pause, start, update, finish, resume), each
                # bounded by the engine's timeout_s
                limit = 8 * float(follower.engine.timeout_s)
                self.thread.join(limit)
                if self.thread.is_alive() and exc_info[0] is None:
                    raise TimeoutError(f"waited {limit:g} s for the weights follower to finish loading a version "
                                       f"newer than {follower.version} from {follower.path} into the rollout "
                                       f"servers (rollout.engine_args.timeout_s each call)")
                if self.error is not None and exc_info[0] is None:
                    raise self.error

        return _Watch()

    def take_counters(self) -> dict[str, float]:
        """``async/weight_loads_mid_batch`` and ``async/continued_samples`` since the last call."""
        continued = self.engine.continued
        out = {"async/weight_loads_mid_batch": float(self.loads_during_generation),
               "async/continued_samples": float(continued - self._continued_before)} if self.servers else {}
        self.loads_during_generation, self._continued_before = 0, continued
        return out


def main(argv: list[str] | None = None) -> int:
    from omegaconf import OmegaConf

    parser = argparse.ArgumentParser(prog="python -m rltk.training.rollouts.asynchronous.producer",
                                     description="A rollout producer of an asynchronous rltk run")
    parser.add_argument("--config", required=True, help="the stage's resolved config (YAML)")
    parser.add_argument("--stage", type=int, required=True, help="the stage's index (seeds its prompt order)")
    parser.add_argument("--queue", required=True, help="the experience queue's SQLite file")
    parser.add_argument("--weights", required=True, help="the weights file the trainer publishes")
    parser.add_argument("--name", required=True, help="this producer's name (a prefix of its experience ids)")
    parser.add_argument("--timeout", type=float, required=True, help="seconds any wait may last")
    parser.add_argument("--index", type=int, default=0, help="this producer's index among --count (its rows)")
    parser.add_argument("--count", type=int, default=1, help="how many producers share the training rows")
    args = parser.parse_args(argv)
    cfg = OmegaConf.load(Path(args.config))
    return run_producer(cfg, stage_index=args.stage, queue_path=args.queue, weights_path=args.weights,
                        name=args.name, timeout_s=args.timeout, index=args.index, count=args.count)


if __name__ == "__main__":
    sys.exit(main())
