"""`rltk dashboard` answers its page without torch or transformers (issue 55: the first answer under 2 s).

Importing torch costs ~2 CPU s and transformers' tokenizer ~1.3 s here, which is what made the page wait: so the
test checks the import graph of the page's path, in a fresh interpreter, rather than a time a loaded machine
would make flaky. The registry, the validation path and torch load afterwards, in the warm-up thread the server
starts once it has answered (``Dashboard.start_warm_up``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from tests.waits import scaled, wait_until

REPO = Path(__file__).resolve().parents[2]
# each of these costs a second or more of CPU to import here (numpy, ~0.1 s, is imported by `rltk serve-tinker`'s
# argument parser)
HEAVY = ("torch", "transformers", "accelerate", "peft", "matplotlib")

# What the `rltk dashboard` process runs before its first answer: the command line module, its parser, the
# server module, the page and the list of runs (a run folder with metrics and traces is listed).
PAGE_PATH = """
import json, sys, threading, urllib.request
from pathlib import Path
from rltk.commands.cli import build_parser
from rltk.dashboard.server import Dashboard

args = build_parser().parse_args(["dashboard", "--port", "0"])
root = Path(sys.argv[1])
(root / "runs" / "a").mkdir(parents=True)
(root / "runs" / "a" / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\\n')
(root / "runs" / "a" / "traces.jsonl").write_text('{"step": 1}\\n')
server = Dashboard("127.0.0.1", args.port, root / "runs", root)
threading.Thread(target=server.serve_forever, daemon=True).start()
page = urllib.request.urlopen(server.url, timeout=60).read()
listed = json.loads(urllib.request.urlopen(server.url + "api/runs", timeout=60).read())
print(json.dumps({"page": b"rltk-token" in page, "runs": [r["name"] for r in listed["runs"]],
                  "traces": [r["traces"] for r in listed["runs"]],
                  "loaded": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def _fresh_python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          timeout=scaled(120))


def test_the_dashboard_answers_its_page_and_lists_runs_without_importing_torch_or_transformers(tmp_path):
    out = _fresh_python(PAGE_PATH, str(tmp_path))
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout.splitlines()[-1])
    assert answer["page"] and answer["runs"] == ["a"] and answer["traces"] == [True]
    assert answer["loaded"] == [], f"the page's path imports {answer['loaded']}"


def test_the_warm_up_starts_after_the_first_answer_and_once(tmp_path):
    """The server defers its warm-up (which imports torch) until it has answered once, then starts it once."""
    from rltk.dashboard.server import Dashboard

    from tests.dashboard.conftest import Client

    server = Dashboard("127.0.0.1", 0, tmp_path / "runs", tmp_path)
    calls = []
    server.warm_up = lambda: calls.append(threading.current_thread().name)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert not server.warming.is_set() and calls == []  # listening, nothing warmed yet
        client = Client(server)
        assert client.get("/")[0] == 200
        assert client.get("/api/runs")[0] == 200
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=scaled(10))
    assert server.warming.is_set()
    wait_until(lambda: calls, "the warm-up thread to run", 10)
    assert len(calls) == 1 and calls[0] != threading.current_thread().name
