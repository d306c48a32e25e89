"""A rollout producer process of an asynchronous run: sample, score, put into the experience queue, repeat.

The trainer (:mod:`rltk.training.async_rollout`) starts it beside itself::

    python -m rltk.training.producer --config STAGE.yaml --stage I --queue Q.sqlite \\
        --weights policy.safetensors --name producer-0 [--index 0 --count 1]

With ``trainer.producers`` = N, producer ``k`` samples only the rows ``k, k + N, ...``
(:func:`producer_rows`) and seeds its batches apart from the others'.

It builds the stage's tokenizer, policy, rows and workflow exactly as the
trainer does (:func:`rltk.training.setup.build_workflow`; any workflow:
single-turn, multi-turn, agentic), loads the trainer's weights from the file
the trainer renames into place (:func:`rltk.training.engine_weights.write_weights_file`),
and loops:

1. load the newest published weights (their version ``v``);
2. wait until a batch sampled now would not be too stale: it is trained at
   step ``L + r + 1`` (``L`` the last step the trainer took, ``r`` the batches
   ready in the queue before it), under trainer version ``L + r``, so it waits
   while ``L + r - v > max_staleness`` (AReaL's ``max_head_offpolicyness``
   gate, counted in steps). ``one_step_off`` is ``max_staleness = 1``: the
   batch for step ``t + 1`` is sampled by policy ``t - 1`` while step ``t``
   trains;
3. draw the next prompts, run the workflow (:func:`rltk.training.collect.collect_experiences`,
   so greedy baselines and dynamic sampling work as in the synchronous loop),
   and put the batch, each experience with its id and version ``v``, in one
   transaction.

Ids are ``<name>-b<batch>-<index>``; a restarted producer reads its last
put id from the queue and goes on with the next batch (its prompt sampler
skipped to that batch; sampling seeded per batch), so nothing is put twice.

Every wait has ``--timeout`` seconds (``buffer.queue_timeout_s``) and then
exits with an error naming what it waited for. It also exits when the
process that started it is gone (the trainer died), so no producer outlives
its run, and (status 0) when the trainer records in the queue that its stage
has ended. A producer the trainer did not start (``rltk produce``,
:mod:`rltk.produce_command`) skips the parent check (``trainer=False``).
"""

from __future__ import annotations

import argparse
import os
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


def producer_rows(rows: list, index: int, count: int) -> list:
    """Producer ``index`` of ``count``'s share of the training rows: rows ``index, index + count, ...``
    (all of them for a lone producer), so two producers never sample the same prompt in one epoch."""
    return rows[index::count]


def run_producer(cfg, *, stage_index: int, queue_path: str, weights_path: str, name: str, timeout_s: float,
                 index: int = 0, count: int = 1, poll_s: float = 0.005, trainer: bool = True,
                 seed_salt: int = 0) -> int:
    """Produce batches until the trainer ends the stage (returns :data:`EXIT_DONE`) or a wait runs out.

    ``trainer``: this process was started by the trainer (it stops when that parent is gone).
    ``seed_salt`` is added to the prompt order's and the sampling's seeds, so producers outside the
    trainer that share the rows (one ``index``) still sample apart.
    """
    import rltk
    from rltk.buffer.queue import ExperienceQueue
    from rltk.data.sampler import RowSampler
    from rltk.distributed import limit_torch_threads, seed_everything
    from rltk.training.collect import RolloutPlan, collect_experiences
    from rltk.training.engine_weights import read_weights_file, weights_file_version
    from rltk.training.rows import build_rows
    from rltk.training.setup import build_tokenizer_and_policy, build_workflow

    parent = _Parent() if trainer else None
    limit_torch_threads()
    seed_everything(cfg.seed)
    tokenizer, policy = build_tokenizer_and_policy(cfg)
    train_rows = producer_rows(build_rows(cfg, tokenizer)[0], index, count)
    workflow = build_workflow(cfg, policy, tokenizer)
    plan = RolloutPlan.from_config(cfg, rltk.get_component("advantage_fn", cfg.algorithm.advantage_fn))
    t = cfg.trainer
    max_staleness = 1 if t.mode == "one_step_off" else int(t.max_staleness)
    per_batch = batch_size(cfg)
    queue = ExperienceQueue(queue_path, timeout_s=timeout_s, journal_mode=cfg.buffer.get("queue_journal", "wal"))
    sampler = RowSampler(train_rows, t.prompts_per_step, seed=cfg.seed + stage_index + seed_salt,
                         shuffle=cfg.data.shuffle)
    last = queue.last_id(name)
    batch = 0 if last is None else batch_of(last) + 1
    for _ in range(batch):  # the prompts of the batches already put
        sampler.next_batch()
    version = -1
    weights_s = 0.0  # loading published weights since the last put (producer/weights_s)
    put_s = 0.0  # the last put's own time (producer/put_s of the next batch: a put cannot carry its own)

    def load_newest() -> None:
        nonlocal version, weights_s
        newest = weights_file_version(weights_path)
        if newest is not None and newest > version:
            tick = time.perf_counter()
            version = read_weights_file(policy, weights_path)
            weights_s += time.perf_counter() - tick

    next_end_check = [0.0]  # when wait() next asks the queue whether the trainer ended the stage

    def wait(what: str, done) -> bool:
        start = time.monotonic()
        while not done():
            if time.monotonic() >= next_end_check[0]:  # every half second, not at every 5 ms poll
                next_end_check[0] = time.monotonic() + 0.5
                if queue.finished_step is not None:
                    print(f"rltk producer {name}: the trainer ended the stage at step {queue.finished_step}; "
                          f"stopping", flush=True)
                    raise SystemExit(EXIT_DONE)
            if parent is not None and not parent.alive():
                print(f"rltk producer {name}: the trainer (pid {parent.pid}) is gone; stopping", flush=True)
                raise SystemExit(EXIT_ORPHANED)
            if time.monotonic() - start > timeout_s:
                print(f"rltk producer {name}: error: waited {timeout_s:g} s (buffer.queue_timeout_s) for {what}",
                      file=sys.stderr, flush=True)
                raise SystemExit(EXIT_TIMEOUT)
            time.sleep(poll_s)
        return True

    wait(f"the trainer's first weights in {weights_path}", lambda: weights_file_version(weights_path) is not None)
    print(f"rltk producer {name}: pid {os.getpid()}, starting at batch {batch}", flush=True)
    while True:
        tick = time.perf_counter()
        load_newest()

        def may_sample() -> bool:
            load_newest()
            # one snapshot: a take between two separate reads made the gate underestimate the step the batch
            # trains at, so it sampled a batch one version too stale, which the queue then dropped
            taken, ready = queue.progress()
            return gate_open(taken, ready, per_batch, version, max_staleness)

        wait(f"the trainer to take experiences or publish weights newer than version {version} (a batch "
             f"sampled now would be more than trainer.max_staleness={max_staleness} versions old)", may_sample)
        sampling = time.perf_counter()
        # the same batch is sampled the same way by a restarted producer with the same weights
        seed_everything(cfg.seed + 1_000_003 * (stage_index + 1) + 7_919 * index + batch + seed_salt)
        experiences, _ = collect_experiences(workflow, sampler, plan)
        sampled = time.perf_counter()
        # the reward functions' calls, failures and timeouts while making this batch, and where the
        # producer's time went: the trainer logs them with the step that takes the batch
        counters = {f"reward_fn/{k}": v for k, v in workflow.reward.stats().items()}
        workflow.reward.reset_stats()
        counters.update({"producer/weights_s": weights_s, "producer/sample_s": sampled - sampling,
                         "producer/gate_wait_s": sampling - tick - weights_s, "producer/put_s": put_s})
        weights_s = 0.0
        if experiences:
            ids = [f"{name}-b{batch}-{i}" for i in range(len(experiences))]
            queue.put(experiences, ids=ids, versions=version, producer=name, counters=counters)
        put_s = time.perf_counter() - sampled
        batch += 1


def main(argv: list[str] | None = None) -> int:
    from omegaconf import OmegaConf

    parser = argparse.ArgumentParser(prog="python -m rltk.training.producer",
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
