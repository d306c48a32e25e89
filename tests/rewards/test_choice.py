"""The multiple_choice reward: the right option and no other, read as words of the first line."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rltk.rewards.verifiable.choice import MAX_ANSWER_CHARS, multiple_choice

COLOURS = {"choices": ["red", "green", "blue"]}


def score(response, truth="red", extras=COLOURS, **args):
    return multiple_choice(prompt="Colour?", response=response, ground_truth=truth, extras=extras, **args)


@pytest.mark.parametrize("response", ["red", " Red.", "RED!", "it is red", "red\ngreen blue", "red, red", "\n red"])
def test_naming_the_truth_alone_on_the_first_line_scores_one(response):
    assert score(response) == 1.0


@pytest.mark.parametrize("response", ["green", "red green", "blue or red", "", "green\nred", "reddish", "re d", "r"])
def test_a_wrong_option_a_hedge_or_no_option_scores_zero(response):
    assert score(response) == 0.0


def test_configured_choices_win_over_the_rows_and_without_any_other_words_are_free():
    assert score("red green", choices=["red", "blue"]) == 1.0  # green is no option here
    assert score("red blue", choices=["red", "blue"]) == 0.0
    assert score("red green", extras={}) == 1.0  # options: the truth alone
    assert score("green", extras={}) == 0.0


def test_an_option_of_several_words_must_appear_as_those_words_in_order():
    extras = {"choices": ["light blue", "blue"]}
    assert score("Light blue.", truth="light blue", extras=extras) == 1.0
    assert score("blue light", truth="light blue", extras=extras) == 0.0
    # "light blue" contains the option "blue": naming the longer one names the shorter one too, a hedge.
    assert score("light blue", truth="blue", extras=extras) == 0.0
    assert score("blue", truth="blue", extras=extras) == 1.0


def test_only_the_first_characters_of_the_first_line_count():
    assert score(" " * (MAX_ANSWER_CHARS - 3) + "red") == 1.0
    assert score(" " * 5 + "x" * MAX_ANSWER_CHARS + " red") == 0.0
    assert score("", truth="") == 0.0  # an empty truth is never named


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40), st.sampled_from(["red", "green", "blue"]))
def test_the_score_is_one_exactly_when_the_first_line_names_only_the_truth(response, truth):
    line = response.lstrip().split("\n", 1)[0].casefold()
    import re
    words = set(re.findall(r"[^\W_]+", line))
    expected = float(truth in words and not (words & (set(COLOURS["choices"]) - {truth})))
    assert score(response, truth=truth) == expected
