"""The Countdown reward: does the response's equation use the given numbers and hit the target?

Countdown as in TinyZero (Pan et al. 2025, github.com/Jiayi-Pan/TinyZero),
itself after the numbers round of the TV game: given numbers such as
``[3, 5, 2]`` and a target ``16``, write an arithmetic expression with
``+ - * /`` and parentheses, e.g. ``(3+5)*2``. The default rule is TinyZero's:
every given number exactly once; ``rule="at_most_once"`` allows leaving
numbers out, as in the TV game.

The expression comes from the model, so it is never passed to ``eval``: it is
parsed with :mod:`ast` and only integer literals, ``+ - * /``, unary minus and
parentheses are accepted (``9**9**9`` and ``__import__('os')`` are rejected
before anything is computed). Arithmetic is exact (:class:`fractions.Fraction`),
so ``(1/3)*3`` hits 1 and rounding never turns a miss into a hit.

The work per call is bounded whatever the response's length: the answer is
located with C-speed ``rfind``/``rstrip`` and only its last
:data:`MAX_ANSWER_CHARS` characters are split and parsed; a longer answer
scores 0. Numbers are ASCII digits only (see :mod:`rltk.rewards.verifiable.math`).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction

from rltk.parsing import parse_python
from rltk.rewards.marks import bounded

RULES = ("exactly_once", "at_most_once")
# A Countdown expression over a handful of numbers is a few dozen characters;
# a cap keeps ast.parse away from megabyte-long or deeply nested hostile input.
MAX_EXPRESSION_CHARS = 256
# Longest answer (``<answer>`` content or last line) looked at: an expression
# plus a written-out result and some slack. Longer answers score 0.
MAX_ANSWER_CHARS = 4 * MAX_EXPRESSION_CHARS
# Literals are checked against the given numbers before anything is
# evaluated, so this only bounds what a misconfigured task could ask for.
MAX_LITERAL_DIGITS = 18

_EXPRESSION_CHARS = re.compile(r"[0-9+\-*/().\s]+")

_BINARY_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


class ExpressionError(ValueError):
    """The text is not an arithmetic expression rltk will evaluate."""


def parse_expression(text: str) -> ast.Expression:
    """Parse ``text`` into an AST of integer literals, ``+ - * /``, unary ``-``/``+`` and parentheses.

    Raises :class:`ExpressionError` for anything else (names, calls,
    attribute access, ``**``, ``//``, floats, strings) and for texts longer
    than :data:`MAX_EXPRESSION_CHARS`.
    """
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression is {len(text)} characters, more than {MAX_EXPRESSION_CHARS}")
    if not _EXPRESSION_CHARS.fullmatch(text):
        raise ExpressionError(f"expression {text[:40]!r} contains characters other than digits, + - * / ( )")
    try:
        tree = parse_python(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ExpressionError(f"not a valid expression: {text[:40]!r} ({type(exc).__name__})") from None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Expression, ast.BinOp, ast.UnaryOp, *_BINARY_OPS, ast.USub, ast.UAdd)):
            continue
        if isinstance(node, ast.Constant) and type(node.value) is int:
            if len(str(node.value)) > MAX_LITERAL_DIGITS:
                raise ExpressionError(f"literal with more than {MAX_LITERAL_DIGITS} digits")
            continue
        raise ExpressionError(f"{type(node).__name__} is not allowed in a Countdown expression")
    return tree


def expression_literals(tree: ast.Expression) -> list[int]:
    """The integer literals of a parsed expression, in reading order."""
    literals = [node for node in ast.walk(tree) if isinstance(node, ast.Constant)]
    literals.sort(key=lambda node: (node.lineno, node.col_offset))
    return [node.value for node in literals]


def evaluate_expression(tree: ast.Expression, *, integer_intermediates: bool = False) -> Fraction:
    """The exact value of a parsed expression (see :func:`parse_expression`).

    Raises :class:`ZeroDivisionError` on division by zero, and
    :class:`ExpressionError` with ``integer_intermediates`` on any non-integer
    intermediate result or when nested too deeply to evaluate.
    """

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant):
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp):
            operand = value(node.operand)
            return -operand if isinstance(node.op, ast.USub) else operand
        left, right = value(node.left), value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ZeroDivisionError("division by zero in a Countdown expression")
        result = _BINARY_OPS[type(node.op)](left, right)
        if integer_intermediates and result.denominator != 1:
            raise ExpressionError(f"non-integer intermediate result {result}")
        return result

    try:
        return value(tree.body)
    except RecursionError:
        raise ExpressionError("expression nested too deeply") from None


def extract_expression(response: str) -> str | None:
    """The equation a response proposes, or ``None``.

    The content of the last ``<answer>...</answer>`` if there is one, else
    the last non-empty line. A written-out result is dropped: ``(3+5)*2 = 16``
    and ``16 = (3+5)*2`` both give ``(3+5)*2``. An answer or line longer
    than :data:`MAX_ANSWER_CHARS` gives ``None``.
    """
    # rfind rather than a regex: a response of many unclosed "<answer>" tags
    # would make a lazy regex scan to the end once per tag (quadratic).
    close = response.rfind("</answer>")
    open_ = response.rfind("<answer>", 0, close) if close >= 0 else -1
    if open_ >= 0:
        if close - open_ - len("<answer>") > MAX_ANSWER_CHARS:
            return None
        text = response[open_ + len("<answer>") : close]
    else:
        # The last non-empty line is the last line once trailing whitespace is gone (every line
        # break is whitespace); one character more than an answer may have tells a line too long.
        stripped = response.rstrip()
        if not stripped:
            return None
        text = stripped[-(MAX_ANSWER_CHARS + 1) :].splitlines()[-1]
        if len(text) > MAX_ANSWER_CHARS:
            return None
    sides = [side.strip() for side in text.split("=")]
    if len(sides) > 1:
        operators = [side for side in sides if any(op in side for op in "+-*/")]
        text = operators[0] if operators else sides[0]
    return text.strip() or None


def check_countdown(
    expression: str,
    numbers: list[int],
    target: int | Fraction,
    *,
    rule: str = "exactly_once",
    integer_intermediates: bool = False,
) -> tuple[bool, str]:
    """Whether ``expression`` solves the puzzle, and why not if it does not.

    Returns ``(solved, reason)`` with reason one of ``"ok"``, ``"invalid"``
    (not a safe arithmetic expression), ``"numbers"`` (breaks ``rule``),
    ``"division_by_zero"``, ``"non_integer"`` (an intermediate result is not
    an integer while ``integer_intermediates`` is set) and ``"wrong_value"``.
    """
    if rule not in RULES:
        raise ValueError(f"countdown rule '{rule}' is not valid. Valid: {', '.join(RULES)}")
    try:
        tree = parse_expression(expression)
    except ExpressionError:
        return False, "invalid"
    used, given = Counter(expression_literals(tree)), Counter(int(n) for n in numbers)
    if rule == "exactly_once" and used != given:
        return False, "numbers"
    if rule == "at_most_once" and (not used or any(used[n] > given[n] for n in used)):
        return False, "numbers"
    try:
        result = evaluate_expression(tree, integer_intermediates=integer_intermediates)
    except ZeroDivisionError:
        return False, "division_by_zero"
    except ExpressionError:
        return False, "non_integer"
    return (True, "ok") if result == target else (False, "wrong_value")


@bounded
def countdown(
    *,
    prompt: str,
    response: str,
    ground_truth: str,
    extras: dict,
    format_score: float = 0.0,
    rule: str | None = None,
    integer_intermediates: bool = False,
) -> float:
    """1.0 when the response's equation uses the given numbers by the rule and equals the target.

    The equation is the last ``<answer>...</answer>`` or else the last line
    (see :func:`extract_expression`); the numbers are ``extras["numbers"]``
    and the target is ``ground_truth`` (or ``extras["target"]``). A
    well-formed expression that breaks the number rule, divides by zero or
    misses the target scores ``format_score``; no expression, or anything
    beyond integers, ``+ - * /`` and parentheses, scores 0.0.

    Args:
        format_score: reward for a well-formed but wrong equation.
        rule: ``"exactly_once"`` (TinyZero) or ``"at_most_once"``; default
            ``extras["rule"]`` when the row has one, else ``"exactly_once"``.
        integer_intermediates: require every intermediate result to be an
            integer (the TV game's rule); off by default, as in TinyZero.
    """
    numbers = extras.get("numbers")
    if numbers is None:
        raise KeyError(
            "countdown reward: the row has no extras['numbers'] (the list of given numbers); "
            f"extras keys are {sorted(extras)}. Keep the numbers column with data.extras_keys."
        )
    if isinstance(numbers, str):
        numbers = [int(n) for n in re.findall(r"-?\d+", numbers, flags=re.ASCII)]
    target_text = ground_truth.strip() or str(extras.get("target", "")).strip()
    if not re.fullmatch(r"-?\d{1,18}", target_text, flags=re.ASCII):
        raise ValueError(
            f"countdown reward: the target must be an integer, got ground_truth={ground_truth!r} "
            f"(extras['target']={extras.get('target')!r})"
        )
    target = int(target_text)
    expression = extract_expression(response)
    if expression is None:
        return 0.0
    solved, reason = check_countdown(
        expression, numbers, target,
        rule=rule or extras.get("rule", "exactly_once"),
        integer_intermediates=integer_intermediates,
    )
    if solved:
        return 1.0
    return 0.0 if reason == "invalid" else float(format_score)
