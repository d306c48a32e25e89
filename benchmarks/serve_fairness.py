"""Benchmark: a well-behaved client's latency with an abusive client on the same `rltk serve` (issue 28).

    python benchmarks/serve_fairness.py                      # 3 alternated rounds x 12 requests (~2-3 min)
    python benchmarks/serve_fairness.py --slice-tokens 0     # whole completions per engine call, for comparison
    python benchmarks/serve_fairness.py --rounds 5 --requests 20 --abusers 2

`rltk serve` (the untrained tiny model of the embedded default, ``hf`` engine, one thread, on
127.0.0.1 only, port picked by the OS) runs in a subprocess; this process is the clients:

* the well-behaved client sends one completion at a time (``--good-tokens`` new tokens, one prompt,
  n=1) and times each from request to response;
* each of ``--abusers`` threads sends, back to back, the largest request the server's default limits
  allow (64 prompts x n=2 = 128 choices x 250 tokens = 32 000 tokens, under ``--max-request-tokens``
  32 768; 250 is what the 256-position context leaves after the 6-token prompts) and hangs up
  ``--cancel-after`` seconds later, before it is done.

Rounds alternate the two conditions ("alone", then "abused"), so drift of a shared machine hits both;
the figure is the median latency abused over the median alone, per round, and its median over rounds.
The untrained model seldom emits its stop token, so completions run to their ``max_tokens``.
Target (issue 28): at most 2x. Prints a table and writes JSON under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def start_server(slice_tokens: int, max_share_tokens: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "rltk.commands.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                             "--log-level", "warning", "--slice-tokens", str(slice_tokens),
                             "--max-share-tokens", str(max_share_tokens)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "serving model" in line:
            return proc, line.split(" at ")[1].split()[0]
        if proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit(f"rltk serve did not start within 180 s: {proc.stderr.read()[-2000:]}")


def good_latencies(url: str, count: int, tokens: int) -> list[float]:
    import httpx

    out = []
    with httpx.Client(timeout=120) as client:
        for k in range(count):
            start = time.monotonic()
            response = client.post(url + "/completions", json={"model": "tiny", "prompt": f"{k % 90 + 10}+7=",
                                                               "max_tokens": tokens})
            response.raise_for_status()
            out.append(time.monotonic() - start)
    return out


def abuse(url: str, stop: threading.Event, cancel_after: float, sent: list) -> None:
    import httpx

    # 6-token prompts leave 250 of the tiny model's 256 positions: 128 choices x 250 = 32 000 new tokens
    body = {"model": "tiny", "prompt": [f"{k}+{k}=" for k in range(10, 74)], "n": 2, "max_tokens": 250}
    while not stop.is_set():
        try:  # a fresh connection each time: the timeout closes it, which is the hang-up the server sees
            with httpx.Client(timeout=cancel_after) as client:
                response = client.post(url + "/completions", json=body)
            if response.status_code != 200:  # a refused request is no load: the figure would mean nothing
                sent.append(f"refused: {response.text[:300]}")
                stop.set()
                return
            sent.append("finished")
        except httpx.TimeoutException:
            sent.append("cancelled")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=12, help="well-behaved requests per condition and round")
    parser.add_argument("--good-tokens", type=int, default=16)
    parser.add_argument("--abusers", type=int, default=1)
    parser.add_argument("--cancel-after", type=float, default=1.0)
    parser.add_argument("--slice-tokens", type=int, default=16, help="the server's --slice-tokens (0: off)")
    parser.add_argument("--max-share-tokens", type=int, default=None,
                        help="the server's --max-share-tokens (default: rltk serve's own)")
    args = parser.parse_args(argv)

    if args.max_share_tokens is None:
        from rltk.commands.cli import build_parser

        args.max_share_tokens = build_parser().parse_args(["serve"]).max_share_tokens
    proc, url = start_server(args.slice_tokens, args.max_share_tokens)
    rounds = []
    try:
        good_latencies(url, 3, args.good_tokens)  # warm-up: first calls pay one-off costs
        for number in range(args.rounds):
            alone = good_latencies(url, args.requests, args.good_tokens)
            stop, sent = threading.Event(), []
            threads = [threading.Thread(target=abuse, args=(url, stop, args.cancel_after, sent), daemon=True)
                       for _ in range(args.abusers)]
            for thread in threads:
                thread.start()
            time.sleep(args.cancel_after / 2)  # the abuse is under way
            abused = good_latencies(url, args.requests, args.good_tokens)
            stop.set()
            for thread in threads:
                thread.join(timeout=60)
            refused = [item for item in sent if item.startswith("refused")]
            if refused:
                raise SystemExit(f"the server refused the abusive request: {refused[0]}")
            time.sleep(1.0)  # let the last cancelled request drain before the next "alone"
            row = {"round": number, "alone_median_s": statistics.median(alone),
                   "abused_median_s": statistics.median(abused),
                   "ratio": statistics.median(abused) / statistics.median(alone),
                   "abusive_requests": len(sent), "abusive_cancelled": sent.count("cancelled"),
                   "alone": alone, "abused": abused}
            rounds.append(row)
            print(f"round {number}: alone median {row['alone_median_s'] * 1000:7.1f} ms, abused median "
                  f"{row['abused_median_s'] * 1000:7.1f} ms, ratio {row['ratio']:.2f}x "
                  f"({row['abusive_cancelled']} of {row['abusive_requests']} abusive requests cancelled)", flush=True)
        # What the bound costs: one largest request, alone and left to finish.
        import httpx

        start = time.monotonic()
        done = httpx.post(url + "/completions", timeout=600, json={
            "model": "tiny", "prompt": [f"{k}+{k}=" for k in range(10, 74)], "n": 2, "max_tokens": 250}).json()
        large_s = time.monotonic() - start
        large_tokens = done["usage"]["completion_tokens"]
        print(f"one largest request alone: {large_tokens} tokens in {large_s:.2f} s "
              f"({large_tokens / large_s:.0f} tokens/s)")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    ratio = statistics.median(r["ratio"] for r in rounds)
    print(f"median over {len(rounds)} rounds: the well-behaved client's median latency abused / alone = {ratio:.2f}x "
          f"(target <= 2x; --slice-tokens {args.slice_tokens} --max-share-tokens {args.max_share_tokens}, "
          f"{args.abusers} abusive client(s))")
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    out = REPO / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"serve_fairness-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}.json"
    path.write_text(json.dumps({"args": vars(args), "ratio_median": ratio, "rounds": rounds, "load_average": load,
                                "largest_request_s": large_s, "largest_request_tokens": large_tokens,
                                "python": platform.python_version(), "machine": platform.machine()}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
