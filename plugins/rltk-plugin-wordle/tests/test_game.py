"""The Wordle rules, environment, tool and task on hand-derived cases and properties."""

from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

import rltk
from rltk.environments.base import AssistantTurn, check_step_result
from rltk_plugin_wordle import WORDS, Wordle, candidates, feedback, parse_history, wordle_candidates, wordle_task


def test_registered_through_entry_point():
    assert rltk.get_component("environment", "wordle") is Wordle
    assert rltk.get_component("tool", "wordle_candidates") is wordle_candidates
    plugins = {e.name: e.plugin for e in rltk.list_components("environment")}
    assert plugins["wordle"] == "rltk-plugin-wordle:wordle"


@pytest.mark.parametrize("secret, guess, marks", [
    ("crane", "crane", "GGGGG"),
    ("crane", "nacre", "YYYYG"),   # every letter present, only e in place
    ("crane", "slate", "--G-G"),
    ("crane", "trace", "-GGYG"),   # c: not at 3, but the secret's c (pos 0) is unmatched -> Y
    ("abbey", "kebab", "-YGYY"),   # two b's in the secret: the green one and one yellow
    ("speed", "erase", "Y--YY"),   # e twice in each: both yellow
    ("abbey", "bbbbb", "-GG--"),   # only the secret's two b's are marked, both green
    ("crane", "eeeee", "----G"),   # one e in the secret: the green one uses it up
])
def test_feedback_hand_cases(secret, guess, marks):
    assert feedback(secret, guess) == marks


def test_feedback_refuses_lengths_that_differ():
    with pytest.raises(ValueError, match="same length, got 5 and 4"):
        feedback("crane", "cran")


word = st.text(alphabet="abcde", min_size=5, max_size=5)


@settings(max_examples=200, deadline=None)
@given(word, word)
def test_feedback_marks_each_letter_as_often_as_both_words_hold_it(secret, guess):
    marks = feedback(secret, guess)
    assert feedback(secret, secret) == "GGGGG"
    assert all((m == "G") == (s == g) for s, g, m in zip(secret, guess, marks))
    marked = Counter(g for g, m in zip(guess, marks) if m != "-")
    held_s, held_g = Counter(secret), Counter(guess)
    assert marked == Counter({c: min(held_s[c], held_g[c]) for c in held_g if min(held_s[c], held_g[c])})


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(WORDS), st.lists(st.sampled_from(WORDS), min_size=1, max_size=4))
def test_the_secret_is_always_a_candidate_and_every_candidate_explains_the_history(secret, guesses):
    history = [(g, feedback(secret, g)) for g in guesses]
    found = candidates(history, WORDS)
    assert secret in found
    assert all(feedback(w, g) == m for w in found for g, m in history)


def test_words_are_distinct_five_letter_lowercase():
    assert len(set(WORDS)) == len(WORDS) >= 50
    assert all(len(w) == 5 and w.isascii() and w.isalpha() and w.islower() for w in WORDS)


def turn(text, index=0):
    return AssistantTurn(text=text, index=index)


def test_episode_rewards_telescope_to_the_best_fraction_of_greens():
    env = Wordle()
    assert env.reset({"prompt": "wordle", "ground_truth": "Crane", "id": "r0"}) == [
        {"role": "user", "content": "wordle"}]
    steps = [check_step_result(env.step(turn(t, i)), "wordle") for i, t in enumerate(
        ["slate", "brick", "trace", " xy\n", "CRANE"])]
    # slate --G-G: 2 greens -> 2/5; brick -G-Y-: 1 green, none new -> 0; trace -GGYG: 3 greens, one more -> 1/5;
    # "xy": invalid -> -0.1; crane: 5 greens, two more -> 2/5, solved
    assert [s.reward for s in steps] == pytest.approx([0.4, 0.0, 0.2, -0.1, 0.4])
    assert [s.observation[0]["content"] for s in steps] == [
        "slate --G-G", "brick -G-Y-", "trace -GGYG", "invalid xy: guess 5 letters a-z", "crane GGGGG"]
    assert [s.done for s in steps] == [False] * 4 + [True]
    assert steps[-1].info == {"guess": "crane", "marks": "GGGGG", "valid": True, "solved": True}
    assert steps[3].info["valid"] is False
    assert sum(s.reward for s in steps) == pytest.approx(1.0 - 0.1)


def test_episode_ends_unsolved_after_max_guesses():
    env = Wordle(max_guesses=2, invalid_reward=-0.5)
    env.reset({"ground_truth": "crane"})
    first, second = env.step(turn("slate")), env.step(turn("toolong"))
    assert (first.done, second.done) == (False, True)
    assert second.reward == -0.5 and second.info["solved"] is False


def test_opening_defaults_and_messages():
    env = Wordle()
    assert env.reset({"ground_truth": "abc"}) == [{"role": "user", "content": "wordle 3"}]
    messages = [{"role": "system", "content": "play"}, {"role": "user", "content": "go"}]
    assert env.reset({"ground_truth": "abc", "messages": messages}) == messages


@pytest.mark.parametrize("args, message", [
    ({"max_guesses": 0}, "env.environment_args.max_guesses must be an integer >= 1, got 0"),
    ({"max_guesses": True}, "env.environment_args.max_guesses"),
    ({"invalid_reward": "low"}, "env.environment_args.invalid_reward must be a number, got 'low'"),
])
def test_bad_environment_args_name_the_key(args, message):
    with pytest.raises(ValueError, match=message):
        Wordle(**args)


@pytest.mark.parametrize("truth", ["", "cr4ne", None])
def test_a_row_without_a_word_is_an_error_naming_the_row(truth):
    with pytest.raises(ValueError, match=r"row 'r7' needs a ground_truth of letters a-z"):
        Wordle().reset({"ground_truth": truth, "id": "r7"})


def test_candidates_tool_hand_case():
    # slate --G-G: a at 2, e at 4, no s, l or t: brave, crane and grape in the list (whale and blade hold an l)
    assert wordle_candidates(history="slate --G-G") == "brave crane grape"
    assert wordle_candidates.bind(limit=2)(history="slate --G-G") == "brave crane (+1 more)"
    assert wordle_candidates(history="slate --G-G; brave -GG-G") == "crane grape"
    small = wordle_candidates.bind(words=["plate", "whale", "blade", "CRANE"])
    assert small(history="slate -GG-G") == "blade"
    assert small(history="slate GGGGG") == "none"
    assert wordle_candidates.schema()["function"]["parameters"]["required"] == ["history"]
    assert wordle_candidates.configurable() == ["words", "limit"]


@pytest.mark.parametrize("history, message", [
    ("crane", "entry 1 'crane' must be a guess and its marks"),
    ("crane -G-; ", "entry 1 'crane -G-': the guess must be letters a-z and the marks as many of G, Y and -"),
    ("slate --G-G; cr4ne -----", "entry 2"),
    (" ; ", "history is empty"),
])
def test_malformed_history_says_which_entry(history, message):
    with pytest.raises(ValueError, match=message):
        parse_history(history)


def test_candidates_tool_refuses_a_bad_limit():
    with pytest.raises(ValueError, match="env.tools_args.wordle_candidates.limit must be an integer >= 1, got 0"):
        wordle_candidates.bind(limit=0)(history="slate --G-G")


def test_task_splits_never_share_a_word_and_follow_the_seed():
    train = wordle_task("train", 400, seed=1)
    test = wordle_task("test", 100, seed=1)
    assert {r["ground_truth"] for r in train}.isdisjoint(r["ground_truth"] for r in test)
    assert {r["ground_truth"] for r in test} <= set(WORDS[::5])
    assert train == wordle_task("train", 400, seed=1) and train != wordle_task("train", 400, seed=2)
    assert train[0]["prompt"] == "wordle" and train[0]["id"] == "wordle-train-1-0" and len(train) == 400
    assert wordle_task("heldout", 100, seed=1) == test  # the held-out split under another name


@pytest.mark.parametrize("call, message", [
    (lambda: wordle_task("valid", 4, 0), "split must be 'train' or 'test' .*got 'valid'"),
    (lambda: wordle_task("train", -1, 0), "must be an integer >= 0, got -1"),
    (lambda: wordle_task("train", 4, 0, words=["ok", "no way"]), "data.task_args.words: every word must be letters"),
    (lambda: wordle_task("test", 4, 0, words=[]), "the test split is empty"),
])
def test_task_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()
