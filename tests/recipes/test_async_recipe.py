"""`rltk run grpo` with trainer.mode=async / one_step_off: a producer process beside the trainer (slow; run in CI).

The fault tests compare which experience (by id) each training step trained on, read from the run's
experience queue, against an uninterrupted run: a trainer that dies and resumes, or a producer killed
mid-run and restarted, must train every step on the same experiences, each exactly once.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

import rltk
from rltk.commands.cli import main
from rltk.rewards import bounded
from rltk.training.rollouts.asynchronous.producer import producer_rows
from tests.crash import crash_at_step
from tests.isolated import run_isolated
from tests.waits import scaled

pytestmark = pytest.mark.slow

SFT_STEPS, RL_STEPS = 20, 8
TINY = [f"sft.steps={SFT_STEPS}", "sft.stop_at_accuracy=null", "sft.warmup_steps=2", "data.task_args.max_digits=1",
        "data.train_size=70", "data.eval_size=20", f"trainer.total_steps={RL_STEPS}", "trainer.warmup_steps=2",
        "trainer.prompts_per_step=4", "rollout.n=4", "trainer.eval_every=4", "logging.logger=[jsonl]",
        "logging.plot=false", "checkpoint.every=2", f"buffer.queue_timeout_s={scaled(300):.0f}",
        f"stages=[{{name: warmup, type: sft, overrides: {{checkpoint.every: {SFT_STEPS}}}}}, {{name: rl, type: rl}}]"]
ASYNC = [*TINY, "trainer.mode=async", "trainer.max_staleness=1"]
QUEUE = Path("async") / "stage_1" / "experience_queue.sqlite"
LOG = Path("async") / "stage_1" / "producer-0.log"


def trained(run_dir: Path) -> dict[str, int]:
    """Experience id -> the training step whose (committed) lease trained it."""
    with sqlite3.connect(run_dir / QUEUE) as db:
        rows = db.execute("SELECT e.id, l.step FROM experiences e JOIN leases l ON e.lease = l.id "
                          "WHERE e.status = 'consumed' AND l.state = 'committed'").fetchall()
    return dict(rows)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("straight")
    assert main(["run", "grpo", f"output_dir={run_dir}", *ASYNC]) == 0
    return run_dir


def one_batch_a_step_within_the_bound(run_dir: Path) -> list[dict]:
    """Assert that RL step s trained the producer's batch s - 1, whole (4 prompts x 4 samples), each experience
    once, within staleness 1 and nothing dropped; the RL steps' metrics rows."""
    ids = trained(run_dir)
    assert sorted(ids.items()) == sorted((f"producer-0-b{s - 1}-{i}", s) for s in range(1, RL_STEPS + 1)
                                         for i in range(16))
    rows = [m for m in metrics(run_dir) if "staleness/max" in m]
    assert [m["step"] for m in rows] == list(range(SFT_STEPS + 1, SFT_STEPS + RL_STEPS + 1))
    assert all(m["staleness/max"] <= 1 and m["staleness/dropped"] == 0 for m in rows)
    return rows


def test_each_step_trains_one_batch_within_the_staleness_bound(straight):
    rows = one_batch_a_step_within_the_bound(straight)
    assert rows[0]["staleness/max"] == 0  # the first batch is the starting weights'
    assert "rollout/reward" in rows[0] and "reward" in rows[0]
    # the producer's reward calls reach the trainer's log: one counter row per batch put (its 16 samples),
    # each handed to the trainer once, on top of the trainer's own evaluations' calls
    with sqlite3.connect(straight / QUEUE) as db:
        put = db.execute("SELECT COUNT(*) FROM experiences").fetchone()[0]
        counters = [(json.loads(c), reported) for c, reported in db.execute(
            "SELECT counters, reported FROM producer_counters ORDER BY seq")]
    assert [c["reward_fn/calls"] for c, _ in counters] == [16.0] * (put // 16)
    reported = sum(c["reward_fn/calls"] for c, r in counters if r)
    assert 16 * RL_STEPS <= reported <= sum(m["reward_fn/calls"] for m in rows)
    # where each batch's producer time went, logged with the step that took it: every batch was sampled
    # (sample_s > 0), the first one after loading the starting weights; the rest are waits and puts
    assert all(c["producer/sample_s"] > 0 and min(c["producer/weights_s"], c["producer/gate_wait_s"],
                                                  c["producer/put_s"]) >= 0 for c, _ in counters)
    assert counters[0][0]["producer/weights_s"] > 0 and counters[0][0]["producer/put_s"] == 0
    # a take logs what was put since the previous take (one batch, or two, or none), each put once
    assert sum(m.get("producer/sample_s", 0.0) for m in rows) == pytest.approx(
        sum(c["producer/sample_s"] for c, r in counters if r))


def test_traces_count_staleness_from_the_version_the_queue_recorded(straight):
    from rltk.training.scaffold.traces import TRACES_FILE, read_traces

    # (training step, row, sample) -> the policy version of the sample's oldest token, as the queue stored it
    with sqlite3.connect(straight / QUEUE) as db:
        stored = [(step, json.loads(payload)["info"], low) for step, low, payload in db.execute(
            "SELECT l.step, e.min_version, e.payload FROM experiences e JOIN leases l ON e.lease = l.id "
            "WHERE e.status = 'consumed' AND l.state = 'committed'")]
    sampled = {(step, info["row_id"], info["sample_index"]): low for step, info, low in stored}
    assert len(sampled) == len(stored) == 16 * RL_STEPS
    traces = read_traces(straight / TRACES_FILE)
    assert len(traces) == 16 * RL_STEPS  # logging.traces_per_step=16: every sample of every step
    for r in traces:  # trainer version (step - 1) minus the sampler's
        assert r["staleness"] == r["stage_step"] - 1 - sampled[(r["stage_step"], r["row_id"], r["sample_index"])]
    for m in metrics(straight):
        if "staleness/mean" in m:
            lags = [r["staleness"] for r in traces if r["step"] == m["step"]]
            assert sum(lags) / len(lags) == pytest.approx(m["staleness/mean"])


def test_a_trainer_killed_mid_stage_resumes_training_the_same_experiences_once(tmp_path, straight):
    rl_step = random.Random("async-trainer-crash").randint(3, RL_STEPS)
    crashing = tmp_path / "crashing"
    with crash_at_step(SFT_STEPS + rl_step):
        main(["run", "grpo", f"output_dir={crashing}", *ASYNC])
    assert main(["run", "grpo", f"output_dir={crashing}", *ASYNC]) == 0
    assert trained(crashing) == trained(straight), f"crash at RL step {rl_step}"
    rows = [m["step"] for m in metrics(crashing) if "staleness/max" in m]
    assert rows == list(range(SFT_STEPS + 1, SFT_STEPS + RL_STEPS + 1))  # nothing logged twice


def test_a_queue_lost_after_a_crash_stops_the_resume_and_a_fresh_queue_trains_nothing_twice(tmp_path, capsys):
    # the trainer dies at RL step 5, after the checkpoint of step 4; then its queue is emptied, cut in half
    # or deleted before the resume (an outside harness found the emptied one retrained steps 1-4 silently)
    crashed = tmp_path / "crashed"
    with crash_at_step(SFT_STEPS + 5):
        main(["run", "grpo", f"output_dir={crashed}", *ASYNC])
    checkpointed = trained(crashed)
    assert sorted(set(checkpointed.values())) == [1, 2, 3, 4]
    capsys.readouterr()
    for how in ("empty", "halved", "deleted"):
        run_dir = tmp_path / how
        shutil.copytree(crashed, run_dir)
        queue = run_dir / QUEUE
        if how == "deleted":
            queue.unlink()
        else:
            queue.write_bytes(queue.read_bytes()[: queue.stat().st_size // 2] if how == "halved" else b"")
        assert main(["run", "grpo", f"output_dir={run_dir}", *ASYNC]) == 2, how
        err = capsys.readouterr().err
        assert f"rltk: error: experience queue {queue} " in err and "Traceback" not in err, err[-3000:]
        start = run_dir / "checkpoints" / f"step_{SFT_STEPS:06d}"
        assert (f"Either start the stage over (checkpoint.resume={start}, the end of the stage before it), or resume "
                f"from this checkpoint without the queue's leftovers with buffer.queue_resume=fresh") in err
        assert (run_dir / LOG).read_text() == (crashed / LOG).read_text()  # refused before any producer started
    # resumed on request: the producer goes on after the checkpoint's last batch (3), step s trains batch s - 1
    run_dir = tmp_path / "empty"
    assert main(["run", "grpo", f"output_dir={run_dir}", *ASYNC, "buffer.queue_resume=fresh"]) == 0
    resumed = trained(run_dir)
    assert not set(resumed) & set(checkpointed), "an experience the checkpoint trained was trained again"
    assert sorted(resumed.items()) == sorted((f"producer-0-b{s - 1}-{i}", s) for s in range(5, RL_STEPS + 1)
                                             for i in range(16))
    rows = [m["step"] for m in metrics(run_dir) if "staleness/max" in m]
    assert rows == list(range(SFT_STEPS + 1, SFT_STEPS + RL_STEPS + 1))  # nothing logged twice


def test_a_producer_killed_mid_run_is_restarted_and_nothing_is_lost_or_repeated(tmp_path, straight):
    run_dir = tmp_path / "killed"
    kill_at = SFT_STEPS + random.Random("async-producer-kill").randint(2, RL_STEPS - 2)
    killed = []

    @rltk.hookimpl
    def rltk_on_step_end(step: int) -> None:
        if step == kill_at:
            pid = int(re.findall(r"pid (\d+), starting", (run_dir / LOG).read_text())[-1])
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    plugin = types.ModuleType("producer_killer")
    plugin.rltk_on_step_end = rltk_on_step_end
    rltk.register_plugin(plugin, name="producer_killer")
    try:
        assert main(["run", "grpo", f"output_dir={run_dir}", *ASYNC]) == 0
    finally:
        rltk.unregister_plugin("producer_killer")
    assert len(killed) == 1
    log = (run_dir / LOG).read_text()
    assert log.count("--- start") == 2, log  # started again once, going on from the batch after its last put
    assert trained(run_dir) == trained(straight)


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in /proc (``Z``: a zombie, dead but not reaped), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def test_two_producers_share_the_work_and_one_that_keeps_dying_is_reported_while_training_goes_on(tmp_path,
                                                                                                   capsys):
    run_dir = tmp_path / "two"
    log = run_dir / "async" / "stage_1" / "producer-1.log"
    total = 12
    killed: list[int] = []  # the RL steps after which producer-1's first and second start were killed

    def has_fed_the_trainer(producer: str) -> bool:  # a put batch may still be dropped as too stale
        with sqlite3.connect(run_dir / QUEUE) as db:
            return db.execute("SELECT COUNT(*) FROM experiences WHERE producer = ? AND status IN "
                              "('leased', 'consumed')", (producer,)).fetchone()[0] > 0

    @rltk.hookimpl
    def rltk_on_step_end(step: int) -> None:
        rl_step = step - SFT_STEPS
        if rl_step < 3 or len(killed) == 2 or (killed and rl_step < killed[-1] + 2):
            return
        if not killed:
            # the first start is killed once it has fed the trainer. On a loaded machine building its model can
            # take past the run's last step, so wait here for it to have started (that depends on nothing the
            # trainer does); waiting for its first batch could stall it behind producer-0's (the staleness
            # bound): that is tried again at the next step
            deadline = time.monotonic() + scaled(600)
            while not (pids := re.findall(r"pid (\d+), starting", log.read_text()) if log.exists() else []):
                assert time.monotonic() < deadline, f"producer-1 did not start within {scaled(600):.0f} s"
                time.sleep(0.2)
            if not has_fed_the_trainer("producer-1"):
                return
        else:
            deadline = time.monotonic() + scaled(600)  # the restarted producer prints its pid once its model is built
            while len(pids := re.findall(r"pid (\d+), starting", log.read_text())) < 2:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        pid = int(pids[len(killed)])
        os.kill(pid, signal.SIGKILL)
        killed.append(rl_step)
        # Return once it is dead (a zombie the trainer has yet to reap): a process of torch and its threads
        # takes a while to go, and a step here takes ~20 ms, so the trainer's next takes could still see it
        # alive and never restart it before this hook waits for the restart below.
        deadline = time.monotonic() + scaled(60)
        while time.monotonic() < deadline and process_state(pid) not in ("Z", "X", None):
            time.sleep(0.01)

    plugin = types.ModuleType("second_producer_killer")
    plugin.rltk_on_step_end = rltk_on_step_end
    rltk.register_plugin(plugin, name="second_producer_killer")
    try:
        assert main(["run", "grpo", f"output_dir={run_dir}", *ASYNC, "trainer.producers=2",
                     f"trainer.total_steps={total}"]) == 0
    finally:
        rltk.unregister_plugin("second_producer_killer")
    assert len(killed) == 2, killed
    err = capsys.readouterr().err
    assert re.search(r"rollout producer 'producer-1' \(pid \d+\) exited with status -9 after 2 starts; its log "
                     r"is .*producer-1\.log", err), err[-3000:]
    assert "training goes on with 1 producer(s): producer-0" in err
    ids = trained(run_dir)
    by_step = {s: sorted(i for i, t in ids.items() if t == s) for s in set(ids.values())}
    assert sorted(by_step) == list(range(1, total + 1))
    assert all(len(batch) == 16 for batch in by_step.values())  # one whole batch a step, each id once
    assert {i.rsplit("-b", 1)[0] for i in ids} == {"producer-0", "producer-1"}
    # killed after step k, producer-1 sampled with version k at the newest: its batches train by step k + 2
    assert all({i.rsplit("-b", 1)[0] for i in by_step[s]} == {"producer-0"} for s in range(killed[1] + 3, total + 1))
    rows = [m for m in metrics(run_dir) if "staleness/max" in m]
    assert all(m["staleness/max"] <= 1 for m in rows)
    alive = [m["producers/alive"] for m in rows]
    assert alive[0] == 2 and alive[-1] == 1 and alive == sorted(alive, reverse=True)


def test_producers_share_the_rows_without_overlap():
    rows = list(range(10))
    shares = [producer_rows(rows, k, 3) for k in range(3)]
    assert shares == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert producer_rows(rows, 0, 1) == rows


@bounded
def trainer_only(*, response: str) -> float:
    return 0.0


def test_a_producer_that_keeps_dying_stops_the_run_naming_it_and_its_log(tmp_path, capsys):
    # a reward that only the trainer process registers: the producer cannot build its workflow, twice
    plugin = types.ModuleType("trainer_only_reward")
    plugin.rltk_reward_fns = rltk.hookimpl(lambda: {"trainer_only": trainer_only})
    rltk.register_plugin(plugin, name="trainer_only_reward")
    try:
        code = main(["run", "grpo", f"output_dir={tmp_path / 'run'}", *ASYNC, "reward.reward_fn=[trainer_only]"])
    finally:
        rltk.unregister_plugin("trainer_only_reward")
    err = capsys.readouterr().err
    assert code == 1
    assert re.search(r"rollout producer 'producer-0' \(pid \d+\) exited with status 1 after 2 starts; its log is "
                     r".*producer-0\.log, which ends:", err), err[-3000:]
    assert "trainer_only" in err and "Traceback" not in err.split("rollout producer")[-1]


# The embedded tiny model on one-digit addition after a 150-step warm-up (test_grpo_recipe's FAST settings),
# then 60 GRPO steps in trainer.mode=async with trainer.max_staleness=1. Measured on this 2-core machine
# (2026-11-27, under load, one run per seed; docs/tutorials/async.md): the training reward (mean of
# the last 10 steps minus the first 10) rose by RISES on every seed; the test asks for half the smallest.
# Held-out greedy accuracy on the 24 test problems moved by -0.125, +0.125 and +0.333 (seeds 0, 1, 2): too
# noisy at this size to assert a gain, so it is not asserted. Which policy version sampled a batch depends
# on timing (staleness 0 or 1), so a rerun of a seed is not bit for bit the same run: hence the margin.
LEARN = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.intermediate_size=256",
         "data.task_args.max_digits=1", "data.train_size=70", "data.eval_size=24", "sft.steps=150",
         "sft.stop_at_accuracy=null", "sft.batch_size=32", "sft.warmup_steps=10", "trainer.prompts_per_step=16",
         "logging.logger=[jsonl]", "logging.plot=false", "trainer.total_steps=60", "trainer.eval_every=20"]
RISES = {0: 0.043, 1: 0.112, 2: 0.272}


def test_grpo_async_with_staleness_1_learns(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", *LEARN, "trainer.mode=async",
                 "trainer.max_staleness=1"]) == 0
    rows = metrics(run_dir)
    evals = [m["eval/accuracy"] for m in rows if "eval/accuracy" in m]
    assert len(evals) == 4  # at the RL stage's start (the warm-up's end), then every 20 steps
    rewards = [m["reward"] for m in rows if "reward" in m]
    assert len(rewards) == 60
    staleness = [m["staleness/max"] for m in rows if "staleness/max" in m]
    assert max(staleness) == 1 and all(s <= 1 for s in staleness)
    rise = sum(rewards[-10:]) / 10 - sum(rewards[:10]) / 10
    assert rise >= min(RISES.values()) / 2, f"training reward: {rewards}"


# The shipped default (its accuracy-stopped warm-up, then 200 GRPO steps) in trainer.mode=async with
# trainer.max_staleness=1, measured by `benchmarks/learning.py --recipes grpo --seeds 0 1 2 --jobs 2
# trainer.mode=async trainer.max_staleness=1` over seeds 0-2 x default/avx2/avx512 (2026-11-27,
# docs/tutorials/async.md): held-out greedy accuracy gained +0.090 to +0.305 and the training reward (last 25
# steps vs first 25) rose +0.052 to +0.113 in all 9 runs. The test asks for half the smallest of each.
ASYNC_DEFAULT_MIN_GAIN, ASYNC_DEFAULT_MIN_RISE = 0.090, 0.052


def test_grpo_async_learns_on_the_embedded_default(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", "trainer.mode=async", "trainer.max_staleness=1",
                 "logging.logger=[jsonl]", "logging.plot=false"]) == 0
    rows = metrics(run_dir)
    rewards = [m["reward"] for m in rows if "reward" in m]
    assert len(rewards) == 200
    first, last = sum(rewards[:25]) / 25, sum(rewards[-25:]) / 25
    assert last > first + ASYNC_DEFAULT_MIN_RISE / 2, f"training reward did not rise: {first:.3f} -> {last:.3f}"
    evals = [m["eval/accuracy"] for m in rows if "eval/accuracy" in m]
    assert len(evals) == 9  # start of the RL stage, then every 25 steps
    assert evals[-1] > evals[0] + ASYNC_DEFAULT_MIN_GAIN / 2, f"held-out accuracy did not rise: {evals}"
    assert all(m["staleness/max"] <= 1 for m in rows if "staleness/max" in m)


# ---------------------------------------------------------------- several trainer ranks

# Records, per rank, the ids of each step's share and a hash of the parameters after each update, then runs
# `rltk run`; with a step number it also crashes every rank after that step's metrics (before its checkpoint).
RANKS_DRIVER = """
import hashlib, json, os, sys, types
import torch
import rltk
import rltk.training.rollouts.asynchronous.async_rollout as ar
from rltk.commands.cli import main

out, crash_step = sys.argv[1], int(sys.argv[2])
rank = int(os.environ["RANK"])
take, after_update = ar.AsyncRollouts.take, ar.AsyncRollouts.after_update

def record(**row):
    with open(os.path.join(out, f"rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\\n")

def logged_take(self, step):
    lease = take(self, step)
    record(step=step, ids=lease.ids)
    return lease

def logged_update(self, step):
    after_update(self, step)
    state = self.strategy.full_state_dict()  # whole weights on every rank (FSDP2: gathered from the shards)
    flat = torch.cat([state[k].float().flatten() for k in sorted(state)])
    record(step=step, params=hashlib.sha256(flat.numpy().tobytes()).hexdigest())

ar.AsyncRollouts.take, ar.AsyncRollouts.after_update = logged_take, logged_update
crasher = types.ModuleType("crasher")

@rltk.hookimpl
def rltk_on_step_end(step):
    if step == crash_step:
        raise SystemExit(3)

crasher.rltk_on_step_end = rltk_on_step_end
rltk.register_plugin(crasher, name="crasher")
code = main(sys.argv[3:])
sys.stdout.flush(); sys.stderr.flush()
os._exit(code or 0)
"""


def torchrun_async(tmp_path: Path, run_dir: Path, *extra: str, crash_step: int = 0, expect: int = 0):
    driver = tmp_path / "ranks_driver.py"
    driver.write_text(RANKS_DRIVER)
    return run_isolated([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                         str(driver), str(tmp_path), str(crash_step), "run", "grpo", f"output_dir={run_dir}",
                         *ASYNC, *extra], expect=expect, timeout=scaled(900))


def rank_rows(tmp_path: Path, rank: int, key: str) -> dict[int, object]:
    """Step -> the rank's recorded ``key``; a step trained again after a resume keeps its last record."""
    rows = [json.loads(line) for line in (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


@pytest.mark.distributed
def test_two_trainer_ranks_split_each_lease_train_every_id_once_and_resume_after_a_crash(tmp_path):
    # DDP over two gloo processes, killed after RL step 5 (one past the checkpoint of step 4) and resumed
    run_dir = tmp_path / "run"
    crash = SFT_STEPS + 5
    torchrun_async(tmp_path, run_dir, crash_step=crash, expect=1)
    first = {r: rank_rows(tmp_path, r, "ids") for r in (0, 1)}
    assert sorted(first[0]) == sorted(first[1]) == [1, 2, 3, 4, 5]
    out = torchrun_async(tmp_path, run_dir)
    assert "resuming from" in out.stdout
    committed = trained(run_dir)
    by_step = {s: sorted(i for i, t in committed.items() if t == s) for s in set(committed.values())}
    assert sorted(by_step) == list(range(1, RL_STEPS + 1))
    assert all(len(ids) == 16 for ids in by_step.values())  # one whole batch a step, each id once
    shares = {r: rank_rows(tmp_path, r, "ids") for r in (0, 1)}
    for step, ids in by_step.items():
        # the two ranks' shares of the committed lease: disjoint, together the whole batch, whole groups each
        assert sorted(shares[0][step] + shares[1][step]) == ids, step
        assert len(shares[0][step]) == len(shares[1][step]) == 8
    params = {r: rank_rows(tmp_path, r, "params") for r in (0, 1)}
    assert sorted(params[0]) == list(range(1, RL_STEPS + 1))
    assert params[0] == params[1]  # the ranks' weights are identical after every update
    assert len(set(params[0].values())) == RL_STEPS  # and every update moved them
    rows = [m for m in metrics(run_dir) if "staleness/max" in m]
    assert [m["step"] for m in rows] == list(range(SFT_STEPS + 1, SFT_STEPS + RL_STEPS + 1))
    # logged once, over the whole batch: both ranks' rows
    assert all(m["rollout/samples"] == 16 and m["batch/samples"] == 16 for m in rows)
    assert all(m["staleness/max"] <= 1 for m in rows)


# ---------------------------------------------------------------- producers started outside the trainer

def test_a_run_with_no_local_producers_trains_from_one_started_by_rltk_produce(tmp_path):
    run_dir = tmp_path / "run"
    # started first, as a cluster launcher may: it waits for the trainer to start the asynchronous stage
    producer = subprocess.Popen([sys.executable, "-m", "rltk.commands.cli", "produce", str(run_dir), "--name", "ext-a"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        # the rollback journal, as a queue shared by machines over a network file system needs
        assert main(["run", "grpo", f"output_dir={run_dir}", *ASYNC, "trainer.producers=0",
                     "buffer.queue_journal=delete"]) == 0
        out, _ = producer.communicate(timeout=scaled(120))
    finally:
        producer.kill()
    assert producer.returncode == 0, out
    assert "ext-a: the trainer ended the stage at step 8; stopping" in out
    assert sorted(trained(run_dir).items()) == sorted((f"ext-a-b{s - 1}-{i}", s) for s in range(1, RL_STEPS + 1)
                                                      for i in range(16))
    assert not (run_dir / LOG).exists()  # the trainer started no producer of its own
    rows = [m for m in metrics(run_dir) if "staleness/max" in m]
    assert len(rows) == RL_STEPS and all(m["producers/alive"] == 0 for m in rows)


def test_a_run_with_no_local_producers_that_none_feeds_stops_naming_the_command(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["run", "grpo", f"output_dir={run_dir}", *ASYNC, "trainer.producers=0", "buffer.queue_timeout_s=3",
                 "stages=[{name: rl, type: rl}]"])
    err = capsys.readouterr().err
    assert code == 1
    assert re.search(r"waited 3 s \(buffer\.queue_timeout_s\) for an external rollout producer: none has put an "
                     r"experience into .*experience_queue\.sqlite \(trainer\.producers=0: the producers are yours "
                     r"to start, e\.g\. `rltk produce .*run`", err), err[-3000:]


# ZeRO-3 runs the same gather (strategy.full_state_dict, one tensor at a time) and passed this test once
# (2026-11-27, 209 s on this loaded 2-core machine, DeepSpeed's op compile included): too slow for CI, so
# only FSDP2 is parametrized; add (ZERO3, {"zero_stage": 3}) to check it again.
ZERO3 = ["strategy=deepspeed", "strategy_args.zero_stage=3",
         "strategy_args.config={zero_optimization: {stage3_param_persistence_threshold: 0}}"]


@pytest.mark.distributed
@pytest.mark.parametrize("strategy, sharded", [(["strategy_args.fsdp=true"], {"fsdp": True})], ids=["fsdp2"])
def test_two_sharded_ranks_publish_gathered_weights_and_stay_identical(tmp_path, strategy, sharded):
    # FSDP2 shards the policy: the weights file is gathered from both ranks' shards before rank 0 writes it,
    # and the producer loads it into its whole model
    run_dir = tmp_path / "run"
    torchrun_async(tmp_path, run_dir, *strategy)
    committed = trained(run_dir)
    assert sorted(committed.values()) == sorted(s for s in range(1, RL_STEPS + 1) for _ in range(16))
    shares = {r: rank_rows(tmp_path, r, "ids") for r in (0, 1)}
    for step in range(1, RL_STEPS + 1):
        assert sorted(shares[0][step] + shares[1][step]) == sorted(i for i, t in committed.items() if t == step)
    params = {r: rank_rows(tmp_path, r, "params") for r in (0, 1)}
    assert params[0] == params[1] and len(set(params[0].values())) == RL_STEPS
    from rltk.training.rollouts.engine_weights import weights_file_version

    assert weights_file_version(run_dir / "async" / "stage_1" / "policy.safetensors") == RL_STEPS
    meta = json.loads((run_dir / "checkpoints" / f"step_{SFT_STEPS + RL_STEPS:06d}" / "strategy.json").read_text())
    assert meta["world_size"] == 2 and sharded.items() <= meta.items()


def test_ppo_and_distill_run_async_through_the_same_rollout_source(tmp_path):
    """The recipes read their step the same in every mode: PPO (its critic in the trainer) and on-policy
    distillation (its teacher in the trainer) train one producer batch a step, within the bound, each
    experience once, as GRPO does."""
    teacher_run = tmp_path / "teacher"
    assert main(["run", "sft", f"output_dir={teacher_run}", "sft.steps=2", "sft.warmup_steps=0",
                 "logging.logger=[jsonl]", "logging.plot=false"]) == 0
    for recipe, extra in [("ppo", ["critic.warmup_steps=2"]),
                          ("distill", [f"distill.teacher_path={teacher_run / 'checkpoints' / 'step_000002'}"])]:
        run_dir = tmp_path / recipe
        args = [a.replace("type: rl}", f"type: {recipe}}}") if a.startswith("stages=") else a for a in ASYNC]
        assert main(["run", recipe, f"output_dir={run_dir}", *args, *extra]) == 0, recipe
        rows = one_batch_a_step_within_the_bound(run_dir)
        assert rows[-1]["staleness/max"] == 1, recipe  # the producer ran ahead: the bound was used
