"""Builtin rewards on hostile model output: huge numbers, huge responses, non-ASCII digits.

The builtins are documented as bounded and safe to call in-process: these
tests hold them to it (every call returns a score, never raises, and costs
the same on 10 MB as on 10 KB).
"""

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rltk.rewards.verifiable import countdown as cd
from rltk.rewards.verifiable import math as rm
from rltk.rewards.verifiable.choice import multiple_choice
from rltk.rewards.verifiable.countdown import countdown, extract_expression
from rltk.rewards.verifiable.format import format_tags
from rltk.rewards.verifiable.math import (
    MAX_ANSWER_CHARS, answers_match, exact_match, extract_boxed, extract_hash_answer, extract_last_number,
    math_answer, parse_number,
)

from tests.waits import scaled

TEN_MB = 10_000_000


def _math(response, truth, **args):
    return math_answer(prompt="", response=response, ground_truth=truth, extras={}, **args)


def _exact(response, truth, **args):
    return exact_match(prompt="", response=response, ground_truth=truth, extras={}, **args)


def _countdown(response, numbers=(3, 5, 2), target="16", **args):
    return countdown(prompt="", response=response, ground_truth=target, extras={"numbers": list(numbers)}, **args)


# ------------------------------------------------------------ numbers beyond a float


def test_309_digit_answer_is_compared_exactly_not_through_a_float():
    huge = "9" * 309  # > 1.8e308: float(Fraction(huge)) raises OverflowError
    assert _math(f"#### {huge}", huge) == 1.0
    assert _math(f"#### {huge}", "1") == 0.0
    assert _math(f"#### {huge}", "9" * 308 + "8") == 1.0  # a gap of 1 in 1e309 is within rel_tol=1e-9
    assert _math(f"#### {huge}", "9" * 308 + "8", rel_tol=0.0) == 0.0
    # 1e308 and 1e308 + 1e297 differ by 1e-11 relatively: within 1e-9, not within 1e-12.
    a, b = "1" + "0" * 308, "1" + "0" * 10 + "1" + "0" * 297
    assert answers_match(a, b, rel_tol=1e-9) and not answers_match(a, b, rel_tol=1e-12)


def test_tolerance_is_inclusive_at_its_boundary():
    # |1 - 2| = 1 = 0.5 * max(1, 2): on the boundary, so equal; any smaller tolerance is not.
    assert answers_match("1", "2", rel_tol=0.5)
    assert not answers_match("1", "2", rel_tol=0.4999)


def test_bad_tolerance_names_the_argument():
    with pytest.raises(ValueError, match="rel_tol must be a finite number >= 0, got nan"):
        _math("#### 1", "2", rel_tol=float("nan"))


def test_numbers_beyond_the_digit_limit_score_zero_without_raising():
    big = "9" * (rm.MAX_NUMBER_CHARS + 1)
    assert parse_number(big) is None
    assert _math(f"#### {big}", "9") == 0.0
    assert _exact(big, "9") == 0.0


# ------------------------------------------------------------ bounded work on any size

# Built when used (10 MB each), so collecting the tests holds none of them.
HOSTILE = {
    "digits and spaces": lambda: "1 " * (TEN_MB // 2),
    "one long number": lambda: "1" * TEN_MB,
    "dotted digits": lambda: "1." * (TEN_MB // 2),
    "newlines": lambda: "1\n" * (TEN_MB // 2),
    "equals and operators": lambda: "=+" * (TEN_MB // 2),
    "open braces after a box": lambda: "\\boxed{" + "{" * TEN_MB,
    "long hash line": lambda: "#### " + "7" * TEN_MB,
    "answer tags": lambda: "<answer>" + "1=+" * (TEN_MB // 3) + "</answer>",
    "unclosed answer tags": lambda: "<answer>" * (TEN_MB // 8),
    "whitespace": lambda: " " * TEN_MB,
}

REWARDS = {
    "exact_match": lambda r: _exact(r, "16"),
    "exact_match no stop": lambda r: _exact(r, "16", stop_strings=[]),
    "math_answer": lambda r: _math(r, "16"),
    "math_answer flexible": lambda r: _math(r, "16", flexible=True),
    "countdown": lambda r: _countdown(r),
    "format_tags": lambda r: format_tags(prompt="", response=r, ground_truth="", extras={}),
    "multiple_choice": lambda r: multiple_choice(prompt="", response=r, ground_truth="16",
                                                 extras={"choices": ["16", "61"]}),
}


@pytest.mark.parametrize("reward", list(REWARDS))
def test_a_10mb_response_scores_in_well_under_a_second(reward):
    fn = REWARDS[reward]
    for shape, build in HOSTILE.items():
        response = build()
        start = time.perf_counter()
        score = fn(response)
        elapsed = time.perf_counter() - start
        assert score == 0.0, (reward, shape)
        # Before the caps, countdown took ~3 s and math_answer ~1.3 s on some of these shapes; a capped
        # call is a few C-speed scans (~10 ms here), so 0.5 s leaves room for a loaded machine.
        assert elapsed < scaled(0.5), f"{reward} took {elapsed:.2f} s on a 10 MB response of {shape}"


def test_a_correct_answer_after_10mb_of_text_is_still_found():
    junk = "x " * (TEN_MB // 2)
    assert _math(junk + "\n#### 16", "16") == 1.0
    assert _math(junk + "so \\boxed{16}.", "16") == 1.0
    assert _math(junk + " the answer is 16", "16", flexible=True) == 1.0
    assert _countdown(junk + "\n(3+5)*2") == 1.0
    assert _countdown(junk + "<answer>(3+5)*2</answer>") == 1.0
    assert _exact("16\n" + junk, "16") == 1.0


def test_answers_longer_than_the_cap_score_zero():
    long_answer = "1" * (MAX_ANSWER_CHARS + 1)
    assert extract_boxed("\\boxed{" + long_answer + "}") is None
    assert extract_boxed("\\boxed{" + long_answer[:-1] + "}") == long_answer[:-1]  # exactly the cap is read
    assert extract_boxed("\\boxed " + long_answer) is None
    assert extract_hash_answer("#### " + long_answer) is None
    assert extract_hash_answer("####" + long_answer[:-1] + "</answer>" + "z" * 50) == long_answer[:-1]
    assert _exact("a" * (MAX_ANSWER_CHARS + 1), "a" * (MAX_ANSWER_CHARS + 1)) == 0.0
    assert _exact("a" * MAX_ANSWER_CHARS, "a" * MAX_ANSWER_CHARS) == 1.0
    # A stop string that starts within the cap still cuts the line there.
    text = "b" * (MAX_ANSWER_CHARS - 2) + "<|im_end|>" + "c" * 100
    assert _exact(text, "b" * (MAX_ANSWER_CHARS - 2), stop_strings=["<|im_end|>"]) == 1.0
    assert extract_expression("<answer>" + " " * cd.MAX_ANSWER_CHARS + "1+2</answer>") is None
    assert extract_expression("x\n" + " " * cd.MAX_ANSWER_CHARS + "1+2") is None


def _last_number_scanning_everything(text):
    """The unbounded definition: the last regex match over the whole text."""
    last = None
    for last in re.finditer(r"-?[0-9][0-9,]*(?:\.[0-9]+)?", text):
        pass
    return last.group(0).rstrip(",") if last else None


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789.,- ax\n", max_size=60))
def test_bounded_last_number_equals_the_full_scan(text):
    assert extract_last_number(text) == _last_number_scanning_everything(text)


def test_bounded_last_number_equals_the_full_scan_up_to_the_cap():
    # Runs of number characters exactly as long as the cap, which the full scan splits in different ways.
    for prefix in ("", "1.", "-", "12,3"):
        run = prefix + "4" * (MAX_ANSWER_CHARS - len(prefix) - 2) + ".5"
        assert len(run) == MAX_ANSWER_CHARS
        text = "y " * 10 + run + " , ."
        assert extract_last_number(text) == _last_number_scanning_everything(text) is not None
    # One character longer, the run is refused (documented), and so is one with no start in sight.
    assert extract_last_number("y 1" + run) is None
    assert extract_last_number("1" * (MAX_ANSWER_CHARS + 5)) is None


def _expression_reading_every_line(response):
    """extract_expression's unbounded definition (the last non-empty line), for comparison."""
    close = response.rfind("</answer>")
    open_ = response.rfind("<answer>", 0, close) if close >= 0 else -1
    if open_ >= 0:
        text = response[open_ + len("<answer>") : close]
    else:
        lines = [line for line in response.splitlines() if line.strip()]
        if not lines:
            return None
        text = lines[-1]
    sides = [side.strip() for side in text.split("=")]
    if len(sides) > 1:
        operators = [side for side in sides if any(op in side for op in "+-*/")]
        text = operators[0] if operators else sides[0]
    return text.strip() or None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["1", "+", "=", " ", "\n", "\r", "\x0b", "\x1c", "\u2028", "\t",
                                 "<answer>", "</answer>", "x"]), max_size=40).map("".join))
def test_bounded_expression_equals_reading_every_line(response):
    assert extract_expression(response) == _expression_reading_every_line(response)


# ------------------------------------------------------------ Unicode digits


@pytest.mark.parametrize("digits", ["٤٢", "４２", "۴۲", "4٢"])  # Arabic-Indic, fullwidth, Persian, mixed
def test_non_ascii_digits_are_not_numbers(digits):
    assert int(digits) == 42  # what Python would do if the rewards let it
    assert parse_number(digits) is None
    assert _exact(digits, "42") == 0.0
    assert _math(f"#### {digits}", "42") == 0.0
    assert _math(f"the answer is {digits}", "42", flexible=True) == 0.0
    assert extract_last_number(f"answer: {digits}") == ("4" if digits == "4٢" else None)
    # Compared as strings, they still match a ground truth written the same way.
    assert _exact(digits, digits) == 1.0
    assert _math(f"#### {digits}", digits) == 1.0


def test_non_ascii_digits_in_countdown_are_not_numbers():
    assert _countdown("(３+5)*2") == 0.0
    with pytest.raises(ValueError, match="the target must be an integer"):
        _countdown("(3+5)*2", target="١٦")
    assert countdown(prompt="", response="(3+5)*2", ground_truth="16",
                     extras={"numbers": "3 5 2 ٧"}) == 1.0  # the non-ASCII "7" is not a given number
