import time

import pytest

from rltk.rewards.verifiable.format import format_tags, layout_pattern

from tests.waits import scaled


def score(response, **args):
    return format_tags(prompt="", response=response, ground_truth="", extras={}, **args)


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<think>3+5=8</think><answer>16</answer>", 1.0),
        ("\n<think>\nstep 1\nstep 2\n</think>\n\n<answer> 16 </answer>\n", 1.0),
        ("<think></think><answer></answer>", 1.0),
        ("<think>a < b</think><answer>x</answer>", 1.0),  # '<' inside content is fine
        ("<answer>16</answer>", 0.0),  # no think block
        ("<answer>16</answer><think>x</think>", 0.0),  # wrong order
        ("<think>x</think><answer>1</answer><answer>2</answer>", 0.0),  # two answers
        ("<think>x</think><think>y</think><answer>1</answer>", 0.0),
        ("<think>x</think><answer>16</answer> and more", 0.0),  # text after the layout
        ("Sure! <think>x</think><answer>16</answer>", 0.0),  # text before it
        ("<think>x</think>middle<answer>16</answer>", 0.0),
        ("<think>x<answer>16</answer></think>", 0.0),  # nested
        ("<think>x</think><answer>16", 0.0),  # unclosed
        ("", 0.0),
    ],
)
def test_think_answer_layout(response, expected):
    assert score(response) == expected


def test_configurable_tags():
    assert score("<answer>16</answer>", tags=["answer"]) == 1.0
    assert score("<reasoning>r</reasoning> <answer>a</answer>", tags=("reasoning", "answer")) == 1.0
    assert score("<think>x</think><answer>16</answer>", tags=["answer"]) == 0.0  # think is not in the layout


def test_custom_pattern_must_match_in_full():
    assert score("steps...\n#### 42", pattern=r".*\n#### -?\d+") == 1.0
    assert score("steps...\n#### 42 extra", pattern=r".*\n#### -?\d+") == 0.0


def test_invalid_tag_names_are_named():
    with pytest.raises(ValueError, match=r"tag name 'a>b' is not valid"):
        score("x", tags=["a>b"])
    assert layout_pattern(("a-b",)) == r"\s*<a\-b>.*?</a\-b>\s*"


def test_hostile_responses_are_fast():
    start = time.perf_counter()
    assert score("<think>" * 100_000 + "</think>" * 100_000 + "<answer>x</answer>") == 0.0
    assert score("<think>" + "x" * 1_000_000 + "</think><answer>1</answer>", max_chars=2_000_000) == 1.0
    assert score("<think>x</think><answer>1</answer>" + " " * 200_000) == 0.0  # over max_chars
    assert time.perf_counter() - start < scaled(2.0)
