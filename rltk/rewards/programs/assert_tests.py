"""Assert tests judged outside the program: split each test into probes and a check, compare plain data.

A test such as ``assert add(1, 2) == 3`` used to run inside the program's own
interpreter, so a program could fake its verdict (call the harness's reporter,
patch ``AssertionError``, return an object whose ``__eq__`` is always true).
Here the supervisor (the reward worker, outside the sandbox) parses the test
and cuts it in two:

* **probes**: the parts that need the program, ``add(1, 2)``: every maximal
  expression rooted in a name the test does not know itself (a function, class
  or variable of the program), with its arguments. Only probes enter the sandbox;
  they are evaluated after the program, in its namespace, and each value comes
  back as plain data (:mod:`rltk.rewards.programs.plain_data`'s tagged JSON: ``None``, ``bool``,
  ``int``, ``float``, ``complex``, ``str``, ``bytes``, and lists, tuples,
  dicts, sets of those; anything else makes the test an error).
* **the check**: the rest, ``_probe[0] == 3``, with the expected values. It
  never enters the sandbox; the supervisor evaluates it on the decoded values
  with a small set of Python builtins (:data:`SAFE_BUILTINS`) and the
  standard-library modules the test imports (:data:`TEST_MODULES`).

So the program can only influence the *values* of its probes, which is what
solving the task means; it never sees an expected value, and nothing it defines
(an ``__eq__``, a patched builtin, an early exit, a forged report) takes part in
the comparison.

What a test may hold: one or more ``assert`` statements, optionally after
``import``/``from ... import`` of :data:`TEST_MODULES`. Builtin names in a test
(``sorted``, ``len``, ``abs`` ...) are Python's own, applied outside to the
probes' values, even where the program defines a function of that name. A probe
may not use a variable bound inside the test (``[f(i) for i in range(3)]``):
write one assert per case. Anything else is refused by :func:`compile_test`
with a ``ValueError`` that says so (the reward counts that sample as a failure).
"""

from __future__ import annotations

import ast
import builtins
import importlib
from dataclasses import dataclass, field
from typing import Any

from rltk.parsing import parse_python
from rltk.rewards.programs.plain_data import decode_values

# Builtins a check may call on the probes' values: pure functions of plain data.
SAFE_BUILTINS = {name: getattr(builtins, name) for name in (
    "abs", "all", "any", "bin", "bool", "bytes", "chr", "complex", "dict", "divmod", "enumerate", "filter",
    "float", "frozenset", "hex", "int", "isinstance", "len", "list", "map", "max", "min", "oct", "ord", "pow",
    "range", "repr", "reversed", "round", "set", "sorted", "str", "sum", "tuple", "type", "zip",
)}
# Standard-library modules a test may import (for math.isclose, Fraction, Counter ...).
TEST_MODULES = ("math", "cmath", "fractions", "decimal", "collections", "itertools", "functools", "operator",
                "string", "re", "statistics", "heapq", "bisect")
PROBES = "_rltk_probes"  # the name the check reads the probes' values from


@dataclass(frozen=True)
class AssertTest:
    """One test, split: ``setup`` (import statements, run on both sides), ``probes`` (expression sources
    run in the program's namespace, in the sandbox), ``checks`` (one compiled expression per assert,
    evaluated outside on ``_rltk_probes``)."""

    source: str
    setup: tuple[str, ...]
    probes: tuple[str, ...]
    checks: tuple[Any, ...] = field(repr=False)


def compile_test(source: str) -> AssertTest:
    """Split ``source`` into probes and checks; ``ValueError`` naming the test when it cannot be judged outside."""
    try:
        tree = parse_python(source)
    except SyntaxError as exc:
        raise ValueError(f"code_execution: assert test {source[:80]!r} is not Python ({exc.msg})") from None
    setup, asserts = [], []
    for stmt in tree.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)) and not asserts:
            modules = [a.name for a in stmt.names] if isinstance(stmt, ast.Import) else [stmt.module or ""]
            for module in modules:
                if module.split(".")[0] not in TEST_MODULES or getattr(stmt, "level", 0):
                    raise ValueError(f"code_execution: assert test {source[:80]!r} imports {module!r}; a test may "
                                     f"import only {', '.join(TEST_MODULES)}")
            setup.append(stmt)
        elif isinstance(stmt, ast.Assert):
            asserts.append(stmt)
        else:
            raise ValueError(f"code_execution: assert test {source[:80]!r} holds a {type(stmt).__name__} statement; "
                             f"a test is `assert` statements (after imports of {', '.join(TEST_MODULES[:3])} ...), "
                             f"each judged outside the program")
    if not asserts:
        raise ValueError(f"code_execution: assert test {source[:80]!r} has no `assert` statement")
    known = set(SAFE_BUILTINS)
    for stmt in setup:
        known.update((a.asname or a.name).split(".")[0] for a in stmt.names)
    splitter = _Splitter(known, source)
    checks = []
    for stmt in asserts:
        expr = splitter.visit(stmt.test)
        checks.append(compile(ast.fix_missing_locations(ast.Expression(expr)), "<assert test>", "eval"))
    return AssertTest(source=source, setup=tuple(ast.unparse(s) for s in setup),
                      probes=tuple(splitter.probes), checks=tuple(checks))


class _Splitter(ast.NodeTransformer):
    """Replaces each maximal program-rooted expression by ``_rltk_probes[i]`` and records its source."""

    def __init__(self, known: set[str], source: str):
        self.known = known
        self.source = source
        self.bound: list[set[str]] = []  # names bound by the comprehensions and lambdas around a node
        self.probes: list[str] = []

    def _program_rooted(self, node: ast.AST) -> bool:
        while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
            node = node.func if isinstance(node, ast.Call) else node.value
        return isinstance(node, ast.Name) and node.id not in self.known and not any(
            node.id in scope for scope in self.bound)

    def _probe(self, node: ast.expr) -> ast.expr:
        inner = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        if any(inner & scope for scope in self.bound):
            raise ValueError(f"code_execution: assert test {self.source[:80]!r} calls the program with a variable "
                             f"bound inside the test ({ast.unparse(node)!r}); write one assert per case")
        if any(isinstance(n, (ast.NamedExpr, ast.Yield, ast.YieldFrom, ast.Await)) for n in ast.walk(node)):
            raise ValueError(f"code_execution: assert test {self.source[:80]!r}: {ast.unparse(node)!r} "
                             f"cannot be evaluated as a probe")
        self.probes.append(ast.unparse(node))
        index = ast.Constant(len(self.probes) - 1)
        return ast.copy_location(ast.Subscript(ast.Name(PROBES, ast.Load()), index, ast.Load()), node)

    def visit_Name(self, node: ast.Name) -> ast.expr:
        return self._probe(node) if self._program_rooted(node) else node

    def _chain(self, node: ast.expr) -> ast.expr:
        return self._probe(node) if self._program_rooted(node) else self.generic_visit(node)

    visit_Call = visit_Attribute = visit_Subscript = _chain

    def _scoped(self, node: ast.expr, names: set[str]) -> ast.expr:
        self.bound.append(names)
        try:
            return self.generic_visit(node)
        finally:
            self.bound.pop()

    def visit_Lambda(self, node: ast.Lambda) -> ast.expr:
        args = node.args
        every = [*args.posonlyargs, *args.args, *args.kwonlyargs, *filter(None, [args.vararg, args.kwarg])]
        return self._scoped(node, {a.arg for a in every})

    def _comprehension(self, node: ast.expr) -> ast.expr:
        names = {n.id for gen in node.generators for n in ast.walk(gen.target) if isinstance(n, ast.Name)}
        return self._scoped(node, names)

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension

    def visit_NamedExpr(self, node: ast.NamedExpr) -> ast.expr:
        raise ValueError(f"code_execution: assert test {self.source[:80]!r} assigns with `:=`; not allowed in a test")


def judge(test: AssertTest, payload: str) -> str:
    """``"pass"``, ``"failed"`` (an assert is false) or ``"error"`` (bad values, or the check raised)."""
    try:
        values = decode_values(payload)
    except (ValueError, TypeError, RecursionError):
        return "error"
    if len(values) != len(test.probes):
        return "error"
    namespace: dict[str, Any] = {"__builtins__": {**SAFE_BUILTINS, "__import__": _import_test_module},
                                 PROBES: values}
    try:
        for stmt in test.setup:
            exec(stmt, namespace)  # imports of TEST_MODULES only (checked by compile_test)
        for check in test.checks:
            if not eval(check, namespace):
                return "failed"
    except Exception:
        return "error"
    return "pass"


def _import_test_module(name, globals=None, locals=None, fromlist=(), level=0):
    if level or name.split(".")[0] not in TEST_MODULES:
        raise ImportError(f"a test may import only {', '.join(TEST_MODULES)}")
    module = importlib.import_module(name)
    return module if fromlist else importlib.import_module(name.split(".")[0])
