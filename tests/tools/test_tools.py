from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rltk
from rltk.registry import RegistryError
from rltk.tools.base import Tool, ToolArgumentError, schema_from_signature, tool
from rltk.tools.builtin import CalculatorError, calculator, evaluate_arithmetic, format_number


@tool
def add(a: int, b: int = 0, *, modulus: int = 0) -> int:
    """Add two integers.

    Second paragraph, not in the description."""
    return (a + b) % modulus if modulus else a + b


def test_decorator_derives_name_description_and_schema():
    assert add.name == "add" and add.description == "Add two integers."
    assert add.schema() == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a"]}}}
    assert add.configurable() == ["modulus"]
    assert add(a=2, b=3) == "5"  # results are text for the model


def test_decorator_with_arguments():
    @tool(name="shout", description="Upper-case text.")
    def f(text: str) -> str:
        return text.upper()

    assert (f.name, f.description, f(text="hi")) == ("shout", "Upper-case text.", "HI")


def test_bind_sets_configured_arguments_and_refuses_model_ones():
    bound = add.bind(modulus=4)
    assert bound(a=3, b=3) == "2" and add(a=3, b=3) == "6"  # the original is unchanged
    with pytest.raises(ValueError, match="'a' is an argument the model passes"):
        add.bind(a=1)
    with pytest.raises(ValueError, match="has no argument 'mod'. Configurable: modulus"):
        add.bind(mod=1)


@pytest.mark.parametrize("arguments, message", [
    ({}, r"missing required argument\(s\) \['a'\]"),
    ({"a": 1, "c": 2}, r"has no argument\(s\) \['c'\]"),
    ({"a": "1"}, "argument 'a' must be of type integer, got '1'"),
    ({"a": 1.5}, "must be of type integer"),
    ({"a": True}, "must be of type integer, got True"),
])
def test_schema_checks_arguments(arguments, message):
    with pytest.raises(ToolArgumentError, match=message):
        add(**arguments)


def test_number_refuses_nan_and_enum_is_checked():
    t = Tool(lambda x, unit="m": f"{x}{unit}", name="len", description="", parameters={
        "type": "object", "properties": {"x": {"type": "number"}, "unit": {"type": "string", "enum": ["m", "cm"]}},
        "required": ["x"]})
    assert t(x=2.5, unit="cm") == "2.5cm"
    with pytest.raises(ToolArgumentError, match="type number"):
        t(x=float("nan"))
    with pytest.raises(ToolArgumentError, match=r"one of \['m', 'cm'\]"):
        t(x=1, unit="km")


@pytest.mark.parametrize("parameters, message", [
    ({"type": "array"}, "JSON schema of an object"),
    ({"type": "object", "properties": []}, "properties'] must be a dict"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required'] must list names"),
])
def test_bad_schemas_are_refused(parameters, message):
    with pytest.raises(ValueError, match=message):
        Tool(lambda **kw: "", name="t", description="", parameters=parameters)


def test_bad_name_is_refused():
    with pytest.raises(ValueError, match="Tool name"):
        Tool(lambda: "", name="has space", description="", parameters={"type": "object"})


def test_schema_from_untyped_signature():
    def f(x, y=1, *rest, z, **kw):
        return ""
    assert schema_from_signature(f) == {"type": "object", "properties": {"x": {}, "y": {}}, "required": ["x"]}


# ---------------------------------------------------------------- calculator

def test_calculator_is_registered_with_its_schema_and_summary():
    registered = rltk.get_component("tool", "calculator")
    assert registered is calculator
    assert registered.schema()["function"]["parameters"]["required"] == ["expression"]
    entry = next(e for e in rltk.list_components("tool") if e.name == "calculator")
    assert entry.summary.startswith("Evaluate an arithmetic expression")


def test_unknown_tool_name_suggests_the_closest():
    with pytest.raises(RegistryError, match="unknown tool 'calculater'.*Did you mean: 'calculator'"):
        rltk.get_component("tool", "calculater")


@pytest.mark.parametrize("expression, value", [
    ("1+2*3", "7"), ("(1+2)*3", "9"), ("7/2", "3.5"), ("7/2*2", "7"), ("-3--4", "1"), ("2*-(3+4)", "-14"),
    (" 12 * 7 ", "84"), ("1/3", "0.333333"), ("10-2-3", "5"), ("100/10/5", "2"), ("-1/3", "-0.333333"),
])
def test_calculator_hand_values(expression, value):
    assert calculator(expression=expression) == value


@pytest.mark.parametrize("expression, message", [
    ("1/0", "division by zero"), ("2**3", "unexpected '\\*'"), ("__import__('os')", "unsupported character '_'"),
    ("1+", "ends too early"), ("(1+2", "ends too early"), ("1+2)", "unexpected '\\)'"), ("", "empty expression"),
    ("1.5+1", "unsupported character '.'"), ("3 4", "unexpected 4"),
])
def test_calculator_refuses(expression, message):
    with pytest.raises(CalculatorError, match=message):
        calculator(expression=expression)


def test_calculator_bounds_length_magnitude_and_depth():
    with pytest.raises(CalculatorError, match="limit is 200"):
        calculator(expression="1+" * 100 + "1")
    with pytest.raises(CalculatorError, match="magnitude limit 1000"):
        evaluate_arithmetic("999*2", max_abs=1000)
    with pytest.raises(CalculatorError, match="above the limit"):
        evaluate_arithmetic("1" * 30)
    with pytest.raises(CalculatorError, match="nesting deeper than 32"):
        evaluate_arithmetic("(" * 40 + "1" + ")" * 40)
    with pytest.raises(CalculatorError, match="nesting deeper"):
        evaluate_arithmetic("-" * 60 + "1", max_length=100)
    assert calculator.bind(digits=2)(expression="2/3") == "0.67"
    with pytest.raises(CalculatorError, match="limit is 5"):
        calculator.bind(max_length=5)(expression="123456")


def test_format_number():
    assert [format_number(Fraction(v)) for v in ("4", "-1/2", "1/3000000")] == ["4", "-0.5", "0"]


LIMIT = 10**18  # evaluate_arithmetic's default max_abs, on every numerator and denominator it computes


@st.composite
def expressions(draw, depth=0):
    """(text, exact value, or the error the calculator must raise) of a random expression tree.

    The text is fully parenthesised, so each node is one operation the calculator bounds.
    """
    if depth > 3 or draw(st.booleans()):
        n = draw(st.integers(0, 999))
        return str(n), Fraction(n)
    left, lv = draw(expressions(depth=depth + 1))
    right, rv = draw(expressions(depth=depth + 1))
    op = draw(st.sampled_from("+-*/"))
    if isinstance(lv, str) or isinstance(rv, str):
        value = lv if isinstance(lv, str) else rv  # the left operand is evaluated first
    elif op == "/" and rv == 0:
        value = "division by zero"
    else:
        value = {"+": lv + rv, "-": lv - rv, "*": lv * rv, "/": lv / rv if rv else None}[op]
        if abs(value.numerator) > LIMIT or value.denominator > LIMIT:
            value = "magnitude limit"
    return f"({left}{op}{right})", value


@settings(max_examples=200, deadline=None)
@given(expressions())
def test_calculator_matches_exact_arithmetic(case):
    text, value = case
    if isinstance(value, str):
        with pytest.raises(CalculatorError, match=value):
            evaluate_arithmetic(text)
    else:
        assert evaluate_arithmetic(text) == value


def test_a_value_over_the_limit_is_refused_even_when_the_result_is_small():
    # hypothesis found it: 1000081062791293392/521 is about 1.9e15, but its numerator is above 1e18
    with pytest.raises(CalculatorError, match="magnitude limit"):
        evaluate_arithmetic("((((1/521)+(760*832))*(156*(372*987)))*53)")


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_calculator_never_raises_anything_but_its_own_error(text):
    try:
        evaluate_arithmetic(text)
    except CalculatorError:
        pass


def test_rltk_list_shows_the_new_kinds(capsys):
    from rltk.commands.cli import main

    assert main(["list", "tool"]) == 0
    out = capsys.readouterr().out
    assert "calculator" in out and "Evaluate an arithmetic expression" in out
    assert main(["list", "tool_parser"]) == 0
    assert "hermes" in capsys.readouterr().out
    assert main(["list", "environment"]) == 0
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "multi_turn" in out and "calculator" in out
