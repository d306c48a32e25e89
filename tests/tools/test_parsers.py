import json

from hypothesis import given, settings
from hypothesis import strategies as st

import rltk
from rltk.tools.base import ToolCall
from rltk.tools.parsers import HermesToolParser

parse = HermesToolParser().parse


def block(payload) -> str:
    return "<tool_call>" + (payload if isinstance(payload, str) else json.dumps(payload)) + "</tool_call>"


def test_registered_as_hermes():
    assert rltk.get_component("tool_parser", "hermes") is HermesToolParser


def test_one_call_and_the_text_around_it():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'
    content, calls, error = parse(text)
    assert content == "Let me compute."
    assert calls == [ToolCall("calculator", {"expression": "12*7"}, "call_0")]
    assert error is None


def test_two_calls_keep_order_and_ids():
    text = block({"name": "a", "arguments": {"x": 1}}) + " and " + block({"name": "b", "arguments": {}})
    content, calls, error = parse(text)
    assert [(c.name, c.arguments, c.id) for c in calls] == [("a", {"x": 1}, "call_0"), ("b", {}, "call_1")]
    assert content == "and" and error is None


def test_no_call_is_plain_content():
    assert parse("  the answer is 4 ") == ("the answer is 4", [], None)


def test_arguments_as_json_string_and_missing_arguments():
    _, calls, error = parse(block({"name": "f", "arguments": '{"x": 2}'}) + block({"name": "g"}))
    assert [(c.name, c.arguments) for c in calls] == [("f", {"x": 2}), ("g", {})] and error is None


def test_malformed_json_is_an_error_not_an_exception():
    content, calls, error = parse('hi ' + block('{"name": "f", "arguments": {x}}'))
    assert calls == [] and content == "hi"
    assert error.startswith("tool call 1 is not valid JSON")


def test_missing_name_and_non_dict_arguments_and_non_object():
    assert "has no tool name" in parse(block({"arguments": {}}))[2]
    assert "has no tool name" in parse(block({"name": "  ", "arguments": {}}))[2]
    assert "arguments must be a JSON object, got list" in parse(block({"name": "f", "arguments": [1, 2]}))[2]
    assert "must be a JSON object with 'name'" in parse(block("[1, 2]"))[2]
    assert "arguments are a string that is not JSON" in parse(block({"name": "f", "arguments": "{oops"}))[2]


def test_good_calls_survive_a_bad_one_and_the_first_error_is_reported():
    _, calls, error = parse(block({"name": "ok", "arguments": {}}) + block("{bad") + block({"arguments": {}}))
    assert [c.name for c in calls] == ["ok"]
    assert error.startswith("tool call 2 ")


def test_unclosed_call_is_an_error_and_its_text_is_not_content():
    content, calls, error = parse('answer <tool_call>{"name": "calculator", "argu')
    assert calls == [] and content == "answer"
    assert "has no closing </tool_call>" in error


def test_custom_tags():
    parser = HermesToolParser(start="[CALL]", end="[/CALL]")
    _, calls, error = parser.parse('[CALL]{"name": "f", "arguments": {}}[/CALL]')
    assert calls[0].name == "f" and error is None


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                       max_size=3), max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_text_parses_without_raising(text):
    content, calls, error = parse(text)
    assert isinstance(content, str) and isinstance(calls, list) and (error is None or isinstance(error, str))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
                          st.dictionaries(st.from_regex(r"[a-z]{1,5}", fullmatch=True), json_values, max_size=3)),
                max_size=4),
       st.lists(st.text(alphabet=st.characters(blacklist_characters="<>"), max_size=20), min_size=5, max_size=5))
def test_well_formed_calls_round_trip_and_content_is_the_rest(calls, fillers):
    text = fillers[0]
    for index, (name, arguments) in enumerate(calls):
        text += block({"name": name, "arguments": arguments}) + fillers[index + 1]
    content, parsed, error = parse(text)
    assert error is None
    assert [(c.name, c.arguments, c.id) for c in parsed] == [(n, a, f"call_{i}") for i, (n, a) in enumerate(calls)]
    assert content == "".join(fillers[: len(calls) + 1]).strip()
