"""Benchmark: how fast `rltk dashboard` answers its page and validates an edit (issue 45's targets).

    python benchmarks/dashboard_speed.py                 # 3 fresh dashboards, 7 edits each (~1 min)
    python benchmarks/dashboard_speed.py --repeats 5 --json

Each repeat starts `rltk dashboard` in a process of its own (loopback, a port the OS picks, empty runs
folder), times the page from the command's start to its answer, the first validation (which waits for the
warm-up the server starts once it has answered the page) and each of seven edits after it, the form's
``POST /api/build`` as the page sends it. Every answer is checked to be that edit's own validation (a refused value refused, the command
ending with the edit), so a cached or empty answer cannot look fast.

Wall time swings with whatever else the machine runs (a load of 8 on 2 cores made the page 18 s), so the
server's CPU seconds (``/proc/PID/stat``, its user + system time) are reported beside it: they barely move
with load. Targets (issue 45): the page < 3 s after start, an edit < 300 ms. Prints a table and writes JSON
under ``benchmarks/results/``; ``--json`` prints the JSON instead (what ``tests/dashboard/test_dashboard_speed.py``
reads).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from tempfile import TemporaryDirectory

REPO = Path(__file__).resolve().parents[1]
# (overrides, whether the edit is valid): the form's edits, two of them refused
EDITS = [(["trainer.lr=0.0003"], True), (["trainer.lr=0.0003", "rollout.n=8"], True), (["algorithm.name=dapo"], True),
         (["algorithm.name=dapo", "trainer.total_steps=50"], True), (["trainer.lr=-1"], False),
         (["algorithm.advantage_fn_args.eps=abc"], False), (["trainer.lr=0.0002"], True)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _request(port: int, method: str, path: str, timeout_s: float, body: dict | None = None,
             token: str | None = None) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    headers = {"Content-Type": "application/json", "X-Rltk-Token": token} if body is not None else {}
    conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
    try:
        return conn.getresponse().read()
    finally:
        conn.close()


def _timed_edit(port: int, pid: int, token: str, overrides: list[str], valid: bool,
                timeout_s: float) -> tuple[float, float]:
    """(wall s, server CPU s) of one validation, checked to be that edit's own."""
    start, cpu = time.perf_counter(), cpu_seconds(pid)
    answer = json.loads(_request(port, "POST", "/api/build", timeout_s, {"recipe": "grpo", "overrides": overrides},
                                 token))
    wall, used = time.perf_counter() - start, cpu_seconds(pid) - cpu
    if answer["ok"] is not valid or not answer["command"].endswith(" ".join(overrides)):
        raise AssertionError(f"the dashboard's answer to {overrides} is not its validation: {answer}")
    return wall, used


def measure_once(timeout_s: float = 120.0) -> dict:
    """One fresh dashboard: the page's wall and CPU seconds from the start, the first validation's, each edit's.

    ``timeout_s`` bounds the start and each request (a hang, not a slow machine, should reach it)."""
    with TemporaryDirectory() as tmp:
        start = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, "-m", "rltk.commands.cli", "dashboard", "--port", "0", "--runs", f"{tmp}/runs",
             "--save-dir", tmp], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
        try:
            line = process.stdout.readline()  # the URL, once it listens (the process's own first line)
            match = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
            if not match:
                raise AssertionError(f"no URL in the dashboard's first line: {line!r} (exit {process.poll()})")
            port = int(match.group(1))
            page = _request(port, "GET", "/", timeout_s)
            ready, ready_cpu = time.perf_counter() - start, cpu_seconds(process.pid)
            token = re.search(rb'name="rltk-token" content="([^"]+)"', page).group(1).decode()
            first, first_cpu = _timed_edit(port, process.pid, token, [], True, timeout_s)
            edits = [_timed_edit(port, process.pid, token, overrides, valid, timeout_s) for overrides, valid in EDITS]
        finally:
            process.terminate()
            process.wait(timeout=timeout_s)
    return {"page_s": ready, "page_cpu_s": ready_cpu, "first_validation_s": first, "first_validation_cpu_s": first_cpu,
            "edit_s": [wall for wall, _ in edits], "edit_cpu_s": [cpu for _, cpu in edits]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="fresh dashboards to time (default 3)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="bound on the start and each request")
    parser.add_argument("--json", action="store_true", help="print the results as JSON, write no file")
    args = parser.parse_args(argv)
    load = os.getloadavg()
    runs = [measure_once(args.timeout_s) for _ in range(args.repeats)]
    median = {key: statistics.median(statistics.median(r[key]) if isinstance(r[key], list) else r[key] for r in runs)
              for key in runs[0]}
    report = {"runs": runs, "median": median, "load_average": load, "cpus": os.cpu_count(),
              "python": platform.python_version(), "when": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"rltk dashboard, {args.repeats} fresh starts, load average {load[0]:.1f} on {os.cpu_count()} CPUs")
    print("| | wall s | server CPU s | target |\n|---|---|---|---|")
    print(f"| page answered after start | {median['page_s']:.2f} | {median['page_cpu_s']:.2f} | < 3 s |")
    print(f"| first validation (after the warm-up) | {median['first_validation_s']:.2f} | "
          f"{median['first_validation_cpu_s']:.2f} | |")
    print(f"| an edit validated (median) | {median['edit_s']:.3f} | {median['edit_cpu_s']:.3f} | < 0.3 s |")
    out = REPO / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"dashboard_speed-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
