"""The suite's one wait setting, RLTK_TEST_TIME_SCALE (tests/waits.py; CONTRIBUTING.md, "Waiting in a test, and
a loaded machine")."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.waits import scaled, wait_until

REPO = Path(__file__).resolve().parents[1]
READ = "import os, tests.waits as w; print(w.TIME_SCALE, w.scaled(2), os.environ['RLTK_TEST_TIME_SCALE'])"


def _scale_in_a_fresh_process(value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RLTK_TEST_TIME_SCALE"}
    if value is not None:
        env["RLTK_TEST_TIME_SCALE"] = value
    return subprocess.run([sys.executable, "-c", READ], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=scaled(120))


def test_the_setting_multiplies_every_bound_and_is_handed_on():
    scale, two, handed = _scale_in_a_fresh_process("3").stdout.split()
    assert (float(scale), float(two), handed) == (3.0, 6.0, "3")


def test_unset_it_is_the_load_per_core_at_least_one_and_is_handed_to_subprocesses():
    before = os.getloadavg()[0] / os.cpu_count()
    scale, two, handed = (float(x) for x in _scale_in_a_fresh_process(None).stdout.split())
    after = os.getloadavg()[0] / os.cpu_count()
    assert scale >= 1.0 and two == 2 * scale and handed == pytest.approx(scale, abs=0.01)
    assert scale == 1.0 or min(before, after) - 0.5 <= scale <= max(before, after) + 0.5  # the load moves meanwhile


@pytest.mark.parametrize("value", ["fast", "0", "-2", "inf"])
def test_a_bad_value_is_refused_naming_the_variable(value):
    out = _scale_in_a_fresh_process(value)
    assert out.returncode != 0 and f"RLTK_TEST_TIME_SCALE={value!r}: must be a number" in out.stderr


def test_wait_until_returns_the_condition_and_names_what_it_waited_for():
    start = time.monotonic()
    assert wait_until(lambda: time.monotonic() - start > 0.1 and "done", "a tenth of a second", 60) == "done"
    with pytest.raises(AssertionError, match=r"waited for the impossible: what should bring it about ended\nlog"):
        wait_until(lambda: False, "the impossible", 60, alive=lambda: False, details=lambda: "log")
    with pytest.raises(AssertionError, match=r"waited for the impossible: not within \d+ s \(RLTK_TEST_TIME_SCALE="):
        wait_until(lambda: False, "the impossible", 0.01 / scaled(1))
