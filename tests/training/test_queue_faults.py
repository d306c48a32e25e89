"""Fault tests of the experience queue: producer and trainer processes SIGKILLed at random (seeded) points while
they run against the real SQLite file, restarted, and the experience ids trained compared with a clean run's.

The trainer here is the loop's protocol without a model: take a lease for step ``s`` (policy version
``s - 1``), "train" (append the ids to its state), every ``ckpt_every`` steps save the state atomically
(the checkpoint) and then commit the queue; on start, load the checkpoint and ``recover`` its step. What
it has trained is what its last checkpoint holds. Processes are forked (real processes, real SIGKILL;
forking spares each restart torch's import).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest

from rltk.batch import Experience
from rltk.training.rollouts.asynchronous.queue import ExperienceQueue, QueueTimeout

from tests.waits import scaled

GROUP_SIZE = 2
PRODUCERS = ("p0", "p1")
GROUPS = 24  # per producer
TOTAL = len(PRODUCERS) * GROUPS * GROUP_SIZE


def producer_main(path: str, name: str, seed: int, pause=(0.002, 0.012)) -> None:
    rng = random.Random(f"{seed}-{name}-{os.getpid()}")
    with ExperienceQueue(path) as q:
        # a restarted producer starts over: ids already stored are skipped
        for g in range(GROUPS):
            exps = [Experience(prompt_ids=[g], response_ids=[1, 2, 3], score=float(i), group_id=g)
                    for i in range(GROUP_SIZE)]
            q.put(exps, ids=[f"{name}-{g}-{i}" for i in range(GROUP_SIZE)], versions=q.policy_version,
                  producer=name)
            time.sleep(rng.uniform(*pause))  # the generation


def _save_atomically(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _crash_here(workdir: Path, step: int, phase: str, crash_points: set) -> None:
    """SIGKILL this process at (step, phase) the first time it gets there."""
    marker = workdir / f"crashed-{step}-{phase}"
    if (step, phase) in crash_points and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)


def trainer_main(path: str, workdir: str, seed: int, batch: int, ckpt_every: int, max_staleness, crash_points) -> None:
    workdir = Path(workdir)
    state_path = workdir / "checkpoint.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {"step": 0, "trained": []}
    rng = random.Random(f"{seed}-trainer-{os.getpid()}")
    q = ExperienceQueue(path, max_staleness=max_staleness, stale_policy="drop", timeout_s=0.2)
    settled = q.recover(state["step"])
    with open(workdir / "recoveries.jsonl", "a") as log:
        log.write(json.dumps({"resumed_step": state["step"], **settled}) + "\n")
    step, trained = state["step"], list(state["trained"])
    # the resumed weights go to the producers first: a crash may have come before the last sync, and
    # producers still sampling with older weights would produce nothing but stale data
    q.publish_version(step)

    def checkpoint(step, trained):
        _save_atomically(state_path, {"step": step, "trained": trained})
        _crash_here(workdir, step, "after_checkpoint", crash_points)  # before the queue's commit
        time.sleep(rng.uniform(0.0, 0.004))
        q.commit(step)
        _crash_here(workdir, step, "after_commit", crash_points)

    deadline = time.monotonic() + scaled(60)
    while len(trained) + q.counts()["dropped"] < TOTAL:
        try:
            lease = q.take(batch, step=step + 1, version=step)
        except QueueTimeout:
            assert time.monotonic() < deadline, "the producers never delivered"
            continue
        step += 1
        _crash_here(workdir, step, "after_take", crash_points)
        trained.extend(lease.ids)  # the update
        time.sleep(rng.uniform(0.001, 0.006))
        if step % ckpt_every == 0:
            checkpoint(step, trained)
        q.publish_version(step)  # the weight sync: producers sample with the new version from now on
    if step > q.committed_step:  # the end of training always saves
        checkpoint(step, trained)
    q.close()


def run(tmp_path: Path, seed: int, *, kills: int, batch=4, ckpt_every=3, max_staleness=None, crash_points=(),
        producer_pause=(0.002, 0.012)):
    """Run two producers and a trainer to the end, SIGKILLing ``kills`` random live ones at random times
    (and the trainer at ``crash_points``), restarting each; returns (trained ids, queue counts, recoveries)."""
    path = str(tmp_path / "queue.sqlite")
    ExperienceQueue(path).close()  # created before forking: no connection crosses a fork
    context = multiprocessing.get_context("fork")

    def start(name):
        if name == "trainer":
            args = (path, str(tmp_path), seed, batch, ckpt_every, max_staleness, set(crash_points))
            process = context.Process(target=trainer_main, args=args, daemon=True)
        else:
            process = context.Process(target=producer_main, args=(path, name, seed, producer_pause), daemon=True)
        process.start()
        return process

    procs = {name: start(name) for name in (*PRODUCERS, "trainer")}
    rng = random.Random(seed)
    for _ in range(kills):
        time.sleep(rng.uniform(0.02, 0.12))
        if procs["trainer"].exitcode == -signal.SIGKILL:
            procs["trainer"] = start("trainer")
        live = sorted(name for name, p in procs.items() if p.is_alive())
        if not live:
            break
        victim = rng.choice(live)
        os.kill(procs[victim].pid, signal.SIGKILL)
        procs[victim].join(scaled(10))
        procs[victim] = start(victim)
    deadline = time.monotonic() + scaled(90)
    while any(p.exitcode != 0 for p in procs.values()):
        assert time.monotonic() < deadline, \
            f"not finished within {scaled(90):.0f} s: {[n for n, p in procs.items() if p.is_alive()]}"
        trainer = procs["trainer"]
        if trainer.exitcode == -signal.SIGKILL:  # it died at one of its crash points: restart it at once
            procs["trainer"] = start("trainer")
        for name, process in procs.items():
            assert process.exitcode in (None, 0) or (name == "trainer" and process.exitcode == -signal.SIGKILL), (
                f"{name} exited with {process.exitcode}")
        time.sleep(0.01)
    trained = json.loads((tmp_path / "checkpoint.json").read_text())["trained"]
    with ExperienceQueue(path) as q:
        counts, dropped = q.counts(), q.ids("dropped")
    recoveries = [json.loads(line) for line in (tmp_path / "recoveries.jsonl").read_text().splitlines()]
    return trained, counts, dropped, recoveries


ALL_IDS = {f"{p}-{g}-{i}" for p in PRODUCERS for g in range(GROUPS) for i in range(GROUP_SIZE)}


def test_a_clean_run_trains_every_experience_once(tmp_path):
    trained, counts, dropped, recoveries = run(tmp_path, seed=0, kills=0)
    assert len(trained) == len(set(trained)) == TOTAL and set(trained) == ALL_IDS
    assert counts == {"ready": 0, "leased": 0, "consumed": TOTAL, "dropped": 0} and not dropped
    assert recoveries == [{"resumed_step": 0, "committed": 0, "returned": 0}]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_killed_producers_and_trainer_train_exactly_the_clean_runs_ids(tmp_path, seed):
    # the trainer also dies at three seeded points, one in each window of the checkpoint protocol
    # (checkpoints come every 3rd step of the 24)
    rng = random.Random(seed)
    at_checkpoint, at_commit = (3 * k for k in rng.sample(range(1, 8), 2))
    crash_points = [(rng.randrange(1, 24), "after_take"), (at_checkpoint, "after_checkpoint"),
                    (at_commit, "after_commit")]
    trained, counts, dropped, recoveries = run(tmp_path, seed, kills=5, crash_points=crash_points)
    assert len(trained) == len(set(trained)), "an experience was trained twice"
    assert set(trained) == ALL_IDS, f"lost: {sorted(ALL_IDS - set(trained))[:5]}"
    assert counts == {"ready": 0, "leased": 0, "consumed": TOTAL, "dropped": 0}
    assert len(recoveries) >= 1 + len(crash_points)  # the trainer restarted at least at each crash point
    # dead after its checkpoint, before the queue's commit: the restart committed that checkpoint's leases
    assert {"resumed_step": at_checkpoint, "committed": 3 * 4, "returned": 0} in recoveries
    # dead holding an uncheckpointed lease: the restart returned it to the queue
    assert any(r["returned"] >= 4 for r in recoveries)


def test_with_a_staleness_bound_every_experience_is_trained_or_dropped_exactly_once(tmp_path):
    # max_staleness 0 and one group per step: whatever a producer sampled before the trainer's last
    # update is dropped; the others are trained; nothing is both, nothing is neither
    trained, counts, dropped, _ = run(tmp_path, seed=4, kills=4, batch=2, ckpt_every=2, max_staleness=0,
                                      crash_points=[(4, "after_checkpoint")], producer_pause=(0.01, 0.03))
    assert len(trained) == len(set(trained))
    assert not set(trained) & set(dropped)
    assert set(trained) | set(dropped) == ALL_IDS
    assert counts["consumed"] == len(trained) and counts["dropped"] == len(dropped) and counts["ready"] == 0
