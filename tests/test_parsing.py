"""rltk's run-time parses of Python source are never refused because another thread parses beside them.

CPython 3.11 keeps the AST constructor's recursion depth per interpreter (python/cpython#106905): a parse
that another thread's parse interleaves with fails with ``SystemError: AST constructor recursion depth
mismatch`` (issue 60: an `rltk run` in a test failed so). The harness here makes the interleaving as likely as
CPython allows: another thread parses a large source over and over, collections run every few dozen
allocations and free objects whose finalizer runs Python code (where the GIL can change hands), and the
thread switch interval is a microsecond. Unguarded, about one parse in three of the large source failed
here; every rltk site that parses at run time is driven under it.
"""

from __future__ import annotations

import ast
import gc
import sys
import threading

import pytest

from rltk.dashboard import schema
from rltk.parsing import parse_python
from rltk.rewards.programs.assert_tests import compile_test
from rltk.rewards.verifiable.countdown import parse_expression
from tests.waits import scaled

SOURCE = "x = " + "(" * 50 + "1" + ")" * 50 + "\n" + "def f(a, b):\n    return [a + b for _ in range(3)]\n" * 200
TESTS = "\n".join(f"assert add({i}, [{i}, ({i}, {i})]) == {{'k': [{i}, {i}]}}" for i in range(60))
EXPRESSION = "+".join(f"(({i}*{i})-({i}/{i}))" for i in range(1, 17))  # 250 characters: near the cap


class _Cycle:
    """Garbage only the collector frees, whose finalizer runs Python code (where the GIL can change hands)."""

    def __init__(self):
        self.me = self

    def __del__(self):
        sum(range(50))


@pytest.fixture
def another_thread_parsing():
    """Another thread parsing :data:`SOURCE` with plain ``ast.parse`` until the test ends; yields the
    ``SystemError`` s it met (what an unguarded parse meets)."""
    thresholds, interval = gc.get_threshold(), sys.getswitchinterval()
    gc.set_threshold(50, 5, 5)
    sys.setswitchinterval(1e-6)
    stop, errors = threading.Event(), []

    def parse_beside():
        while not stop.is_set():
            [_Cycle() for _ in range(50)]
            try:
                ast.parse(SOURCE)
            except SystemError as exc:
                errors.append(exc)

    thread = threading.Thread(target=parse_beside, daemon=True)
    thread.start()
    try:
        yield errors
    finally:
        stop.set()
        thread.join(scaled(60))
        gc.set_threshold(*thresholds)
        sys.setswitchinterval(interval)


def _at_depth(depth: int, call):
    """``call()`` ``depth`` frames deeper than here (a parse deep in a run's stack, as in the failure)."""
    return call() if depth == 0 else _at_depth(depth - 1, call)


@pytest.mark.parametrize("site", ["parse_python", "countdown", "assert_tests", "dashboard_schema"])
def test_a_parse_at_run_time_survives_another_thread_parsing_beside_it(another_thread_parsing, site):
    parse = {"parse_python": lambda: parse_python(SOURCE),
             "countdown": lambda: parse_expression(EXPRESSION),
             "assert_tests": lambda: compile_test(TESTS),
             "dashboard_schema": schema._field_comments.__wrapped__}[site]
    for _ in range(400 if site == "countdown" else 40):  # a small tree is seldom interleaved: more tries
        [_Cycle() for _ in range(50)]
        result = _at_depth(40, parse)
    assert result  # and it was the real answer, not an empty one
    if site == "assert_tests":
        assert len(result.probes) == 60
    if site == "dashboard_schema":
        assert result == schema._field_comments()


def test_parse_python_is_ast_parse():
    source = "def f(x):\n    return x + 1  # one\n"
    assert ast.dump(parse_python(source, "f.py")) == ast.dump(ast.parse(source, "f.py"))
    assert ast.dump(parse_python("1 + 2", mode="eval")) == ast.dump(ast.parse("1 + 2", mode="eval"))
    with pytest.raises(SyntaxError):
        parse_python("def (")
    assert gc.isenabled()  # the collector is back on after a parse, even one that failed
