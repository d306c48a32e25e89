"""``rltk dashboard``: the config builder and the run viewer, served by the standard library.

One ``ThreadingHTTPServer`` serves a static page (HTML + JS, no build step) and
a small JSON API:

    GET  /api/form                     the generated form (rltk.dashboard.schema) and the recipes
    POST /api/build   {recipe, overrides}         validate, YAML, command line (rltk.dashboard.builder)
    POST /api/save    {recipe, overrides, name}   the same, then write <save_dir>/<name>
    GET  /api/runs                     run folders under the runs root
    GET  /api/runs/NAME                curves, step table, traced steps, summary, config text
    GET  /api/runs/NAME/traces?step=N  that step's traced trajectories
    GET  /api/runs/NAME/curves.png     the run's PNG

The run viewer (static/app.js) draws the panels of a run's ``curves.png`` as charts. Runs ticked in the
list are overlaid on the open run's charts, one colour a run (the curves of one panel told apart by their
dashes), with a legend; the tooltip names every line's value at the step under the pointer; smoothing, the
log scale, the metric filter and the zoom (drag over steps on any chart; double-click for all steps) apply
to every chart and every run. A traced step reads as its groups: the prompt once, then its samples as rows,
highest advantage first, each with its whole response token by token (every assistant turn and, greyed,
every observation), its rewards and transcript one click away.

Speed: the server listens at once, and nothing it imports to answer a page loads torch or transformers
(``tests/dashboard/test_dashboard_imports.py``), so its first answer comes well under 2 s after the command
starts. Once it has answered its first request, a thread builds the form and loads the validation path
(registry, data, tokenizer) in the background, so the first edit barely waits; started any earlier, that
thread's imports would hold the interpreter while the page waited. What is loaded stays loaded: each edit
afterwards costs one validation (``tests/dashboard/test_dashboard_speed.py`` times them).

Safety: it listens on 127.0.0.1 unless told otherwise; it answers only
requests whose Host is the address it serves (a web page elsewhere cannot
reach it through a DNS name it rebinds); POSTs, the only requests that write,
need the token embedded in the page (another site's form cannot post to it);
it writes only ``*.yaml`` files by plain name into its save folder; it reads
run folders as data only (:mod:`rltk.dashboard.runs`).
"""

from __future__ import annotations

import gc
import json
import secrets
import threading
from functools import lru_cache
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from rltk.dashboard import builder, runs
from rltk.dashboard.schema import form_description

STATIC = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
MAX_BODY = 1 << 20


def _static(name: str) -> bytes:
    return resources.files("rltk.dashboard").joinpath("static", name).read_bytes()


@lru_cache(maxsize=1)
def _form() -> dict:
    return {**form_description(), "recipes": builder.recipes()}


def known_keys() -> set[str]:
    out: set[str] = set()

    def walk(section):
        out.update(f["key"] for f in section["fields"])
        for sub in section["sections"]:
            walk(sub)

    walk(_form()["schema"])
    return out


class Dashboard(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, runs_root: Path, save_dir: Path):
        super().__init__((host, port), Handler)
        self.runs_root, self.save_dir = Path(runs_root), Path(save_dir)
        self.token = secrets.token_urlsafe(24)
        self.lock = threading.Lock()  # validation loads configs through process-wide state (the registry)
        self.warming = threading.Event()  # set once the background warm-up (see serve) has been started
        self.warm_up = lambda: None

    def start_warm_up(self) -> None:
        """Start the background warm-up, once: called after the first answer (see the module's Speed note)."""
        if not self.warming.is_set():
            self.warming.set()
            threading.Thread(target=self.warm_up, daemon=True).start()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/"

    def allowed_hosts(self) -> set[str]:
        host, port = self.server_address[:2]
        names = {host, "localhost", "127.0.0.1"} if host in ("127.0.0.1", "localhost") else {host}
        return {f"{name}:{port}" for name in names}


class Handler(BaseHTTPRequestHandler):
    server: Dashboard

    def log_message(self, format, *args):  # quiet: the terminal shows the URL, not every poll
        pass

    def handle(self) -> None:
        try:
            super().handle()
        finally:
            self.server.start_warm_up()

    # ------------------------------------------------------------ plumbing
    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, payload, status: int = 200) -> None:
        self._send(status, json.dumps(payload, allow_nan=False, default=str).encode(), "application/json")

    def _error(self, status: int, message: str) -> None:
        self._json({"error": message}, status)

    def _host_ok(self) -> bool:
        if self.headers.get("Host", "") in self.server.allowed_hosts():
            return True
        self._error(HTTPStatus.MISDIRECTED_REQUEST, "unexpected Host header")
        return False

    # ------------------------------------------------------------ GET
    def do_GET(self):
        if not self._host_ok():
            return
        url = urlsplit(self.path)
        path = unquote(url.path)
        try:
            if path in ("/", "/index.html"):
                page = _static("index.html").replace(b"{{TOKEN}}", self.server.token.encode())
                return self._send(200, page, "text/html; charset=utf-8")
            if path.startswith("/static/") and path[8:] in STATIC:
                return self._send(200, _static(path[8:]), STATIC[path[8:]])
            if path == "/api/form":
                return self._json(_form())
            if path == "/api/runs":
                return self._json({"root": str(self.server.runs_root.resolve()),
                                   "runs": runs.list_runs(self.server.runs_root)})
            if path.startswith("/api/runs/"):
                return self._run_request(path[len("/api/runs/"):], parse_qs(url.query))
        except runs.RunNotFound as exc:
            return self._error(404, str(exc))
        self._error(404, f"no such page: {path}")

    def _run_request(self, rest: str, query: dict) -> None:
        name, _, what = rest.partition("/")
        folder = runs.run_folder(self.server.runs_root, name)
        if what == "":
            return self._json(runs.run_overview(folder))
        if what == "traces":
            try:
                step = int(query.get("step", [""])[0])
            except ValueError:
                return self._error(400, "traces needs ?step=<global step>")
            return self._json({"step": step, "traces": runs.step_traces(folder, step)})
        if what == "curves.png" and (folder / "curves.png").is_file():
            return self._send(200, (folder / "curves.png").read_bytes(), "image/png")
        self._error(404, f"no such page: {rest}")

    # ------------------------------------------------------------ POST
    def do_POST(self):
        if not self._host_ok():
            return
        if not secrets.compare_digest(self.headers.get("X-Rltk-Token", ""), self.server.token):
            return self._error(403, "missing or wrong X-Rltk-Token (reload the page)")
        if not self.headers.get("Content-Type", "").startswith("application/json"):
            return self._error(415, "send application/json")
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            return self._error(413, "request too large")
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
            recipe = str(body.get("recipe") or "grpo")
            overrides = [str(o) for o in body.get("overrides") or []]
        except (json.JSONDecodeError, AttributeError, TypeError):
            return self._error(400, "body must be a JSON object {recipe, overrides: [key=value, ...]}")
        path = urlsplit(self.path).path
        with self.server.lock:
            if path == "/api/build":
                return self._json(builder.build(recipe, overrides, known_keys()))
            if path == "/api/save":
                try:
                    result = builder.save(recipe, overrides, str(body.get("name") or ""), self.server.save_dir,
                                          known_keys())
                except ValueError as exc:
                    return self._error(400, str(exc))
                return self._json(result)
        self._error(404, f"no such endpoint: {path}")


def serve(host: str = "127.0.0.1", port: int = 8765, runs_root: str | Path = "runs", save_dir: str | Path = ".",
          ready=None) -> None:
    """Serve until interrupted; ``ready(server)`` is called once it listens (tests read ``server.url``)."""
    server = Dashboard(host, port, Path(runs_root), Path(save_dir))
    # warm the validation path (its first call imports the models and data layers) before the first click
    def warm():
        with server.lock:
            builder.build("grpo", [], known_keys())
        # What is loaded now (torch, transformers, the registry) stays for the server's life: freeze it out of
        # the garbage collector's reach. Otherwise every few edits a full collection walks all of it (~130 ms,
        # doubling that edit's validation), to free the cycles that each validation's config nodes leave.
        gc.collect()
        gc.freeze()

    server.warm_up = warm  # started after the first answer: its imports would delay that answer
    if ready is not None:
        ready(server)
    try:
        server.serve_forever()
    finally:
        server.server_close()
