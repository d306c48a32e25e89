"""`rltk dashboard` in its own process answers its page and validates each edit without a hang or a regression.

The speed targets (issue 45: the page < 3 s after the command starts, an edit < 300 ms) are the benchmark's
figures, ``benchmarks/dashboard_speed.py`` (docs/benchmarks.md): on a loaded machine wall time says more about
the machine than about rltk (18 s for the page at a load of 8 on 2 cores). This test runs that benchmark's
measurement once and bounds the server's CPU seconds, which load barely moves, an order of magnitude above
what it measured here (page ~2 s, edit ~0.3 s), so that a return of the old 20 s start or 2 s edits fails while
a busy machine does not; wall time is only bounded against a hang (each request, :func:`tests.waits.scaled`).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

from tests.waits import scaled

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from dashboard_speed import measure_once  # noqa: E402

pytestmark = pytest.mark.slow


def test_the_dashboard_answers_and_validates_each_edit_within_a_bounded_cpu_time(capsys):
    result = measure_once(timeout_s=scaled(120))  # also checks each answer is that edit's own validation
    edit_cpu = statistics.median(result["edit_cpu_s"])
    with capsys.disabled():
        print(f"\ndashboard: page {result['page_s']:.2f} s ({result['page_cpu_s']:.2f} CPU s) after start; edits "
              f"{' '.join(f'{t * 1000:.0f}' for t in result['edit_s'])} ms (median CPU {edit_cpu * 1000:.0f} ms)")
    assert result["page_cpu_s"] < 15, f"the server used {result['page_cpu_s']:.1f} CPU s before its page answered"
    assert edit_cpu < 1.5, f"the server used {result['edit_cpu_s']} CPU s per edit (median {edit_cpu:.2f})"
