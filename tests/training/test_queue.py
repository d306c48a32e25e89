"""The persistent experience queue: leases, commits and recovery, staleness, concurrent producer processes."""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
import time

import pytest

from rltk.batch import Experience
from rltk.training.rollouts.asynchronous.queue import ExperienceQueue, QueueFileError, QueueTimeout

from tests.waits import scaled


def group(group_id, size=2, tokens=3, score=1.0):
    return [Experience(prompt_ids=[7, group_id], response_ids=list(range(1, tokens + 1)), score=score + i,
                       group_id=group_id, rollout_logprobs=[-0.5] * tokens) for i in range(size)]


def put_group(q, producer, group_id, version, size=2, **kw):
    ids = [f"{producer}-{group_id}-{i}" for i in range(size)]
    return q.put(group(group_id, size, **kw), ids=ids, versions=version, producer=producer)


def test_wal_mode_and_a_round_trip_of_every_field(tmp_path):
    path = tmp_path / "q.sqlite"
    with ExperienceQueue(path) as q:
        exp = Experience(prompt_ids=[1, 2], response_ids=[3, 4, 5], score=0.25, group_id=9, response_mask=[1, 0, 1],
                         rollout_logprobs=[-0.1, -0.2, -0.30000000000000004], finish_reason="length",
                         reward_details={"acc": 1.0}, info={"answer": "12"}, turn_rewards=[(1, 0.5)])
        assert q.put([exp], ids=["a"], versions=[[3, 3, 4]], producer="w0") == 1
        lease = q.take(1, step=1, version=4)
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    (got,) = lease.experiences
    assert got == Experience(**{**exp.__dict__, "group_id": 0})  # floats exact, group renumbered
    assert lease.ids == ["a"] and lease.versions == [[3, 3, 4]] and lease.group_keys == ["w0/a/9"]
    # the oldest token decides: 4 - 3
    assert lease.metrics["staleness/mean"] == 1.0 and lease.metrics["staleness/max"] == 1.0


def test_an_interrupted_rollout_is_as_stale_as_its_oldest_token_and_counted_per_token(tmp_path):
    """Versions per token (a rollout a weight update interrupted): the bound applies to the oldest token, the
    per-token metrics to every token."""
    with ExperienceQueue(tmp_path / "q.sqlite", max_staleness=1) as q:
        # trainer version 3: the mixed one's oldest token (1) is 2 versions old, though most of it is fresh
        q.put(group(0, 1, tokens=4), ids=["old"], versions=[[1, 3, 3, 3]], producer="p")
        q.put(group(1, 1, tokens=4), ids=["mixed"], versions=[[2, 2, 3, 3]], producer="p")
        q.put(group(2, 1, tokens=2), ids=["fresh"], versions=[[3, 3]], producer="p")
        lease = q.take(2, step=4, version=3)
        assert lease.ids == ["mixed", "fresh"] and q.ids("dropped") == ["old"]
        assert lease.versions == [[2, 2, 3, 3], [3, 3]]
        # per experience: oldest tokens 2 and 3 -> staleness 1 and 0
        assert lease.metrics["staleness/mean"] == 0.5 and lease.metrics["staleness/max"] == 1.0
        # per token: (1 + 1 + 0 + 0) + (0 + 0) over 6 tokens; one of the two spans an update
        assert lease.metrics["staleness/token_mean"] == pytest.approx(2 / 6)
        assert lease.metrics["staleness/mixed"] == 0.5
        assert lease.metrics["staleness/dropped"] == 1.0


def test_token_staleness_by_hand():
    from rltk.training.rollouts.asynchronous.queue import token_staleness

    assert token_staleness(5, [[5, 5], [3, 4, 5], [4]]) == {
        "staleness/token_mean": (0 + 0 + 2 + 1 + 0 + 1) / 6, "staleness/mixed": 1 / 3}
    assert token_staleness(2, [[]]) == {"staleness/token_mean": 0.0, "staleness/mixed": 0.0}


def test_the_rollback_journal_for_a_queue_on_a_network_file_system_leases_and_commits_alike(tmp_path):
    # producers on other machines: no WAL (its shared-memory index does not cross machines)
    path = tmp_path / "q.sqlite"
    with ExperienceQueue(path, journal_mode="delete") as producer, \
            ExperienceQueue(path, max_staleness=1, journal_mode="delete") as trainer:
        put_group(producer, "m1", 0, version=0)
        put_group(producer, "m2", 1, version=0)
        lease = trainer.take(4, step=1, version=0)
        assert trainer.commit(1) == 4 and producer.committed_step == 1
    assert sorted(lease.ids) == ["m1-0-0", "m1-0-1", "m2-1-0", "m2-1-1"]
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert not (tmp_path / "q.sqlite-wal").exists()
    with pytest.raises(ValueError, match="journal_mode must be one of wal, delete, got 'memory'"):
        ExperienceQueue(path, journal_mode="memory")


def test_progress_reads_the_taken_step_and_the_ready_count_together(tmp_path):
    with ExperienceQueue(tmp_path / "q.sqlite") as q:
        assert q.progress() == (0, 0)
        for g in range(3):
            put_group(q, "w", g, version=0)
        assert q.progress() == (0, 6)
        q.take(2, step=1, version=0)
        assert q.progress() == (1, 4)  # the take moved both: the step it took and what is left
        q.commit(1)
        assert q.progress() == (1, 4)


def test_take_leases_whole_groups_oldest_first_and_renumbers_them(tmp_path):
    with ExperienceQueue(tmp_path / "q.sqlite") as q:
        put_group(q, "a", 0, 0)
        put_group(q, "b", 0, 0)  # same group_id from another producer: another group
        put_group(q, "a", 1, 0)
        lease = q.take(4, step=1, version=0)
        assert lease.ids == ["a-0-0", "a-0-1", "b-0-0", "b-0-1"]
        assert [e.group_id for e in lease.experiences] == [0, 0, 1, 1]
        assert q.counts() == {"ready": 2, "leased": 4, "consumed": 0, "dropped": 0}
        # a producer's next batch numbers its groups from 0 again: another group, not more of group 0
        q.put(group(0, 1), ids=["a-next-0"], versions=0, producer="a")
        assert q.take(3, step=2, version=0).ids == ["a-1-0", "a-1-1", "a-next-0"]
        # a group bigger than the batch is still taken whole rather than never
        put_group(q, "c", 0, 0, size=3)
        assert q.take(1, step=3, version=0).ids == ["c-0-0", "c-0-1", "c-0-2"]


def test_producer_counters_reach_the_next_take_once_and_a_repeated_put_adds_none(tmp_path):
    with ExperienceQueue(tmp_path / "q.sqlite") as q:
        calls = {"reward_fn/calls": 2.0, "reward_fn/failures/exact_match": 1.0}
        q.put(group(0), ids=["a-0", "a-1"], versions=0, producer="a", counters=calls)
        q.put(group(0), ids=["b-0", "b-1"], versions=0, producer="b", counters={"reward_fn/calls": 2.0})
        # a restarted producer puts its last batch again: nothing new, so its counters are not counted twice
        q.put(group(0), ids=["a-0", "a-1"], versions=0, producer="a", counters=calls)
        first = q.take(2, step=1, version=0).metrics
        assert first["reward_fn/calls"] == 4.0 and first["reward_fn/failures/exact_match"] == 1.0
        second = q.take(2, step=2, version=0).metrics  # the second batch was already there: nothing new
        assert "reward_fn/calls" not in second
        with pytest.raises(ValueError, match="counters must map names to finite numbers"):
            q.put(group(1), ids=["c-0", "c-1"], versions=0, producer="c", counters={"reward_fn/calls": float("nan")})


def test_put_is_idempotent_by_id(tmp_path):
    with ExperienceQueue(tmp_path / "q.sqlite") as q:
        assert put_group(q, "a", 0, 0) == 2
        assert put_group(q, "a", 0, 0) == 0  # a restarted producer putting its last group again
        q.take(2, step=1, version=0)
        q.commit(1)
        assert put_group(q, "a", 0, 0) == 0  # also once consumed
        assert q.counts()["ready"] == 0


def test_bad_puts_are_refused_naming_the_problem(tmp_path):
    with ExperienceQueue(tmp_path / "q.sqlite") as q:
        with pytest.raises(ValueError, match="2 ids for 1 experiences"):
            q.put(group(0, 1), ids=["x", "y"], versions=0)
        with pytest.raises(ValueError, match=r"one int per response token \(3\)"):
            q.put(group(0, 1), ids=["x"], versions=[[1, 2]])
        with pytest.raises(TypeError, match="not a rltk.batch.Experience"):
            q.put([{"prompt_ids": [1]}], ids=["x"], versions=0)
        with pytest.raises(ValueError, match="distinct"):
            q.put(group(0, 2), ids=["x", "x"], versions=0)
        odd = group(0, 1)
        odd[0].info["when"] = object()
        with pytest.raises(TypeError, match="'x' cannot be stored as JSON.*info must hold JSON-able values"):
            q.put(odd, ids=["x"], versions=0)
        assert q.counts()["ready"] == 0


def test_commit_consumes_every_lease_up_to_the_checkpoint_step(tmp_path):
    with ExperienceQueue(tmp_path / "q.sqlite") as q:
        for g in range(3):
            put_group(q, "a", g, 0)
        for step in (1, 2, 3):
            q.take(2, step=step, version=0)
        assert q.commit(2) == 4  # a checkpoint at step 2 covers steps 1 and 2
        assert q.counts() == {"ready": 0, "leased": 2, "consumed": 4, "dropped": 0}
        assert q.committed_step == 2
        with pytest.raises(ValueError, match="step 2 is already committed"):
            q.take(2, step=2, version=0)


def test_recover_commits_what_the_checkpoint_holds_and_returns_the_rest_in_order(tmp_path):
    path = tmp_path / "q.sqlite"
    with ExperienceQueue(path) as q:
        for g in range(4):
            put_group(q, "a", g, 0)
        q.take(2, step=1, version=0)
        q.commit(1)
        q.take(2, step=2, version=0)  # checkpoint of step 2 saved, then the crash: commit(2) never ran
        q.take(2, step=3, version=0)  # trained, never checkpointed
    with ExperienceQueue(path) as q:  # the restarted trainer resumes from the checkpoint of step 2
        assert q.recover(2) == {"committed": 2, "returned": 2}
        assert q.ids("consumed") == ["a-0-0", "a-0-1", "a-1-0", "a-1-1"]
        assert q.take(4, step=3, version=0).ids == ["a-2-0", "a-2-1", "a-3-0", "a-3-1"]  # original order


def test_a_restarted_trainer_must_recover_before_it_takes_or_commits(tmp_path):
    path = tmp_path / "q.sqlite"
    with ExperienceQueue(path) as q:
        for g in range(2):
            put_group(q, "a", g, 0)
        q.take(2, step=1, version=0)  # then the process dies
    with ExperienceQueue(path) as q:
        for call in (lambda: q.take(2, step=1, version=0), lambda: q.commit(1)):
            with pytest.raises(RuntimeError, match=r"1 lease\(s\) of step\(s\) \[1\] are open from an earlier "
                                                   r"trainer process; call recover\(resumed_step\)"):
                call()
        q.recover(0)
        assert q.take(4, step=1, version=0).ids == ["a-0-0", "a-0-1", "a-1-0", "a-1-1"]


def test_resuming_from_a_checkpoint_older_than_the_last_commit_is_refused(tmp_path):
    with ExperienceQueue(tmp_path / "q.sqlite") as q:
        put_group(q, "a", 0, 0)
        q.take(2, step=1, version=0)
        q.commit(1)
        with pytest.raises(ValueError, match=r"committed up to training step 1, but the run resumes from step 0"):
            q.recover(0)


def test_drop_policy_drops_stale_groups_and_counts_them(tmp_path):
    with ExperienceQueue(tmp_path / "q.sqlite", max_staleness=1) as q:
        put_group(q, "a", 0, 3)             # staleness 5 - 3 = 2: dropped
        put_group(q, "a", 1, [[4, 4, 5], [5, 5, 5]])  # one member's oldest token is 4: staleness 1, kept
        put_group(q, "a", 2, 5)             # staleness 0
        lease = q.take(4, step=1, version=5)
        assert lease.ids == ["a-1-0", "a-1-1", "a-2-0", "a-2-1"]
        # per experience: 1, 0 (group 1), 0, 0 (group 2) -> mean 0.25, max 1
        assert lease.metrics["staleness/mean"] == 0.25 and lease.metrics["staleness/max"] == 1.0
        assert lease.metrics["staleness/dropped"] == 2.0
        assert q.ids("dropped") == ["a-0-0", "a-0-1"]


def test_wait_policy_times_out_naming_what_it_waited_for(tmp_path):
    with ExperienceQueue(tmp_path / "q.sqlite", max_staleness=1, stale_policy="wait", timeout_s=0.3) as q:
        put_group(q, "a", 0, 2)
        put_group(q, "a", 1, 5)
        start = time.monotonic()
        with pytest.raises(QueueTimeout) as info:
            q.take(4, step=1, version=5)
        assert 0.3 <= time.monotonic() - start < scaled(5)
        msg = str(info.value)
        assert "waited 0.3 s for 4 experiences of policy version >= 4 (trainer version 5, max_staleness 1)" in msg
        assert "2 trainable ones are there" in msg and "2 older ones (policy versions [2])" in msg
        assert str(tmp_path / "q.sqlite") in msg
        assert q.counts() == {"ready": 4, "leased": 0, "consumed": 0, "dropped": 0}  # nothing dropped


def test_wait_policy_returns_once_a_producer_supplies_fresh_data(tmp_path):
    path = tmp_path / "q.sqlite"
    with ExperienceQueue(path, max_staleness=0, stale_policy="wait", timeout_s=20) as q:
        put_group(q, "a", 0, 1)  # stale at version 2

        def late_producer():
            time.sleep(0.2)
            with ExperienceQueue(path) as p:
                put_group(p, "b", 0, 2)

        thread = threading.Thread(target=late_producer)
        thread.start()
        lease = q.take(2, step=1, version=2)
        thread.join()
        assert lease.ids == ["b-0-0", "b-0-1"] and lease.metrics["staleness/waited_s"] >= 0.2
        assert lease.metrics["staleness/dropped"] == 0.0 and q.counts()["ready"] == 2


def test_an_empty_queue_times_out_instead_of_hanging(tmp_path):
    with ExperienceQueue(tmp_path / "q.sqlite", timeout_s=0.1) as q:
        # the wait is reported as measured (>= the timeout; 0.2 s on a loaded machine)
        with pytest.raises(QueueTimeout, match=r"waited \d+\.\d s for 2 experiences of no staleness bound for training "
                                               r"step 1; 0 trainable ones are there\. Are the producers running"):
            q.take(2, step=1, version=0)


def test_a_write_lock_held_too_long_is_a_timeout_naming_what_waited(tmp_path):
    path = tmp_path / "q.sqlite"
    ExperienceQueue(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process in the middle of a write
    try:
        with ExperienceQueue(path, busy_timeout_s=0.2) as q:
            with pytest.raises(QueueTimeout, match=r"waited 0\.2 s for the write lock to put experiences"):
                put_group(q, "a", 0, 0)
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="stale_policy must be one of drop, wait"):
        ExperienceQueue(tmp_path / "q.sqlite", stale_policy="skip")
    with pytest.raises(ValueError, match="max_staleness must be an integer >= 0"):
        ExperienceQueue(tmp_path / "q.sqlite", max_staleness=-1)
    with ExperienceQueue(tmp_path / "q.sqlite") as q:
        with pytest.raises(ValueError, match="step must be an integer >= 1"):
            q.take(2, step=0, version=0)


def _produce(path, name, groups):
    with ExperienceQueue(path) as q:
        for g in range(groups):
            put_group(q, name, g, 0)


def test_several_producer_processes_write_at_once(tmp_path):
    path = tmp_path / "q.sqlite"
    ExperienceQueue(path).close()
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_produce, args=(path, f"w{i}", 40)) for i in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(scaled(60))
        assert w.exitcode == 0
    with ExperienceQueue(path) as q:
        ids = q.ids("ready")
        assert len(ids) == len(set(ids)) == 4 * 40 * 2
        lease = q.take(4 * 40 * 2, step=1, version=0)
        # every group arrived whole: its two members are adjacent
        assert all(lease.group_keys[i] == lease.group_keys[i + 1] for i in range(0, len(lease), 2))


# ---------------------------------------------------------------- the checkpoint's cursor, a damaged file

def test_the_cursor_counts_what_the_checkpointed_steps_took_open_or_committed(tmp_path):
    with ExperienceQueue(tmp_path / "q.sqlite") as q:
        for g in range(4):
            put_group(q, "a", g, 0)
        put_group(q, "b", 0, 0)
        q.take(4, step=1, version=0)  # a-0, a-1: arrival numbers 1..4
        q.take(2, step=2, version=1)  # a-2: 5, 6
        q.commit(1)
        cursor = q.cursor(2)  # step 2's lease is still open (a crash before its commit): it counts
        q.take(2, step=3, version=2)  # after the checkpoint: not in its cursor
    assert cursor == {"queue_id": cursor["queue_id"], "step": 2, "experiences": 6, "last_seq": 6,
                      "last_ids": {"a": "a-2-1"}}
    with ExperienceQueue(tmp_path / "q.sqlite") as q:  # reopened: the same file, the same id
        assert q.queue_id == cursor["queue_id"]
        q.check_cursor(cursor)
        q.recover(2)  # step 3's lease goes back to the queue; it was never in the cursor
        q.check_cursor(cursor)
        assert q.cursor(2) == cursor
        assert q.cursor(3)["experiences"] == 6  # a returned lease is not taken


def test_a_queue_that_does_not_hold_the_cursor_is_refused_naming_it(tmp_path):
    path = tmp_path / "q.sqlite"
    with ExperienceQueue(path) as q:
        for g in range(3):
            put_group(q, "a", g, 0)
        q.take(2, step=1, version=0)
        q.take(2, step=2, version=1)
        cursor = q.cursor(2)
        q.commit(2)
    with ExperienceQueue(tmp_path / "new.sqlite") as q:
        with pytest.raises(QueueFileError, match=r"new\.sqlite is a new, empty queue, but the checkpoint of "
                                                 r"training step 2 trained 4 experiences from it"):
            q.check_cursor(cursor)
        put_group(q, "a", 0, 0)
        with pytest.raises(QueueFileError, match=r"new\.sqlite is another queue \(id [0-9a-f]+, not the "
                                                 r"checkpoint's [0-9a-f]+: a replaced file, or another run's"):
            q.check_cursor(cursor)
    # a row gone: the count and the last arrival number say so
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM experiences WHERE id = 'a-1-1'")
    with ExperienceQueue(path) as q, pytest.raises(
            QueueFileError, match=r"q\.sqlite does not hold what the checkpoint trained from it: it holds 3 "
                                  r"experiences taken by steps 1\.\.2 \(the last one arrival number 3\), but the "
                                  r"checkpoint of training step 2 trained 4 experiences from it \(the last one "
                                  r"arrival number 4\)\. Rows are missing"):
        q.check_cursor(cursor)
    # the queue's end before the cursor's (an older copy of the file put back)
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM experiences WHERE seq > 3")
    with ExperienceQueue(path) as q, pytest.raises(
            QueueFileError, match=r"\(the last one arrival number 4\); the queue ends at arrival number 3, before "
                                  r"the checkpoint's cursor\. Rows are missing"):
        q.check_cursor(cursor)


def test_a_damaged_file_is_refused_naming_it_when_opened_or_at_the_first_read(tmp_path):
    path = tmp_path / "q.sqlite"
    with ExperienceQueue(path) as q:
        for g in range(40):
            put_group(q, "a", g, 0, tokens=200)
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])  # truncated halfway
    with pytest.raises(QueueFileError, match=rf"experience queue {path} is damaged: SQLite cannot read it "
                                             rf"\(database disk image is malformed\)"):
        ExperienceQueue(path)
    path.write_bytes(b"not a database" * 500)
    with pytest.raises(QueueFileError, match=r"q\.sqlite is damaged: SQLite cannot read it \(file is not a "):
        ExperienceQueue(path)
    # garbage over the experiences table's first page: the file opens, and the first read of it names it
    path.write_bytes(good)
    with sqlite3.connect(path) as db:
        (root,) = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'experiences'").fetchone()
        (page,) = db.execute("PRAGMA page_size").fetchone()
    path.write_bytes(good[: (root - 1) * page] + b"\xff" * page + good[root * page:])
    with ExperienceQueue(path) as q, pytest.raises(QueueFileError, match=r"q\.sqlite is damaged"):
        q.ids("ready")


def test_a_database_that_is_no_queue_is_refused_untouched(tmp_path):
    path = tmp_path / "other.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE results (name TEXT)")
    with pytest.raises(QueueFileError, match=r"other\.sqlite is an SQLite database but no experience queue: it "
                                             r"holds the tables results and no 'experiences'"):
        ExperienceQueue(path)
    with sqlite3.connect(path) as db:  # nothing was added to it
        assert db.execute("SELECT name FROM sqlite_master").fetchall() == [("results",)]
        db.execute("CREATE TABLE experiences (seq INTEGER, id TEXT)")
    with pytest.raises(QueueFileError, match=r"its table 'experiences' lacks the column\(s\) group_key, lease, "):
        ExperienceQueue(path)


def test_a_new_queue_carries_the_producers_last_ids_over(tmp_path):
    with ExperienceQueue(tmp_path / "q.sqlite") as q:
        q.carry_over({"a": "a-b3-1", "b": "b-b1-0"})
        assert (q.last_id("a"), q.last_id("c")) == ("a-b3-1", None)
        q.put(group(0), ids=["a-b4-0", "a-b4-1"], versions=0, producer="a")
        assert q.last_id("a") == "a-b4-1"  # its own put, once it has one
        q.recover(2)
        assert q.take(2, step=3, version=2).ids == ["a-b4-0", "a-b4-1"]
        # the next checkpoint's cursor keeps a producer that has put nothing here yet
        assert q.cursor(3)["last_ids"] == {"a": "a-b4-1", "b": "b-b1-0"}
