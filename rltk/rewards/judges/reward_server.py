"""A reward model behind HTTP, for ``reward_model``'s ``url`` form: ``rltk serve-reward PATH``.

Run it where the reward model fits (another machine, another GPU)::

    rltk serve-reward runs/rm/model --host 0.0.0.0 --port 8001 --device cuda
    # or, without the CLI:  python -m rltk.rewards.judges.reward_server runs/rm/model --port 8001

and point the trainer at it: ``reward.reward_fn_args.reward_model.url=http://HOST:8001/score``.

The protocol (JSON over HTTP, no authentication: keep it on a private network or behind a proxy):

* ``POST /score`` with ``{"prompts": [str, ...], "responses": [str, ...]}`` (equal lengths; the
  text scored is ``prompt + response``) or ``{"texts": [str, ...]}`` (whole texts) answers
  ``{"scores": [float, ...]}``: the model's raw output per text, in order. The client applies
  its own ``sigmoid``/``scale``/``offset``.
* ``GET /health`` answers ``{"status": "ok", "model": PATH}``.
* A malformed request answers 400 with ``{"error": "..."}`` saying what is wrong; a body over
  ``--max-body-bytes`` 413, more than ``--max-texts`` texts 400. A failure of the model answers
  500 (the client retries those).

Requests are served by threads; the forward passes take turns on the one model (a lock), each
request in micro-batches of ``--micro-batch-size`` texts cut to ``--max-length`` tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rltk.rewards.judges.reward_model import DTYPES, TRUNCATION_SIDES, RewardModelScorer


def _is_strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def parse_request(body: Any, max_texts: int) -> tuple[list[str], list[str]]:
    """``(prompts, responses)`` of a ``/score`` body; ``ValueError`` saying what is wrong with it."""
    if not isinstance(body, dict):
        raise ValueError('the body must be a JSON object: {"prompts": [...], "responses": [...]} or {"texts": [...]}')
    if "texts" in body:
        if set(body) != {"texts"} or not _is_strings(body["texts"]):
            raise ValueError('"texts" must be a list of strings, alone in the body')
        prompts, responses = [""] * len(body["texts"]), list(body["texts"])
    elif set(body) == {"prompts", "responses"}:
        prompts, responses = body["prompts"], body["responses"]
        if not (_is_strings(prompts) and _is_strings(responses)) or len(prompts) != len(responses):
            raise ValueError('"prompts" and "responses" must be lists of strings of the same length')
    else:
        raise ValueError(f'expected the keys "prompts" and "responses", or "texts"; got {sorted(body)}')
    if len(prompts) > max_texts:
        raise ValueError(f"{len(prompts)} texts in one request; this server takes at most {max_texts} (--max-texts)")
    return list(prompts), list(responses)


def make_server(scorer: RewardModelScorer, host: str = "127.0.0.1", port: int = 0, *,
                max_texts: int = 4096, max_body_bytes: int = 64 * 2**20) -> ThreadingHTTPServer:
    """A threaded HTTP server scoring with ``scorer`` (call ``serve_forever()``; ``server_address`` has the port)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # one line per request is noise here
            pass

        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/health":
                self._reply(200, {"status": "ok", "model": scorer.path})
            else:
                self._reply(404, {"error": f"no route GET {self.path}; POST /score or GET /health"})

        def do_POST(self) -> None:
            if self.path.rstrip("/") != "/score":
                self._reply(404, {"error": f"no route POST {self.path}; POST /score"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            if length > max_body_bytes:
                self.close_connection = True
                self._reply(413, {"error": f"body of {length} bytes; at most {max_body_bytes} (--max-body-bytes)"})
                return
            try:
                prompts, responses = parse_request(json.loads(self.rfile.read(length) or b"null"), max_texts)
            except ValueError as exc:  # json.JSONDecodeError is a ValueError
                self._reply(400, {"error": str(exc)})
                return
            try:
                scores = scorer.score(prompts, responses)
            except Exception as exc:  # the model failed, not the request: 500, which clients retry
                self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})
                return
            self._reply(200, {"scores": scores})

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``rltk serve-reward`` (and of ``python -m rltk.rewards.judges.reward_server``)."""
    parser.add_argument("path", help="the reward model's Hugging Face folder (num_labels=1, with its tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8001, help="port (default 8001; 0 picks a free one)")
    parser.add_argument("--device", default="cpu", help="where the model runs (default cpu)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--max-length", type=int, default=1024, help="tokens read per text (default 1024)")
    parser.add_argument("--truncation-side", default="left", choices=TRUNCATION_SIDES,
                        help="which end of a longer text is cut (default left: keep the response's end)")
    parser.add_argument("--micro-batch-size", type=int, default=16, help="texts per forward pass (default 16)")
    parser.add_argument("--max-texts", type=int, default=4096, help="most texts one request may send")
    parser.add_argument("--max-body-bytes", type=int, default=64 * 2**20, help="largest request body")


def run(args: argparse.Namespace) -> int:
    """Load the model and serve until interrupted; 2 with a one-line error for a bad folder or address."""
    for flag in ("max_length", "micro_batch_size", "max_texts", "max_body_bytes"):
        if getattr(args, flag) < 1:
            print(f"rltk serve-reward: error: --{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}",
                  file=sys.stderr)
            return 2
    try:
        scorer = RewardModelScorer(args.path, device=args.device, dtype=args.dtype, max_length=args.max_length,
                                   truncation_side=args.truncation_side, micro_batch_size=args.micro_batch_size,
                                   config_key="PATH")
    except (ValueError, OSError) as exc:
        print(f"rltk serve-reward: error: {exc}", file=sys.stderr)
        return 2
    try:
        server = make_server(scorer, args.host, args.port, max_texts=args.max_texts,
                             max_body_bytes=args.max_body_bytes)
    except OSError as exc:
        print(f"rltk serve-reward: error: cannot listen on {args.host}:{args.port} (--host/--port): {exc}",
              file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    print(f"serving reward model {scorer.path} at http://{host}:{port}/score", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rltk.rewards.judges.reward_server",
                                     description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
