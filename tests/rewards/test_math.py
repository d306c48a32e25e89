import time
from fractions import Fraction

import pytest

from rltk.rewards.verifiable.math import (
    exact_match,
    extract_boxed,
    extract_final_answer,
    extract_hash_answer,
    math_answer,
    normalise_answer,
    parse_number,
)

from tests.waits import scaled


def score(fn, response, ground_truth, **args):
    return fn(prompt="", response=response, ground_truth=ground_truth, extras={}, **args)


@pytest.mark.parametrize(
    "text, value",
    [
        ("42", 42), ("-3", -3), ("+7", 7), (" 42 ", 42), ("42.0", 42), ("42.", 42), ("0.5", Fraction(1, 2)),
        (".25", Fraction(1, 4)), ("1,234", 1234), ("1,234.50", Fraction(2469, 2)), ("1{,}000", 1000),
        ("3/4", Fraction(3, 4)), ("-6/4", Fraction(-3, 2)), ("\\frac{3}{4}", Fraction(3, 4)),
        ("\\dfrac{1}{2}", Fraction(1, 2)), ("\\frac12", Fraction(1, 2)), ("-\\frac{1}{2}", Fraction(-1, 2)),
        ("50%", 50), ("50\\%", 50), ("$5", 5), ("\\$1,000", 1000), ("1e3", 1000), ("2.5e-1", Fraction(1, 4)),
        ("\u22125", -5),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("text", ["", "abc", "1,23", "12,34,567", "1/0", "1/2/3", "4x", "1e999999999", "--5", "1..2"])
def test_parse_number_rejects(text):
    assert parse_number(text) is None


def test_parse_number_refuses_huge_inputs_quickly():
    start = time.perf_counter()
    assert parse_number("9" * 1_000_000) is None
    assert parse_number("1" + "0" * 399) == 10**399  # up to MAX_NUMBER_CHARS is fine
    assert time.perf_counter() - start < scaled(0.5)


def test_extract_boxed_balances_braces():
    assert extract_boxed("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed{1} then \\boxed{{2}+{3}}") == "{2}+{3}"
    assert extract_boxed("\\fbox{7}") == "7"
    assert extract_boxed("\\boxed 5$") == "5"
    assert extract_boxed("\\boxed{1 + {2}") is None  # unclosed
    assert extract_boxed("no box") is None
    assert extract_boxed("\\boxed") is None


def test_extract_hash_answer_takes_the_rest_of_the_last_marked_line():
    assert extract_hash_answer("3 + 4 = 7\n#### 7\nextra") == "7"
    assert extract_hash_answer("#### 1\n#### 2") == "2"
    assert extract_hash_answer("####   ") is None
    assert extract_hash_answer("7") is None
    assert extract_hash_answer("<answer>#### 7</answer>") == "7"


def test_final_answer_is_the_later_marker():
    assert extract_final_answer("#### 5 then \\boxed{6}") == "6"
    assert extract_final_answer("\\boxed{6} then #### 5") == "5"
    assert extract_final_answer("answer 12, not 13.") is None
    assert extract_final_answer("answer 12, not 13.", flexible=True) == "13"
    assert extract_final_answer("total: -1,200", flexible=True) == "-1,200"


def test_normalise_answer():
    assert normalise_answer(" \\text{(A)} ") == "(A)"
    assert normalise_answer("\\left( 1, 2 \\right)") == "(1,2)"
    assert normalise_answer("x = \\dfrac{1}{2}.") == "\\frac{1}{2}"
    assert normalise_answer("90^\\circ") == "90"


@pytest.mark.parametrize(
    "response, ground_truth",
    [
        ("She pays 3*24 = 72 dollars.\n#### 72", "72"),
        ("#### 1000", "Each costs 10 so 100 * 10 = 1,000\n#### 1,000"),  # GSM8K-style ground truth
        ("so \\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{0.50}", "\\frac12"),
        ("\\boxed{50\\%}", "50"),
        ("\\boxed{x = 5}", "5"),
        ("\\boxed{x^2 + 1}", "x^2+1"),
        ("\\boxed{\\text{(B)}}", "(B)"),
        ("The final answer is \\boxed{-3}.", "\\boxed{-3}"),
        ("#### 72.0", "72"),
    ],
)
def test_math_answer_correct(response, ground_truth):
    assert score(math_answer, response, ground_truth) == 1.0


@pytest.mark.parametrize(
    "response, ground_truth",
    [
        ("#### 71", "72"),
        ("\\boxed{1/3}", "0.333"),  # exact: 1/3 is not 0.333
        ("\\boxed{x^2}", "x^3"),
        ("The answer is 72.", "72"),  # no marked answer, not flexible
        ("\\boxed{72", "72"),  # unclosed box
        ("\\boxed{}", "72"),
    ],
)
def test_math_answer_wrong(response, ground_truth):
    assert score(math_answer, response, ground_truth) == 0.0


def test_math_answer_options():
    assert score(math_answer, "The answer is 72.", "72", flexible=True) == 1.0
    assert score(math_answer, "\\boxed{72", "72", flexible=True) == 1.0  # falls back to the last number
    assert score(math_answer, "#### 71", "72", format_score=0.1) == 0.1
    assert score(math_answer, "no answer at all", "72", format_score=0.1) == 0.0
    assert score(math_answer, "\\boxed{0.3333333333}", "1/3", rel_tol=1e-6) == 1.0


def test_math_answer_survives_hostile_output_quickly():
    start = time.perf_counter()
    hostile = [
        "\\boxed{" + "{" * 100_000,
        "\\boxed{" * 50_000,
        "9" * 200_000,
        "#### " + "9" * 100_000,
        "#### 9**9**9",
        "\\boxed{__import__('os').system('echo hi')}",
        "1," * 100_000,
    ]
    for response in hostile:
        assert score(math_answer, response, "72", flexible=True) == 0.0
    assert time.perf_counter() - start < scaled(2.0)


@pytest.mark.parametrize(
    "response, ground_truth, expected",
    [
        ("42", "42", 1.0),
        ("  42 \nbecause 40+2", "42", 1.0),  # first line only
        ("42.0", "42", 1.0),
        ("1,000", "1000", 1.0),
        ("Paris", "paris", 1.0),
        ("New   York", "new york", 1.0),
        ("4 2", "42", 0.0),
        ("43", "42", 0.0),
        ("", "42", 0.0),
        ("\n42", "42", 1.0),  # leading blank lines are skipped
        ("42 apples", "42", 0.0),
    ],
)
def test_exact_match(response, ground_truth, expected):
    assert score(exact_match, response, ground_truth) == expected


def test_exact_match_options():
    assert score(exact_match, "Paris", "paris", case_sensitive=True) == 0.0
    assert score(exact_match, "42.0", "42", numeric=False) == 0.0
    assert score(exact_match, "42<|im_end|>junk", "42", stop_strings=["\n", "<|im_end|>"]) == 1.0
    assert score(exact_match, "4\n2", "4\n2", stop_strings=[]) == 1.0
