"""Reward functions for the tests, at the top level of an importable module.

Worker processes import reward functions by reference, so functions the
tests run in workers live here rather than inside the test modules (pytest
imports those under names a fresh process cannot import).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import rltk
from rltk.rewards import bounded


def constant(*, prompt, response, ground_truth, extras, value):
    return value


@bounded
def bounded_constant(*, prompt, response, ground_truth, extras, value):
    return value


def boom(*, prompt, response, ground_truth, extras):
    raise RuntimeError("reward server unreachable")


def leaves(**_):
    raise SystemExit(3)


def only_response(*, response, bonus=0.0):
    return len(response) + bonus


def scaled(**kwargs):
    return float(kwargs["scale"])


def correct(*, response, ground_truth):
    return float(response.strip() == ground_truth)


def length_score(*, response, ground_truth, scale=1.0):
    """A score and a detail that depend on the sample, to check results land on the right sample."""
    return {"score": scale * len(response) + len(ground_truth) / 8, "chars": float(len(response))}


@bounded
def bounded_length_score(*, response, ground_truth, scale=1.0):
    return {"score": scale * len(response) + len(ground_truth) / 8, "chars": float(len(response))}


def pid(**_):
    return float(os.getpid())


def sleep_if(*, response, word="HANG", seconds=30.0):
    """Sleeps ``seconds`` on responses containing ``word``, else scores 1."""
    if word in response:
        time.sleep(seconds)
    return 1.0


def spin_if(*, response, word="SPIN"):
    """A pure-Python busy loop on responses containing ``word``: burns CPU until killed."""
    if word in response:
        n = 0
        while True:
            n += 1
    return 1.0


def exit_if(*, response, word="EXIT"):
    if word in response:
        os._exit(7)
    return 1.0


def segfault_if(*, response, word="SEGV"):
    if word in response:
        os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(5)
    return 1.0


def child_then_hang(*, response, extras):
    """Starts a long-running subprocess, records its pid in ``extras['pid_file']``, then hangs."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(extras["pid_file"], "w") as f:
        f.write(str(child.pid))
    time.sleep(60)
    return 1.0


class UserPlugin:
    """An in-process plugin registering an unmarked reward, which a run then scores in worker processes."""

    @staticmethod
    @rltk.hookimpl
    def rltk_reward_fns():
        return {"user_exact": correct_first_line}


def correct_first_line(*, response, ground_truth):
    return float(response.split("\n", 1)[0].strip() == ground_truth.strip())
