"""Stitching recorded requests into trajectories by token prefix, and the session store."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rltk.serve.sessions import Record, SessionStore, stitch

_seq = iter(range(10**9))


def record(prompt, completion, logprobs=None, finish="stop", text="", session="s"):
    logprobs = logprobs if logprobs is not None else [-(i + 1) / 10 for i in range(len(completion))]
    return Record(session, "req", 0, next(_seq), tuple(prompt), tuple(completion), tuple(logprobs), finish, text,
                  "chat")


def test_a_two_turn_conversation_is_one_trajectory_with_inserted_tokens_masked():
    first = record([1, 2, 3], [4, 5], [-0.4, -0.5], text="a")
    # turn 2: the earlier prompt + completion, then 2 tokens the template/user inserted
    second = record([1, 2, 3, 4, 5, 8, 9], [6, 7], [-0.6, -0.7], finish="length", text="b")
    [trajectory] = stitch([second, first])  # order comes from seq, not list order
    assert trajectory.prompt_ids == [1, 2, 3]
    assert trajectory.response_ids == [4, 5, 8, 9, 6, 7]
    assert trajectory.response_mask == [1, 1, 0, 0, 1, 1]
    assert trajectory.logprobs == [-0.4, -0.5, 0.0, 0.0, -0.6, -0.7]
    assert trajectory.ids == list(second.prompt_ids + second.completion_ids)
    assert (trajectory.finish_reason, trajectory.last_text) == ("length", "b")
    assert trajectory.records == [first.seq, second.seq]


def test_a_prompt_that_rewrites_history_starts_a_new_segment():
    first = record([1, 2, 3], [4, 5])
    rewritten = record([1, 2, 7, 8], [9])  # not an extension of [1, 2, 3, 4, 5]
    third = record([1, 2, 7, 8, 9, 10], [11])
    trajectories = stitch([first, rewritten, third])
    assert [t.prompt_ids for t in trajectories] == [[1, 2, 3], [1, 2, 7, 8]]
    assert trajectories[0].response_ids == [4, 5] and trajectories[0].response_mask == [1, 1]
    assert trajectories[1].response_ids == [9, 10, 11] and trajectories[1].response_mask == [1, 0, 1]


def test_sibling_choices_and_a_retry_from_an_earlier_turn_fork_the_shared_history():
    first = record([1, 2], [3])
    a = record([1, 2, 3, 9], [4])       # turn 2, choice 0
    b = record([1, 2, 3, 9], [5])       # turn 2, choice 1 (n=2): forks at the state after turn 1
    after_b = record([1, 2, 3, 9, 5, 9], [6])  # the agent continued from choice 1
    trajectories = stitch([first, a, b, after_b])
    assert len(trajectories) == 2
    assert trajectories[0].response_ids == [3, 9, 4]
    assert trajectories[1].prompt_ids == [1, 2]
    assert trajectories[1].response_ids == [3, 9, 5, 9, 6]
    assert trajectories[1].response_mask == [1, 0, 1, 0, 1]
    assert trajectories[1].records == [first.seq, b.seq, after_b.seq]


def test_the_same_prompt_twice_is_two_segments():
    trajectories = stitch([record([1, 2], [3]), record([1, 2], [4])])
    assert [t.response_ids for t in trajectories] == [[3], [4]]


def test_the_longest_matching_prefix_wins():
    short = record([1], [2])
    long = record([1, 2, 5], [6])          # extends `short`
    other = record([1, 2, 5, 6, 7], [8])   # extends both [1, 2] and [1, 2, 5, 6]: the longer one
    [trajectory] = stitch([short, long, other])
    assert trajectory.response_ids == [2, 5, 6, 7, 8]
    assert trajectory.response_mask == [1, 0, 1, 0, 1]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 50), min_size=0, max_size=4),
                          st.lists(st.integers(0, 50), min_size=1, max_size=4)), min_size=1, max_size=6),
       st.lists(st.integers(0, 50), min_size=1, max_size=5))
def test_any_linear_conversation_stitches_to_the_last_request_exactly(turns, opening):
    """Each turn inserts some tokens and generates some: one trajectory, every completion token masked 1
    with its own log-prob, every inserted token masked 0."""
    records, context, expected_mask, expected_lps = [], list(opening), [], []
    for number, (inserted, completion) in enumerate(turns):
        prompt = context + (inserted if number else [])
        if number:
            expected_mask += [0] * len(inserted)
            expected_lps += [0.0] * len(inserted)
        lps = [-(number + 1) - i / 100 for i in range(len(completion))]
        records.append(record(prompt, completion, lps))
        expected_mask += [1] * len(completion)
        expected_lps += lps
        context = prompt + completion
    [trajectory] = stitch(records)
    assert trajectory.prompt_ids == opening
    assert trajectory.ids == context
    assert trajectory.response_mask == expected_mask
    assert trajectory.logprobs == expected_lps
    assert sum(trajectory.response_mask) == sum(len(c) for _, c in turns)


def test_store_files_records_by_session_and_drops_the_oldest_session_past_its_cap():
    store = SessionStore(max_sessions=2)
    for session in ("a", "b", "a", "c"):
        store.add(session, "r", 0, [1], [2], [-0.5], "stop", "x", "chat")
    assert store.session_ids() == ["a", "c"]  # "b" was written least recently
    assert [r.seq for r in store.get("a")] == [0, 2]
    assert store.pop("a")[1].logprobs == (-0.5,) and store.get("a") == []
    with pytest.raises(ValueError, match="max_sessions"):
        SessionStore(max_sessions=0)


def test_store_is_safe_under_concurrent_writes():
    store = SessionStore()

    def write(worker):
        for i in range(200):
            store.add(f"s{worker % 3}", "r", i, [1], [2], [0.0], "stop", "", "chat")

    threads = [threading.Thread(target=write, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seqs = sorted(r.seq for s in store.session_ids() for r in store.get(s))
    assert seqs == list(range(1200))


def test_the_store_keeps_owners_apart_and_evicts_by_records_bytes_and_total():
    from rltk.serve.sessions import record_bytes

    store = SessionStore(max_records=3, max_bytes=None, max_total_bytes=None)
    for k in range(5):
        store.add("s", f"r{k}", 0, [1, 2], [3], [-0.1], "stop", "ab", "chat", owner="alice")
    store.add("s", "r0", 0, [9], [9], [-0.9], "stop", "", "chat", owner="bob")
    assert [r.request_id for r in store.get("s", "alice")] == ["r2", "r3", "r4"]
    assert [r.prompt_ids for r in store.get("s", "bob")] == [(9,)] and store.get("s") == []
    assert store.requests("s", "alice") == 5 and store.evicted("s", "alice") == 2
    assert store.session_ids("alice") == ["s"] and store.session_ids() == []
    # 8 bytes per id and log-prob, the text's UTF-8, 200 for the rest: 8 * (2 + 1 + 1) + 2 + 200
    assert record_bytes(store.get("s", "alice")[0]) == 234
    assert store.total_bytes() == 3 * 234 + (8 * 3 + 200)

    small = SessionStore(max_records=None, max_bytes=500, max_total_bytes=750)
    for k in range(4):
        small.add("a", f"r{k}", 0, [1, 2], [3], [-0.1], "stop", "ab", "chat")
    assert len(small.get("a")) == 2  # 2 x 234 <= 500 < 3 x 234
    small.add("b", "r", 0, [1, 2], [3], [-0.1], "stop", "ab", "chat")
    assert small.total_bytes() == 3 * 234 and small.session_ids() == ["a", "b"]
    small.add("b", "r2", 0, [1, 2], [3], [-0.1], "stop", "ab", "chat")
    assert small.session_ids() == ["b"]  # 4 x 234 > 750 in all: the least recently written session went
    assert small.total_bytes() == 2 * 234 and len(small.pop("b")) == 2 and small.total_bytes() == 0
