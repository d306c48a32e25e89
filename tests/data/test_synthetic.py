import operator
import re
from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rltk.data.synthetic import (
    COUNTDOWN_INSTRUCT_TEMPLATE,
    arithmetic,
    countdown,
    is_held_out,
    make_task,
    sft_examples,
)

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def arithmetic_key(row):
    a, op, b = row["extras"]["a"], row["extras"]["op"], row["extras"]["b"]
    return (min(a, b), op, max(a, b)) if op in "+*" else (a, op, b)


def countdown_key(row):
    return (tuple(sorted(row["extras"]["numbers"])), row["extras"]["target"])


def value_of_generated_solution(text):
    # Our own generator's output, checked to be pure arithmetic first; model
    # output is never evaluated like this (see rltk.rewards.verifiable.countdown).
    assert re.fullmatch(r"[0-9+\-*/()]+", text), text
    return Fraction(eval(text.replace("/", "*Fraction(1)/")))  # exact division


def test_arithmetic_rows_are_correct_and_well_formed():
    rows = arithmetic("train", 50, seed=0, operators="+-*")
    assert len(rows) == 50
    assert len({r["id"] for r in rows}) == 50
    for row in rows:
        a, op, b = row["extras"]["a"], row["extras"]["op"], row["extras"]["b"]
        assert row["prompt"] == f"{a}{op}{b}="
        assert row["ground_truth"] == str(OPS[op](a, b))
        assert 0 <= a <= 99 and 0 <= b <= 99
        assert op != "-" or a >= b  # no negative results by default


def test_arithmetic_digit_counts_and_negatives():
    rows = arithmetic("train", 200, seed=1, min_digits=3, max_digits=3, operators="-", allow_negative=True)
    assert all(100 <= r["extras"]["a"] <= 999 and 100 <= r["extras"]["b"] <= 999 for r in rows)
    assert any(r["ground_truth"].startswith("-") for r in rows)


def test_held_out_aliases_name_the_test_split():
    assert arithmetic("heldout", 5, seed=0) == arithmetic("test", 5, seed=0) == arithmetic("eval", 5, seed=0)


def test_same_seed_same_rows_other_seed_other_rows():
    assert arithmetic("train", 20, seed=5) == arithmetic("train", 20, seed=5)
    assert arithmetic("train", 20, seed=5) != arithmetic("train", 20, seed=6)
    assert countdown("test", 10, seed=5) == countdown("test", 10, seed=5)


def test_split_sizes_match_the_hash_rule_exactly():
    # 1-digit addition: 100 ordered problems; the held-out ones are exactly
    # those whose canonical key hashes below test_fraction.
    held_out = sum(is_held_out(f"{min(a, b)}+{max(a, b)}", 0.2) for a in range(10) for b in range(10))
    assert len(arithmetic("test", held_out, seed=0, max_digits=1)) == held_out
    assert len(arithmetic("train", 100 - held_out, seed=0, max_digits=1)) == 100 - held_out
    with pytest.raises(ValueError, match=rf"size={held_out + 1} but the 'test' split has only {held_out} distinct"):
        arithmetic("test", held_out + 1, seed=0, max_digits=1)


def test_commutative_twins_share_a_split():
    def ordered(rows):
        return {(r["extras"]["a"], r["extras"]["op"], r["extras"]["b"]) for r in rows}

    n_test = sum(is_held_out(f"{min(a, b)}{op}{max(a, b)}", 0.2) for op in "+*" for a in range(10) for b in range(10))
    train = ordered(arithmetic("train", 200 - n_test, seed=0, max_digits=1, operators="+*"))
    test = ordered(arithmetic("test", n_test, seed=0, max_digits=1, operators="+*"))
    assert not train & test and len(train | test) == 200
    assert all((b, op, a) in train for a, op, b in train)  # 3+5 and 5+3 together


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**31), st.integers(0, 2**31))
def test_train_and_test_never_share_a_problem(train_seed, test_seed):
    train = {arithmetic_key(r) for r in arithmetic("train", 200, train_seed, operators="+-")}
    test = {arithmetic_key(r) for r in arithmetic("test", 200, test_seed, operators="+-")}
    assert not train & test
    cd_train = {countdown_key(r) for r in countdown("train", 40, train_seed)}
    cd_test = {countdown_key(r) for r in countdown("test", 40, test_seed)}
    assert not cd_train & cd_test


def test_countdown_puzzles_are_solved_by_their_solution():
    rows = countdown("train", 100, seed=3)
    assert len({countdown_key(r) for r in rows}) == 100
    for row in rows:
        extras = row["extras"]
        numbers, expression = extras["numbers"], extras["expression"]
        assert 3 <= len(numbers) <= 4 and all(1 <= n <= 99 for n in numbers)
        assert 1 <= extras["target"] <= 100 and row["ground_truth"] == str(extras["target"])
        assert Counter(int(n) for n in re.findall(r"\d+", expression)) == Counter(numbers)  # each exactly once
        assert value_of_generated_solution(expression) == extras["target"]
        assert extras["solution"] == f"<answer>{expression}</answer>"
        assert extras["rule"] == "exactly_once"
        assert row["prompt"] == f"Make {extras['target']} from {' '.join(map(str, numbers))}.\n"


def test_countdown_options():
    rows = countdown("test", 5, seed=0, min_numbers=2, max_numbers=2, max_number=9, max_target=50,
                     answer_tags=False, rule="at_most_once", prompt_template=COUNTDOWN_INSTRUCT_TEMPLATE)
    for row in rows:
        assert len(row["extras"]["numbers"]) == 2 and row["extras"]["rule"] == "at_most_once"
        assert row["extras"]["solution"] == row["extras"]["expression"]
        assert "at most once" in row["prompt"] and str(row["extras"]["numbers"]) in row["prompt"]


def test_sft_examples_pair_prompts_with_correct_completions():
    rows = arithmetic("train", 3, seed=0) + countdown("train", 2, seed=0)
    pairs = sft_examples(rows)
    assert pairs[0] == (rows[0]["prompt"], rows[0]["ground_truth"])
    assert pairs[3] == (rows[3]["prompt"], rows[3]["extras"]["solution"])
    assert pairs[3][1].startswith("<answer>")


def test_make_task_dispatches_and_checks_arguments():
    assert make_task("arithmetic", "train", 4, 0, operators="*") == arithmetic("train", 4, 0, operators="*")
    with pytest.raises(ValueError, match=r"unknown task 'arithmatic' at 'data.task'.*Did you mean: 'arithmetic'"):
        make_task("arithmatic", "train", 4, 0)
    with pytest.raises(ValueError, match=r"'countdown' has no argument\(s\) \['digits'\]. Valid: min_numbers"):
        make_task("countdown", "train", 4, 0, digits=3)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: arithmetic("dev", 3, 0), r"split='dev' is not valid. Valid: train, test"),
        (lambda: arithmetic("train", 0, 0), r"size must be a positive integer, got 0"),
        (lambda: arithmetic("train", 3, 0, operators="+/"), r"operators='\+/' is not valid"),
        (lambda: arithmetic("train", 3, 0, min_digits=3, max_digits=2), r"min_digits <= max_digits"),
        (lambda: countdown("train", 3, 0, rule="once"), r"rule='once' is not valid"),
        (lambda: countdown("train", 3, 0, prompt_template="{nums}"), r"not a valid template"),
        (lambda: countdown("train", 3, 0, test_fraction=1.0), r"test_fraction must be strictly between"),
    ],
)
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()
