"""The multi-turn synthetic tasks and the registered task kind."""

import math
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rltk
from rltk.data.chat import check_messages
from rltk.data.multi_turn_tasks import binary_search_transcript, calculator_arithmetic, guess_number
from rltk.data.synthetic import arithmetic, make_task, sft_examples


def test_builtin_tasks_come_from_the_rltk_entry_point():
    # installed plugins (the wordle example in CI) add their own tasks; only rltk's are checked here
    entries = {e.name: e.plugin for e in rltk.list_components("task") if e.plugin.startswith("rltk:")}
    assert entries == {**{name: "rltk:tasks" for name in
                          ("arithmetic", "countdown", "guess_number", "calculator_arithmetic", "shape_colour")},
                       "verifiers": "rltk:verifiers_environments"}  # a verifiers env's own datasets


def test_unknown_task_names_the_key_and_the_closest_tasks():
    with pytest.raises(ValueError, match=r"unknown task 'guess_numbr' at 'data.task'. Did you mean: 'guess_number'\?"
                                         r" Valid: arithmetic, calculator_arithmetic, countdown, guess_number"):
        make_task("guess_numbr", "train", 2, 0)


def test_a_plugin_task_is_chosen_by_name(fresh_registry):
    def echo(split, size, seed, *, word="hi", **more):
        return [{"prompt": f"{word}{i}", "ground_truth": split, "extras": more, "id": f"echo/{i}"} for i in range(size)]

    plugin = types.ModuleType("echo_tasks")
    plugin.rltk_tasks = rltk.hookimpl(lambda: {"echo": echo})
    plugin.rltk_tasks.__name__ = "rltk_tasks"
    rltk.register_plugin(plugin, "echo_tasks")
    rows = make_task("echo", "test", 2, 0, word="yo", colour="red")  # **more takes any argument
    assert [r["prompt"] for r in rows] == ["yo0", "yo1"] and rows[0]["extras"] == {"colour": "red"}


def test_unknown_task_arguments_list_the_valid_ones():
    with pytest.raises(ValueError, match=r"'guess_number' has no argument\(s\) \['hi'\]. Valid: low, high"):
        make_task("guess_number", "train", 2, 0, hi=9)


def test_config_validation_refuses_an_unknown_task_with_the_closest_name():
    from omegaconf import OmegaConf

    from rltk.config.components import check_task
    from rltk.errors import ConfigError

    cfg = OmegaConf.create({"data": {"path": None, "task": "calculator_arithmetik", "task_args": {}}})
    with pytest.raises(ConfigError, match=r"unknown task 'calculator_arithmetik' at 'data.task'. "
                                          r"Did you mean: 'calculator_arithmetic'"):
        check_task(cfg)
    cfg = OmegaConf.create({"data": {"path": None, "task": "guess_number", "task_args": {"hgh": 9}}})
    with pytest.raises(ConfigError, match=r"'data.task_args.hgh': task 'guess_number' has no argument 'hgh'. "
                                          r"Did you mean: 'high'\?"):
        check_task(cfg)


# ----------------------------------------------------------------- guess_number


def test_binary_search_by_hand():
    assert [m["content"] for m in binary_search_transcript(1, 1, 31)] == [
        "16", "lower", "8", "lower", "4", "lower", "2", "lower", "1"]
    assert [m["content"] for m in binary_search_transcript(16, 1, 31)] == ["16"]
    assert [m["content"] for m in binary_search_transcript(20, 1, 31)] == ["16", "higher", "24", "lower", "20"]


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 200), st.integers(1, 300), st.data())
def test_binary_search_finds_every_secret_within_the_bound_and_is_consistent(low, width, data):
    high = low + width
    secret = data.draw(st.integers(low, high))
    messages = binary_search_transcript(secret, low, high)
    guesses = [int(m["content"]) for m in messages if m["role"] == "assistant"]
    assert guesses[-1] == secret and secret not in guesses[:-1]
    assert len(guesses) <= math.ceil(math.log2(high - low + 2))
    for guess, feedback in zip(guesses, (m["content"] for m in messages if m["role"] == "user")):
        assert feedback == ("higher" if secret > guess else "lower")


def test_guess_number_rows():
    rows = guess_number("train", 40, 3)
    secrets = [r["extras"]["secret"] for r in rows]
    assert sorted(secrets[:31]) == list(range(1, 32))  # every secret once before any repeats
    row = rows[0]
    assert row["messages"] == [{"role": "user", "content": "guess 1-31"}] == row["sft_messages"][:1]
    assert row["ground_truth"] == str(row["extras"]["secret"]) == row["sft_messages"][-1]["content"]
    check_messages(row["sft_messages"], "row")  # a valid transcript
    assert guess_number("train", 40, 3) == rows and guess_number("train", 40, 4) != rows
    held_out = guess_number("eval", 31, 0)
    assert sorted(r["extras"]["secret"] for r in held_out) == list(range(1, 32))
    assert sft_examples(rows[:1]) == [row["sft_messages"]]


@pytest.mark.parametrize("kwargs, message", [
    ({"low": 5, "high": 5}, "need integers 0 <= low < high <= 999"),
    ({"high": 1000}, "got low=1, high=1000"),
])
def test_guess_number_bad_ranges(kwargs, message):
    with pytest.raises(ValueError, match=message):
        guess_number("train", 3, 0, **kwargs)


def test_guess_number_bad_split():
    with pytest.raises(ValueError, match="split='dev' is not valid"):
        guess_number("dev", 3, 0)


# ----------------------------------------------------------------- calculator_arithmetic


def test_calculator_rows_are_the_arithmetic_problems_solved_with_one_call():
    rows = calculator_arithmetic("train", 20, 1)
    plain = arithmetic("train", 20, 1, min_digits=3, max_digits=3)
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in plain]
    row = rows[0]
    a, b = row["extras"]["a"], row["extras"]["b"]
    assert 100 <= a <= 999 and 100 <= b <= 999 and row["ground_truth"] == str(a + b)
    assert row["sft_messages"] == [
        {"role": "user", "content": f"{a}+{b}="},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a}+{b}"}}}]},
        {"role": "tool", "content": str(a + b)},
        {"role": "assistant", "content": str(a + b)},
    ]
    held_out = {r["prompt"] for r in calculator_arithmetic("test", 50, 1)}
    assert not held_out & {r["prompt"] for r in calculator_arithmetic("train", 500, 2)}


def test_calculator_transcripts_fit_the_tiny_context():
    from rltk.data.chat import tokenize_transcript
    from rltk.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer(tool_role=True)
    tool = {"name": "calculator", "parameters": {"properties": {"expression": {}}}}
    for row in calculator_arithmetic("train", 20, 0, operators="+-*"):
        prompt, response, _ = tokenize_transcript(row["sft_messages"], tokenizer, tools=[tool])
        assert len(prompt) + len(response) <= 150  # 3-digit products have 6 digits
    for row in guess_number("train", 31, 0):
        prompt, response, _ = tokenize_transcript(row["sft_messages"], tokenizer)
        assert len(prompt) + len(response) <= 64


def test_a_task_names_its_demonstration_messages_as_a_data_file_does():
    """One name for demonstrations (issue 29): a task's `messages` ending with an assistant turn are split
    into the opening and the warm-up's transcript, exactly as a data file's `messages` column is."""
    import types

    import rltk
    from rltk.data.synthetic import make_task

    demonstration = [{"role": "user", "content": "3 km to m"}, {"role": "assistant", "content": "3000"}]

    def convert_task(split, size, seed):
        return [{"messages": demonstration, "ground_truth": "3000", "extras": {}, "id": "c0"},
                {"messages": demonstration[:1], "ground_truth": "3000", "extras": {}, "id": "c1"}][:size]

    plugin = types.ModuleType("convert_task_plugin")
    plugin.rltk_tasks = rltk.hookimpl(lambda: {"convert_demo": convert_task})
    rltk.register_plugin(plugin, name="convert_task_plugin")
    try:
        split, opening_only = make_task("convert_demo", "train", 2, 0)
    finally:
        rltk.unregister_plugin("convert_task_plugin")
    assert split["messages"] == demonstration[:1] and split["sft_messages"] == demonstration
    assert split["prompt"] == demonstration[:1]  # no prompt given: the opening is the prompt, as in files
    assert opening_only["messages"] == demonstration[:1] and "sft_messages" not in opening_only
