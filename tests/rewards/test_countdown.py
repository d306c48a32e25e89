import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rltk.data.synthetic import countdown as countdown_task
from rltk.rewards.verifiable.countdown import (
    ExpressionError,
    check_countdown,
    countdown,
    evaluate_expression,
    expression_literals,
    extract_expression,
    parse_expression,
)

from tests.waits import scaled

PUZZLE = {"numbers": [3, 5, 2], "target": 16}


def score(response, numbers=(3, 5, 2), target="16", **args):
    extras = args.pop("extras", {"numbers": list(numbers)})
    return countdown(prompt="", response=response, ground_truth=target, extras=extras, **args)


@pytest.mark.parametrize(
    "response",
    [
        "<answer>(3+5)*2</answer>",
        "<think>3+5 is 8, times 2</think>\n<answer> (3 + 5) * 2 </answer>",
        "I think:\n2*(5+3)\n",  # last line, no tags
        "<answer>(3+5)*2 = 16</answer>",
        "<answer>16 = 2*(3+5)</answer>",
        "<answer>1+1</answer> no wait <answer>(3+5)*2</answer>",  # the last answer counts
    ],
)
def test_correct_equations_score_one(response):
    assert score(response) == 1.0


@pytest.mark.parametrize(
    "response, reason",
    [
        ("<answer>(3+3)*2</answer>", "numbers"),  # 3 used twice, 5 unused
        ("<answer>3*5+2*1</answer>", "numbers"),  # 1 is not given
        ("<answer>3+5+2</answer>", "wrong_value"),
        ("<answer>3*(5+2)</answer>", "wrong_value"),
        ("<answer>3/(5-5)</answer>", "numbers"),
    ],
)
def test_wrong_but_well_formed_equations_get_the_format_score(response, reason):
    assert score(response) == 0.0
    assert score(response, format_score=0.1) == 0.1
    assert check_countdown(extract_expression(response), [3, 5, 2], 16)[1] == reason


def test_division_by_zero_is_a_well_formed_miss():
    assert check_countdown("3/(5-5)", [3, 5, 5], 16) == (False, "division_by_zero")
    assert score("<answer>3/(5-5)</answer>", numbers=(3, 5, 5), format_score=0.1) == 0.1


@pytest.mark.parametrize(
    "response",
    [
        "<answer>__import__('os').system('echo pwned')</answer>",
        "__import__('os')",
        "<answer>9**9**9</answer>",
        "<answer>(3+5)**2</answer>",
        "<answer>(3+5)//2</answer>",
        "<answer>(3+5)*2.0</answer>",
        "<answer>(3+5)*2)</answer>",  # unbalanced
        "<answer>((3+5)*2</answer>",
        "<answer>[3, 5, 2]</answer>",
        "<answer>16</answer>" + "\n" * 3,  # no operators: just the target, still must use the numbers
        "",
        "   \n  ",
        "<answer>(3+5)*2",  # unclosed tag: the last line is not an expression
        "<answer>\u0663+5*2</answer>",  # non-ASCII digit
    ],
)
def test_hostile_or_malformed_output_scores_zero(response):
    assert score(response, format_score=0.1) in (0.0, 0.1)
    assert score(response) == 0.0


def test_hostile_output_is_rejected_without_being_computed():
    start = time.perf_counter()
    for response in [
        "<answer>9**9**9**9</answer>",
        "1+" * 500_000 + "1",
        "(" * 100_000 + "1" + ")" * 100_000,
        "<answer>" * 100_000,  # many unclosed tags: must stay linear
        "<answer>" + "-" * 200 + "3</answer>",
        "<answer>99999999999999999999999*99999999999999999999</answer>",
    ]:
        assert score(response) == 0.0
    assert time.perf_counter() - start < scaled(2.0)


def test_parse_expression_rejects_everything_but_arithmetic():
    for text in ["a+1", "f(1)", "1 if 1 else 2", "1<2", "'1'", "1.5", "2**3", "7//2", "7%2", "x.y", "1;2"]:
        with pytest.raises(ExpressionError):
            parse_expression(text)
    tree = parse_expression(" -(3 + 5) * 2 ")
    assert expression_literals(tree) == [3, 5, 2]
    assert evaluate_expression(tree) == -16


def test_arithmetic_is_exact():
    assert score("<answer>(1/3)*3</answer>", numbers=(1, 3, 3), target="1") == 1.0
    assert score("<answer>(1/3)*3</answer>", numbers=(1, 3, 3), target="1", integer_intermediates=True) == 0.0
    assert check_countdown("(1/3)*3", [1, 3, 3], 1, integer_intermediates=True) == (False, "non_integer")
    # a float evaluation would say 0.1+0.2 != 0.3-style things; exact arithmetic does not round
    assert check_countdown("7/3*3", [7, 3, 3], 7) == (True, "ok")


def test_number_rules():
    assert score("<answer>3*5</answer>", target="15") == 0.0  # 2 unused: TinyZero's rule needs all
    assert score("<answer>3*5</answer>", target="15", rule="at_most_once") == 1.0
    extras = {"numbers": [3, 5, 2], "rule": "at_most_once"}
    assert score("<answer>3*5</answer>", target="15", extras=extras) == 1.0
    assert score("<answer>3*3</answer>", target="9", rule="at_most_once") == 0.0  # 3 given once
    with pytest.raises(ValueError, match="rule 'once' is not valid"):
        score("<answer>3*5</answer>", target="15", rule="once")


def test_numbers_and_target_from_extras_and_text():
    assert score("<answer>(3+5)*2</answer>", extras={"numbers": "3, 5, 2"}) == 1.0
    assert countdown(prompt="", response="(3+5)*2", ground_truth="", extras={**PUZZLE}) == 1.0


def test_missing_numbers_and_bad_target_are_named():
    with pytest.raises(KeyError, match=r"no extras\['numbers'\].*extras keys are \['target'\]"):
        score("(3+5)*2", extras={"target": 16})
    with pytest.raises(ValueError, match=r"target must be an integer, got ground_truth='sixteen'"):
        score("(3+5)*2", target="sixteen")


def test_extract_expression():
    assert extract_expression("blah\n<answer> 1+2 </answer>\ntrailing") == "1+2"
    assert extract_expression("first\n\n 4*5 \n\n") == "4*5"
    assert extract_expression("4*5=20") == "4*5"
    assert extract_expression("20=4*5") == "4*5"
    assert extract_expression("") is None


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 10**6))
def test_generated_solutions_always_score_one(seed):
    for row in countdown_task("train", 20, seed, min_numbers=2, max_numbers=5):
        assert countdown(prompt=row["prompt"], response=row["extras"]["solution"],
                         ground_truth=row["ground_truth"], extras=row["extras"]) == 1.0


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="0123456789+-*/() .<>answer=\n", max_size=60))
def test_arbitrary_text_never_raises_and_scores_in_range(response):
    assert score(response, format_score=0.1) in (0.0, 0.1, 1.0)
