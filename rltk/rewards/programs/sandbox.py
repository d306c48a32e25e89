"""Run untrusted Python against tests in Linux namespaces, with rlimits, a private root and no network.

:func:`run_in_sandbox` is the parent half: it starts
``unshare --net --pid --mount --ipc --uts --fork --kill-child`` on
:mod:`rltk.rewards.programs.sandbox_launcher` (the inside half, which builds the
private root and runs each test; read its docstring for the steps) and reads
its results. :func:`check_sandbox` says whether this machine can do that, once
per process, by running a two-line program through it.

What the sandbox protects against (each one run by ``tests/rewards/test_code_execution.py``):

* **Runaway CPU**: ``RLIMIT_CPU`` (``cpu_s``; SIGXCPU, SIGKILL one second later)
  and a wall-clock limit per test (``timeout_s``) after which every process of
  the sandbox's PID namespace is killed, sleeping or forked ones included.
* **Memory**: ``RLIMIT_AS`` (``memory_mb``) per process: allocating 10 GB
  fails at once with ``MemoryError``.
* **Fork bombs**: ``RLIMIT_NPROC`` (``processes``, threads included) on a uid
  that only this sandbox uses (see "Two modes"); the PID namespace is torn
  down after each test.
* **Disk**: ``RLIMIT_FSIZE`` (``file_size_mb``) per file, and the whole
  writable tree is a tmpfs of ``scratch_mb`` (and ``64 * scratch_mb`` inodes)
  that vanishes with the sandbox.
  Nothing the program writes reaches the host's filesystem: ``/usr``,
  ``/etc`` and the interpreter are read-only bind mounts, ``/tmp`` and
  ``/work`` are the sandbox's own, and every other host path (``/home``,
  ``/root``, the host's ``/tmp``, the trainer's checkout) is absent.
* **Network**: a new network namespace with only a loopback that is down: no
  connection to the host's ``127.0.0.1`` or anywhere else, no DNS.
* **Secrets**: the program gets a near-empty environment (``PATH``, ``HOME=/work``,
  ``LANG``), a ``/proc`` showing only its own namespace (not the trainer's
  ``/proc/<pid>/environ``), and no ``$HOME`` or ``~/.ssh``.
* **Privilege**: ``no_new_privs``, no capabilities, no supplementary groups,
  ``nosuid`` mounts, no ``/sys``, device nodes limited to null/zero/random/urandom;
  the root, the harness and the program file are read-only mounts (only
  ``/work`` and ``/tmp`` are writable).

Two modes, chosen by who runs the trainer:

* **As root**: plain namespaces, and the program runs as an otherwise unused
  uid (one per sandbox, from :data:`UID_BASE`; ``RLIMIT_NPROC`` does not bind
  root), with no groups.
* **As any other user**: a user namespace too (``unshare --user
  --map-root-user``): the program is uid 0 there (the caller's uid outside)
  with every capability dropped for good (``SECBIT_NOROOT``, empty bounding
  and ambient sets). ``RLIMIT_NPROC`` counts the namespace's processes, which
  include ``unshare`` and the launcher, so it is raised by two to give the
  program the same budget. Needs unprivileged user namespaces
  (``kernel.unprivileged_userns_clone``, or AppArmor's
  ``apparmor_restrict_unprivileged_userns`` on Ubuntu 24.04, must allow them).

What it does **not** protect against:

* It is not a VM: the program shares the host's kernel, so a kernel exploit
  (or a bug in namespaces) escapes it. There is no seccomp filter: every
  system call the kernel lets an unprivileged uid make is allowed.
* Side channels (timing, cache, CPU load felt by other processes) and reading
  the world-readable files of ``/usr`` and ``/etc``.
* Reward hacking of the verdict: nothing the program controls takes part in
  judging it. stdin/stdout cases are compared here, outside; assert tests are
  split by :mod:`rltk.rewards.programs.assert_tests` so that only their calls into the
  program run inside, come back as plain data, and are compared outside with
  expected values the sandbox never sees. A program that exits early, forges
  the harness's report, patches builtins or returns an object with its own
  ``__eq__`` scores 0 (``tests/rewards/test_verdict.py`` tries each route).
* It needs Linux, util-linux's ``unshare``, and root or unprivileged user
  namespaces; on a machine without them :func:`check_sandbox` says why and
  the ``code_execution`` reward refuses to start, rather than run code
  unsandboxed.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
# The encoder of the probes' values, run by the harness inside (read as text: this module imports no rltk).
PLAIN_DATA = Path(__file__).with_name("plain_data.py")
# Sandboxed programs run as uid UID_BASE + (parent pid * 16 + a counter) % UID_SPAN: ids no account uses
# on an ordinary machine, different for sandboxes running at once, so RLIMIT_NPROC counts one sandbox.
UID_BASE = 1_500_000_000
UID_SPAN = 1 << 26
# Seconds the launcher may take beyond its tests' time: namespace and mount setup, interpreter starts.
STARTUP_SLACK_S = 10.0
OUTCOMES = ("pass", "evaluated", "failed", "wrong_output", "error", "denied", "timeout", "cpu", "memory", "file_size",
            "processes", "crashed", "killed")

_counter = itertools.count()
_counter_lock = threading.Lock()


@dataclass(frozen=True)
class SandboxLimits:
    """Per-test limits. Each is validated by :meth:`errors` (see ``code_execution``'s args)."""

    timeout_s: float = 5.0
    cpu_s: int = 2
    memory_mb: int = 512
    file_size_mb: int = 16
    processes: int = 16
    scratch_mb: int = 64
    sample_timeout_s: float | None = None  # all tests of one run together; None: tests x timeout_s

    def errors(self) -> list[str]:
        """One message per bad field (``'name' = value: what is valid``); empty when all are fine."""
        rules = {
            "timeout_s": (0.1, 600, "seconds of wall clock per test"),
            "cpu_s": (1, 600, "whole seconds of CPU time per process"),
            "memory_mb": (64, 1 << 20, "MiB of address space per process (the interpreter alone maps ~30)"),
            "file_size_mb": (1, 1 << 14, "MiB, the largest file (stdout included) the program may write"),
            "processes": (2, 4096, "processes and threads the program may have at once, itself included"),
            "scratch_mb": (8, 1 << 14, "MiB of the sandbox's tmpfs (/work and /tmp together)"),
        }
        out = []
        total = self.sample_timeout_s
        if total is not None and (isinstance(total, bool) or not isinstance(total, (int, float))
                                  or not (0.1 <= total <= 3600)):
            out.append(f"'sample_timeout_s' = {total!r}: must be a number in [0.1, 3600] (seconds of wall clock "
                       f"for all tests of a sample together) or null (no cap beyond tests x timeout_s)")
        for name, (low, high, what) in rules.items():
            value = getattr(self, name)
            integral = name != "timeout_s"
            ok_type = (isinstance(value, int) if integral else isinstance(value, (int, float))) \
                and not isinstance(value, bool)
            if not ok_type or not (low <= value <= high):
                kind = "an integer" if integral else "a number"
                out.append(f"'{name}' = {value!r}: must be {kind} in [{low}, {high}] ({what})")
        return out


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program in it): it could not start, or gave no result."""


class SandboxUnavailable(SandboxError):
    """This machine cannot run the sandbox (no ``unshare``, namespaces refused ...)."""


# Where the interpreter appears inside the sandbox when it does not live under /usr: a neutral path, so
# nothing of the host's layout (``/root/.pyenv/...``, a user's home) is visible there.
SANDBOX_PREFIX = "/opt/python"


@functools.cache
def _interpreter() -> tuple[str, list[tuple[str, str]], dict[str, str]]:
    """The interpreter's path inside the sandbox, the ``(host, inside)`` read-only mounts it needs, and
    the environment it needs there.

    An interpreter under ``/usr`` runs from there (``/usr`` is mounted anyway). Any other one (pyenv,
    conda, a build in a home folder) gets only its binary, its standard library with an empty
    ``site-packages`` over the host's, and its shared ``libpython`` if it has one, all under
    :data:`SANDBOX_PREFIX`; Python finds its prefix from the binary's location.
    """
    python = os.path.realpath(sys.executable)
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    if python.startswith("/usr/") and stdlib.startswith("/usr/"):
        return python, [], {}
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    inside = f"{SANDBOX_PREFIX}/bin/{version}"
    mounts = [(python, inside), (stdlib, f"{SANDBOX_PREFIX}/lib/{version}")]
    if os.path.isdir(os.path.join(stdlib, "site-packages")):
        mounts.append(("", f"{SANDBOX_PREFIX}/lib/{version}/site-packages"))  # "": an empty folder
    env = {}
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        soname = sysconfig.get_config_var("INSTSONAME") or sysconfig.get_config_var("LDLIBRARY")
        library = os.path.realpath(os.path.join(sysconfig.get_config_var("LIBDIR") or "", soname or ""))
        if soname and os.path.isfile(library) and not library.startswith("/usr/"):
            mounts.append((library, f"{SANDBOX_PREFIX}/lib/{soname}"))
            env["LD_LIBRARY_PATH"] = f"{SANDBOX_PREFIX}/lib"
    return inside, mounts, env


def _uid() -> int:
    with _counter_lock:
        n = next(_counter)
    return UID_BASE + (os.getpid() * 16 + n) % UID_SPAN


def run_in_sandbox(program: str, mode: str, tests: list, limits: SandboxLimits) -> list[dict]:
    """Run ``program`` once per test; return ``[{"outcome": one of OUTCOMES, "wall_s": float}, ...]``.

    ``mode`` is ``"probe"`` (each test is ``{"setup": [import statements], "probes": [expressions]}``:
    the program runs as module ``solution``, then the setup and each probe run in its namespace; a run
    that gets that far ends ``"evaluated"`` with ``"values"``, the probes' values as tagged JSON text
    for :func:`rltk.rewards.programs.assert_tests.judge`, which gives the verdict outside) or ``"io"`` (each
    test is ``{"input": str, "output": str}``: the program reads ``input`` on stdin and passes when its
    stdout equals ``output``, trailing whitespace of each line and trailing blank lines ignored).

    Raises :class:`SandboxError` when the sandbox gives no result (it could not
    be set up, or overran every test's time plus :data:`STARTUP_SLACK_S`); its
    processes are gone by then (``--kill-child`` tears down the namespace when
    ``unshare`` is killed).
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SandboxUnavailable("util-linux's `unshare` is not on PATH")
    python, mounts, python_env = _interpreter()
    # As root: plain namespaces, and the program runs as an unused uid. Otherwise: a user namespace
    # too (uid 0 inside, the caller's uid outside), where the program keeps uid 0 without capabilities.
    as_root = os.geteuid() == 0
    job = {"program": program, "mode": mode, "tests": tests, "uid": _uid() if as_root else None,
           "python": python, "mounts": mounts, "python_env": python_env, "encoder": PLAIN_DATA.read_text(),
           **asdict(limits)}
    cmd = [unshare, *([] if as_root else ["--user", "--map-root-user"]), "--net", "--pid", "--mount", "--ipc",
           "--uts", "--fork", "--kill-child", "--", os.path.realpath(sys.executable), "-I", "-S", "-B", str(LAUNCHER)]
    budget = len(tests) * (limits.timeout_s + 0.5)
    if limits.sample_timeout_s is not None:
        budget = min(budget, limits.sample_timeout_s + 0.5)
    budget += STARTUP_SLACK_S
    try:
        proc = subprocess.run(cmd, input=json.dumps(job).encode(), capture_output=True, env={},
                              timeout=budget, cwd="/")
    except subprocess.TimeoutExpired as exc:
        raise SandboxError(f"the sandbox gave no result within {budget:.0f} s ({len(tests)} test(s) of "
                           f"timeout_s={limits.timeout_s} plus {STARTUP_SLACK_S:.0f} s to start); killed") from exc
    lines = proc.stdout.decode("utf-8", "replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):
        raise SandboxError(f"the sandbox exited with status {proc.returncode} and no result; stderr: "
                           f"{proc.stderr.decode('utf-8', 'replace').strip()[-500:] or '(empty)'}") from None
    if "error" in answer:
        raise SandboxError(f"the sandbox could not run: {answer['error']}")
    return answer["results"]


_probe_lock = threading.Lock()
_probe_result: str | None = None
_probed = False


def check_sandbox() -> str | None:
    """``None`` if this machine runs the sandbox correctly, else why not (checked once per process).

    Runs ``print(sum(map(int, input().split())))`` on one stdin/stdout case
    and requires it to pass: a sandbox that starts but runs nothing right
    counts as unavailable.
    """
    global _probe_result, _probed
    with _probe_lock:
        if _probed:
            return _probe_result
        if sys.platform != "linux":
            reason = f"it needs Linux namespaces; this is {sys.platform}"
        elif shutil.which("unshare") is None:
            reason = "util-linux's `unshare` is not on PATH"
        else:
            try:
                results = run_in_sandbox("print(sum(map(int, input().split())))", "io",
                                         [{"input": "2 3\n", "output": "5\n"}], SandboxLimits(timeout_s=10.0))
                outcome = results[0]["outcome"]
                reason = None if outcome == "pass" else f"a test program that should pass ended '{outcome}'"
            except SandboxError as exc:
                reason = str(exc)
        _probe_result, _probed = reason, True
        return reason
