"""``code_execution``: run the model's Python program against tests in a sandbox; score the fraction passed.

**The program** is taken from the response by one rule: the last fenced block
tagged ``python``, ``py`` or ``python3`` (```` ```python ... ``` ````); else
the last fenced block with no language tag; else the whole response. A
response with fenced blocks only in other languages gives the whole response,
which then usually fails to compile (score 0).

**The tests** are the sample's ground truth, JSON text (or an already parsed
list/dict), in one of two forms:

* assert tests: ``["assert add(1, 2) == 3", "assert add(0, 0) == 0"]`` or
  ``{"asserts": [...]}``. Each is one or more ``assert`` statements (after
  imports of standard modules such as ``math``), judged **outside** the
  program: only the parts that call the program (``add(1, 2)``) run in the
  sandbox, in a fresh interpreter after the program, and their values come
  back as plain data to be compared here with the expected ones, which the
  program never sees (:mod:`rltk.rewards.programs.assert_tests` says what a test may
  hold). The program runs as a module named ``solution`` (its
  ``if __name__ == "__main__":`` block does not run; stdin is empty), and a
  ``sys.exit()`` in it fails the test. A value that is not plain data (an
  object of the program's own class, a generator) makes the test an error.
* stdin/stdout cases: ``[{"input": "1 2\\n", "output": "3\\n"}, ...]`` or
  ``{"cases": [...]}``. The program runs as ``__main__`` with ``input`` on
  stdin and passes when its stdout equals ``output``, trailing whitespace of
  each line and trailing blank lines ignored.

A ground truth in neither form, or with no tests, is an error for that sample
(the composer gives it the fallback score, counts it in
``reward_fn/failures/code_execution`` and warns once).

**The score** is ``passed / tests`` (2 of 3 asserts pass -> 0.667), or with
``all_or_nothing=True`` 1.0 when every test passes and 0.0 otherwise.

**What is logged** (the composer prefixes each key with the reward's name and
the workflow logs each as ``reward/code_execution/<key>``, the mean over a
step's samples): ``passed`` and ``tests`` (counts per sample); ``failed``
(an assert failed or the output was wrong); ``errors`` (the program raised, or
exited without finishing the test); ``denied`` (it raised a permission,
read-only, missing-path or network error: the sandbox refused something);
and ``killed/<reason>`` for tests the sandbox stopped: ``timeout`` (wall
clock), ``cpu`` (``RLIMIT_CPU``), ``memory`` (``RLIMIT_AS``: ``MemoryError``),
``file_size`` (``RLIMIT_FSIZE``), ``processes`` (``RLIMIT_NPROC``: ``fork``
refused) and ``signal`` (killed by another signal, e.g. a crash). Each test
lands in exactly one of ``passed``, ``failed``, ``errors``, ``denied`` and
``killed/*``, so those sum to ``tests``.

**Isolation** is :mod:`rltk.rewards.programs.sandbox` (Linux namespaces, a private
read-only root, rlimits, an unused uid or no capabilities, no network; its
docstring says what it protects against and what it does not). The program
runs on the interpreter rltk runs on, with the standard library only
(``-I -S``: no site-packages). A machine that cannot run the sandbox (not
Linux, no ``unshare``, neither root nor unprivileged user namespaces) is
refused when the reward is configured (:func:`check_args`, a
``ConfigError`` naming the key: ``rltk run`` exits 2); the program is never
run without it.

**Time**: tests of one sample run one after another, each under
``timeout_s``, all of them under ``sample_timeout_s`` when set (tests it
leaves no time for are not started and count as ``killed/timeout``); samples
run in parallel in the composer's worker processes (``reward.workers`` of
them). Keep a sample's worst case, ``sample_timeout_s`` or else
``tests * (timeout_s + 0.5)``, plus about 2 s to set up, under
``reward.timeout_s``, or the composer kills the whole sample first (it then
scores ``reward.fallback`` and counts in ``reward_fn/timeouts/code_execution``,
without the per-reason details). Config validation refuses a
``sample_timeout_s`` that is not at least 2 s under ``reward.timeout_s``.

Args (``reward.reward_fn_args.code_execution.<arg>``; the limits apply per test):
    timeout_s: wall-clock seconds (default 5).
    cpu_s: CPU seconds per process, an integer (default 2).
    memory_mb: address space per process, MiB (default 512).
    file_size_mb: largest file, stdout included, MiB (default 16).
    processes: processes and threads at once, the program included (default 16).
    scratch_mb: the sandbox's tmpfs for ``/work`` and ``/tmp``, MiB (default 64).
    sample_timeout_s: wall-clock seconds for all tests of a sample together (default None: no cap
        beyond ``tests * timeout_s``).
    all_or_nothing: score 1.0 only if every test passes (default False).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from rltk.errors import ConfigError
from rltk.rewards.programs.assert_tests import compile_test, judge
from rltk.rewards.programs.sandbox import SandboxLimits, check_sandbox, run_in_sandbox

LIMIT_ARGS = ("timeout_s", "cpu_s", "memory_mb", "file_size_mb", "processes", "scratch_mb", "sample_timeout_s")
KILL_REASONS = ("timeout", "cpu", "memory", "file_size", "processes", "signal")
# Outcomes of rltk.rewards.programs.sandbox as the detail each one counts in.
_DETAIL = {"pass": "passed", "failed": "failed", "wrong_output": "failed", "error": "errors", "denied": "denied",
           "timeout": "killed/timeout", "cpu": "killed/cpu", "memory": "killed/memory",
           "file_size": "killed/file_size", "processes": "killed/processes", "crashed": "killed/signal",
           "killed": "killed/signal"}
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_program(response: str) -> str:
    """The program in ``response``: the last ```python block, else the last untagged block, else all of it."""
    blocks = _FENCE.findall(response)
    for wanted in (("python", "py", "python3"), ("",)):
        tagged = [body for tag, body in blocks if tag.lower() in wanted]
        if tagged:
            return tagged[-1]
    return response


def parse_tests(ground_truth: Any) -> tuple[str, list]:
    """``("assert", [source, ...])`` or ``("io", [{"input", "output"}, ...])`` from a ground truth.

    Raises ``ValueError`` saying which form was expected when it is neither.
    """
    expected = ('expected JSON tests: ["assert f(1) == 2", ...] or {"asserts": [...]} for assert tests, '
                'or [{"input": "...", "output": "..."}, ...] or {"cases": [...]} for stdin/stdout cases')
    data = ground_truth
    if isinstance(data, (str, bytes)):
        try:
            data = json.loads(data)
        except ValueError as exc:
            raise ValueError(f"code_execution: ground truth is not JSON ({exc}); {expected}") from None
    if isinstance(data, Mapping):
        keys = set(data) & {"asserts", "cases"}
        if len(keys) != 1:
            raise ValueError(f"code_execution: ground truth has keys {sorted(data)}; {expected}")
        data = data[keys.pop()]
    if not isinstance(data, list) or not data:
        raise ValueError(f"code_execution: ground truth holds no tests ({str(ground_truth)[:80]!r}); {expected}")
    if all(isinstance(t, str) for t in data):
        for test in data:
            compile_test(test)  # a test that cannot be judged outside the program is refused here
        return "assert", list(data)
    if all(isinstance(t, Mapping) and isinstance(t.get("input"), str) and isinstance(t.get("output"), str)
           for t in data):
        return "io", [{"input": t["input"], "output": t["output"]} for t in data]
    raise ValueError(f"code_execution: ground truth mixes or misshapes its tests ({str(ground_truth)[:80]!r}); "
                     f"{expected}")


def code_execution(
    *,
    prompt: str = "",
    response: str,
    ground_truth: Any,
    extras: Mapping[str, Any] | None = None,
    timeout_s: float = 5.0,
    cpu_s: int = 2,
    memory_mb: int = 512,
    file_size_mb: int = 16,
    processes: int = 16,
    scratch_mb: int = 64,
    sample_timeout_s: float | None = None,
    all_or_nothing: bool = False,
) -> dict[str, float]:
    """Fraction of the ground truth's tests the response's Python program passes, run in a sandbox.

    See the module docstring for the extraction rule, the test formats, the
    details it returns and its arguments.
    """
    mode, tests = parse_tests(ground_truth)
    limits = SandboxLimits(timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb, file_size_mb=file_size_mb,
                           processes=processes, scratch_mb=scratch_mb, sample_timeout_s=sample_timeout_s)
    program = extract_program(response)
    if mode == "assert":
        compiled = [compile_test(test) for test in tests]
        results = run_in_sandbox(program, "probe", [{"setup": list(t.setup), "probes": list(t.probes)}
                                                    for t in compiled], limits)
        for test, result in zip(compiled, results):
            if result["outcome"] == "evaluated":  # the verdict, outside the program's reach
                result["outcome"] = judge(test, result["values"])
    else:
        results = run_in_sandbox(program, mode, tests, limits)
    details = {"passed": 0.0, "failed": 0.0, "errors": 0.0, "denied": 0.0,
               **{f"killed/{reason}": 0.0 for reason in KILL_REASONS}}
    for result in results:
        details[_DETAIL[result["outcome"]]] += 1.0
    n = float(len(tests))
    if all_or_nothing:
        score = float(details["passed"] == n)
    else:
        score = details["passed"] / n
    return {"score": score, "tests": n, **details}


def check_args(args: Mapping[str, Any]) -> None:
    """Refuse bad limits and a machine that cannot run the sandbox (``ConfigError``; callers name the key).

    Called when the reward is configured (config validation, and
    :class:`rltk.rewards.compose.RewardComposer`), so a run stops before its
    first step instead of giving every sample the fallback score.
    """
    limits = SandboxLimits(**{k: args[k] for k in LIMIT_ARGS if k in args})
    problems = limits.errors()
    flag = args.get("all_or_nothing", False)
    if not isinstance(flag, bool):
        problems.append(f"'all_or_nothing' = {flag!r}: must be true or false")
    if problems:
        raise ConfigError("; ".join(problems))
    reason = check_sandbox()
    if reason is not None:
        raise ConfigError(
            f"the code_execution reward cannot sandbox programs on this machine ({reason}); it runs "
            f"model-written code only inside its sandbox, never without one. Run on Linux with util-linux's "
            f"unshare, as root or where unprivileged user namespaces are allowed, or remove code_execution "
            f"from reward.reward_fn")


code_execution.check_args = check_args  # type: ignore[attr-defined]
