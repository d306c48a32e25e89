"""The code sandbox's verdict comes from outside the program: every route to fake it scores 0.

Each hostile program below is a wrong ``add`` that tries one way to make its assert tests pass anyway; while
assert tests ran inside the program's interpreter, the reporter and ``__eq__`` routes scored 1.0 and the
int subclass and patched builtins 0.75 and 0.25. The same tests give a right ``add`` 1.0, so a 0 here is the
faking failing, not the test being unpassable.
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rltk.rewards.programs import sandbox
from rltk.rewards.programs.assert_tests import compile_test, judge
from rltk.rewards.programs.code_execution import code_execution, parse_tests
from rltk.rewards.programs.plain_data import decode_values, encode_value

needs_sandbox = pytest.mark.skipif(
    os.geteuid() != 0 and (sys.platform != "linux" or sandbox.check_sandbox() is not None),
    reason="this machine cannot run the sandbox (as root it always runs these: a broken sandbox fails them)")

TESTS = ["assert add(1, 2) == 3", "assert add(20, 22) == 42",
         "assert abs(add(0.25, 0.5) - 0.75) < 1e-9", "assert add(2, 2) != 5 and add(-1, 1) == 0"]
RIGHT = "def add(a, b):\n    return a + b"
WRONG = "def add(a, b):\n    return a - b - 1"

FAKES = {
    # The harness's own reporter, reached through the module table (the harness is __main__).
    "harness reporter": "import sys\nsys.modules['__main__']._report('pass')\n" + WRONG,
    "harness reporter, probe word": "import sys\nsys.modules['__main__']._report('evaluated')\n" + WRONG,
    # Everything compares equal.
    "own __eq__": "class Yes:\n    def __eq__(self, other):\n        return True\n    __ne__ = __eq__\n"
                  "    __lt__ = __eq__\n    def __sub__(self, other):\n        return self\n    __abs__ = lambda s: s\n"
                  "def add(a, b):\n    return Yes()",
    # A subclass of int with its own comparison: taken as the plain int it holds.
    "int subclass __eq__": "class I(int):\n    def __eq__(self, other):\n        return True\n"
                           "    __ne__ = __lt__ = __eq__\n    __hash__ = int.__hash__\n"
                           "def add(a, b):\n    return I(a - b - 1)",
    # Builtins and the assertion machinery patched.
    "patched builtins": "import builtins\nbuiltins.abs = lambda x: 0\nclass Never(Exception):\n    pass\n"
                        "builtins.AssertionError = Never\n" + WRONG,
    # Ends the process before any test can fail, with a success status or with none.
    "sys.exit(0)": WRONG + "\nimport sys\nsys.exit(0)",
    "os._exit(0)": WRONG + "\nimport os\nos._exit(0)",
    # Prints what a success looks like, on stdout and on the report descriptor.
    "fake marker": WRONG + "\nprint('pass')\nimport os\nos.write(3, b'pass')",
    # Writes a well-formed report of its own: the nonce is in the harness's globals.
    "forged report": WRONG + "\nimport os, sys\nm = sys.modules['__main__']\n"
                             "os.write(3, ('evaluated ' + m._nonce + '\\n[{\"own\": 1}]').encode())\nos._exit(0)",
}


def run(program: str, tests) -> dict[str, float]:
    return code_execution(response=f"```python\n{program}\n```", ground_truth=tests, timeout_s=5.0, cpu_s=2)


@needs_sandbox
def test_the_right_program_passes_and_the_wrong_one_fails():
    assert run(RIGHT, TESTS)["score"] == 1.0
    out = run(WRONG, TESTS)
    assert out["score"] == 0.0 and out["failed"] == 4.0


@needs_sandbox
@pytest.mark.parametrize("route", sorted(FAKES))
def test_a_program_cannot_grade_itself(route):
    out = run(FAKES[route], TESTS)
    assert out["score"] == 0.0, (route, out)
    assert out["passed"] == 0.0


@needs_sandbox
def test_the_expected_values_never_enter_the_sandbox():
    # The program hunts for the expected answer everywhere it can read (its files, the harness's memory,
    # every process's command line and environment) and returns it if found.
    # The needle is built at run time, so the program's own text does not hold it.
    hunter = (
        "import os, sys\nneedle = str(987000 + 654)\nfound = False\n"
        "for root in ('/work', '/tmp', '/'):\n"
        "    for name in os.listdir(root):\n"
        "        try:\n            found |= needle in open(os.path.join(root, name), errors='replace').read()\n"
        "        except Exception:\n            pass\n"
        "for pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
        "    for part in ('cmdline', 'environ'):\n"
        "        try:\n            found |= needle.encode() in open(f'/proc/{pid}/{part}', 'rb').read()\n"
        "        except Exception:\n            pass\n"
        "harness = vars(sys.modules['__main__'])\n"
        "found |= any(needle in repr(v) for k, v in list(harness.items()) if k != '_ns')\n"
        "def answer():\n    return int(needle) if found else 0")
    out = run(hunter, ["assert answer() == 987654"])
    assert out["score"] == 0.0 and out["failed"] == 1.0


@needs_sandbox
def test_the_interpreter_is_seen_at_a_neutral_path_without_site_packages():
    python, mounts, _ = sandbox._interpreter()
    program = ("import os, sys\nprint(os.path.exists('/root'), os.path.exists('/home'))\nprint(sys.executable)\n"
               "site = [p for p in sys.path if p.endswith('site-packages')]\n"
               "print([n for p in site for n in os.listdir(p)] if site and os.path.isdir(site[0]) else [])")
    host_prefix = os.path.realpath(sys.base_prefix)
    expected = f"False False\n{python}\n[]\n"
    assert run(program, [{"input": "", "output": expected}])["score"] == 1.0
    if not host_prefix.startswith("/usr"):
        assert python.startswith(sandbox.SANDBOX_PREFIX + "/") and all(
            not inside.startswith(host_prefix) for _, inside in mounts)


@needs_sandbox
def test_values_travel_as_plain_data_of_every_kind():
    program = ("def f():\n    return {'a': (1, 2.5, None), 'b': [True, b'x', {3, 4}], (1, 'k'): frozenset({'z'}), "
               "'c': 2j}\nfrom collections import OrderedDict\ndef g():\n    return OrderedDict(x=1)\n"
               "def h():\n    return (n for n in range(3))")
    tests = ["assert f() == {'a': (1, 2.5, None), 'b': [True, b'x', {3, 4}], (1, 'k'): frozenset({'z'}), 'c': 2j}",
             "assert f()['a'][1] == 2.5 and type(f()['a']) is tuple and isinstance(f()['b'][2], set)",
             "assert g() == {'x': 1}", "assert list(h()) == [0, 1, 2]"]
    out = run(program, tests)
    # A generator is not plain data: that test is an error, the rest pass.
    assert (out["passed"], out["errors"]) == (3.0, 1.0)


# ---------------------------------------------------------------- the split, on hand-checked tests

def test_tests_split_into_probes_and_checks():
    cases = {
        "assert add(1, 2) == 3": ["add(1, 2)"],
        "assert abs(add(0.1, 0.2) - 0.3) < 1e-9": ["add(0.1, 0.2)"],
        "assert sorted(f(x)) == [1, 2]": ["f(x)"],
        "assert Solution().two_sum([2, 7], 9)[0] == 0": ["Solution().two_sum([2, 7], 9)[0]"],
        "assert x == 2 and not seen": ["x", "seen"],
        "assert all(v > 0 for v in f(3))": ["f(3)"],
        "import math\nassert math.isclose(area(1), math.pi)": ["area(1)"],
        "from math import isclose\nassert isclose(g(2), 4.0)\nassert g(0) == 0": ["g(2)", "g(0)"],
        "assert True": [],
    }
    for source, probes in cases.items():
        assert list(compile_test(source).probes) == probes, source


def test_the_check_is_judged_on_the_values():
    test = compile_test("assert abs(add(0.1, 0.2) - 0.3) < 1e-9")
    assert judge(test, "[0.30000000000000004]") == "pass"
    assert judge(test, "[0.4]") == "failed"
    assert judge(test, '["text"]') == "error"  # the check raised: str - float
    assert judge(test, "[1, 2]") == "error"  # not one value per probe
    assert judge(test, '[{"own": 1}]') == "error"  # not a known tag
    assert judge(compile_test("assert f() is None"), "[null]") == "pass"
    assert judge(compile_test("assert f() == (1, [2])"), '[{"tuple": [1, [2]]}]') == "pass"
    assert judge(compile_test("assert f() == (1, [2])"), "[[1, [2]]]") == "failed"  # a list is not a tuple


def test_tests_that_cannot_be_judged_outside_are_refused():
    for source, says in [
        ("[f(i) for i in range(3)] == [0, 1, 2]", "holds a Expr statement"),
        ("assert [f(i) for i in range(3)] == [0, 1, 2]", "variable bound inside the test"),
        ("x = f(1)\nassert x == 2", "holds a Assign statement"),
        ("import os\nassert f() == 1", "imports 'os'"),
        ("assert (y := f(1)) == 2", "assigns with `:=`"),
        ("import math", "has no `assert` statement"),
        ("assert f(1) ==", "is not Python"),
    ]:
        with pytest.raises(ValueError, match=says):
            compile_test(source)
    with pytest.raises(ValueError, match="variable bound inside the test"):
        parse_tests('["assert all(f(i) for i in range(3))"]')


plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text() | st.binary()
    | st.complex_numbers(allow_nan=False),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=3) | st.integers(), inner, max_size=3)
    | st.frozensets(st.integers() | st.text(max_size=3), max_size=3),
    max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(plain)
def test_plain_data_round_trips_with_its_types(value):
    import json

    back = decode_values(json.dumps([encode_value(value)]))[0]
    assert back == value and types_of(back) == types_of(value)


def types_of(value):
    """The value's type tree: a 1 that came back as True or 1.0, or a tuple as a list, differs here."""
    if isinstance(value, (list, tuple)):
        return type(value), [types_of(v) for v in value]
    if isinstance(value, dict):
        return dict, sorted((repr(k), types_of(v)) for k, v in value.items())
    if isinstance(value, frozenset):
        return frozenset, sorted(repr(types_of(v)) for v in value)
    return type(value)


def test_objects_that_are_not_plain_data_are_refused():
    class Yes:
        def __eq__(self, other):
            return True

    for value in [Yes(), (n for n in range(2)), [1, Yes()], {"k": object()}]:
        with pytest.raises(TypeError, match="not plain data"):
            encode_value(value)
