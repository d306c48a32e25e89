"""Builtin tools: ``calculator``."""

from __future__ import annotations

import operator
from fractions import Fraction

import rltk
from rltk.tools.base import tool

_OPERATORS = "+-*/"
_DIGITS = "0123456789"  # str.isdigit() also accepts superscripts and other scripts' digits


class CalculatorError(ValueError):
    """An expression the calculator refuses (syntax, size, division by zero)."""


def evaluate_arithmetic(expression: str, *, max_length: int = 200, max_abs: int = 10**18,
                        max_depth: int = 32) -> Fraction:
    """The exact value of an integer arithmetic expression, without ``eval``.

    Grammar (recursive descent; whitespace ignored)::

        expr   := term (("+" | "-") term)*
        term   := factor (("*" | "/") factor)*
        factor := ("+" | "-") factor | INT | "(" expr ")"

    Values are exact fractions, so ``7/2*2`` is ``7``. Raises
    :class:`CalculatorError` for anything else: another character, a
    syntax error, an expression longer than ``max_length`` characters,
    parentheses nested deeper than ``max_depth``, an intermediate value
    (numerator or denominator) above ``max_abs`` in magnitude, and division by
    zero. These bounds cap the work of any input: no exponentiation, no
    names, no calls.
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > max_length:
        raise CalculatorError(f"expression is {len(expression)} characters long; the limit is {max_length}")
    tokens = _tokens(expression, max_abs)
    parser = _Parser(tokens, max_abs, max_depth)
    value = parser.expr(0)
    if parser.pos != len(tokens):
        raise CalculatorError(f"unexpected {tokens[parser.pos]!r} at token {parser.pos + 1}")
    return value


def _tokens(text: str, max_abs: int) -> list:
    tokens: list = []
    i = 0
    while i < len(text):
        char = text[i]
        if char.isspace():
            i += 1
        elif char in _DIGITS:
            j = i
            while j < len(text) and text[j] in _DIGITS:
                j += 1
            if j - i > len(str(max_abs)):  # checked before int(): no giant conversions
                raise CalculatorError(f"number {text[i:j][:20]}... is above the limit {max_abs}")
            tokens.append(int(text[i:j]))
            i = j
        elif char in _OPERATORS or char in "()":
            tokens.append(char)
            i += 1
        else:
            raise CalculatorError(f"unsupported character {char!r}; use integers, + - * / and parentheses")
    if not tokens:
        raise CalculatorError("empty expression")
    return tokens


def _divide(left: Fraction, right: Fraction) -> Fraction:
    if right == 0:
        raise CalculatorError("division by zero")
    return left / right


_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": _divide}


class _Parser:
    def __init__(self, tokens: list, max_abs: int, max_depth: int):
        self.tokens, self.pos, self.max_abs, self.max_depth = tokens, 0, max_abs, max_depth

    def peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self):
        token = self.peek()
        if token is None:
            raise CalculatorError("expression ends too early")
        self.pos += 1
        return token

    def bounded(self, value: Fraction) -> Fraction:
        if abs(value.numerator) > self.max_abs or value.denominator > self.max_abs:
            raise CalculatorError(f"a value exceeds the magnitude limit {self.max_abs}")
        return value

    def expr(self, depth: int) -> Fraction:
        return self.left_to_right(depth, ("+", "-"), self.term)

    def term(self, depth: int) -> Fraction:
        return self.left_to_right(depth, ("*", "/"), self.factor)

    def left_to_right(self, depth: int, operators: tuple[str, ...], operand) -> Fraction:
        """``operand (op operand)*`` for the ``operators`` of one precedence level, applied left to right."""
        value = operand(depth)
        while self.peek() in operators:
            op = self.take()
            value = self.bounded(_APPLY[op](value, operand(depth)))
        return value

    def factor(self, depth: int) -> Fraction:
        if depth > self.max_depth:
            raise CalculatorError(f"nesting deeper than {self.max_depth}")
        token = self.take()
        if token in ("+", "-"):
            value = self.factor(depth + 1)
            return -value if token == "-" else value
        if token == "(":
            value = self.expr(depth + 1)
            if self.take() != ")":
                raise CalculatorError("a '(' has no matching ')'")
            return value
        if isinstance(token, int):
            return self.bounded(Fraction(token))
        raise CalculatorError(f"unexpected {token!r}")


def format_number(value: Fraction, digits: int = 6) -> str:
    """An integer as itself; any other fraction as a decimal rounded to ``digits`` places, trailing zeros cut."""
    if value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.{digits}f}".rstrip("0").rstrip(".")
    return text if text not in ("-0", "") else "0"


@tool(parameters={
    "type": "object",
    "properties": {"expression": {"type": "string",
                                  "description": "integers with + - * / and parentheses, e.g. (12+7)*3"}},
    "required": ["expression"],
})
def calculator(expression: str, *, max_length: int = 200, max_abs: int = 10**18, digits: int = 6) -> str:
    """Evaluate an arithmetic expression of integers with + - * / and parentheses; returns the exact value.

    A safe evaluator (no ``eval``): see :func:`evaluate_arithmetic` for the
    grammar and the bounds. Configurable (``env.tools_args.calculator``):
    ``max_length`` characters, ``max_abs`` magnitude of any value, ``digits``
    decimals of a non-integer result. A refused expression raises, which the
    workflow shows the model as an error observation.
    """
    return format_number(evaluate_arithmetic(expression, max_length=max_length, max_abs=max_abs), digits)


@rltk.hookimpl
def rltk_tools():
    return {"calculator": calculator}
