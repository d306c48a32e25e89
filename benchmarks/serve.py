"""Benchmark: 32 concurrent `openai`-client agents through the endpoint vs direct batched `engine.generate`.

    python benchmarks/serve.py                  # 32 agents, 48 new tokens, 4 alternated rounds (~1-2 min)
    python benchmarks/serve.py --agents 64 --tokens 32 --rounds 6

The same 32 chat prompts (two-digit sums in the tiny chat template) are answered
two ways on one engine (``hf``, a random-init Qwen2 of hidden 256 / 4 layers over
the tiny char vocabulary, fp32, CPU):

* ``direct``: the prompts rendered with the chat template and sampled in one
  ``engine.generate`` call (what the ``single_turn`` workflow does);
* ``endpoint``: 32 threads, each an ``openai.OpenAI`` client with its own session
  header, send one ``chat.completions.create`` each at the same moment to the
  endpoint served in this process (uvicorn thread + batcher); timed from the
  first request to the last response, HTTP, JSON, chat rendering, batching and
  recording included.

Every completion is exactly ``--tokens`` long (no stop token), so both sides
generate the same number of tokens; tokens/s is completion tokens per wall
second, and per second of this process's CPU time (all threads: the HTTP and
client work included), which other jobs on shared cores disturb less. The two run alternated, round after round (the order flips each round),
and the ratio endpoint/direct is taken within each round; the median is
reported with the engine calls the endpoint made. Prints a table and writes JSON
under ``benchmarks/results/``.

Target (issue #11): endpoint >= 0.7x direct tokens/s.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def build(tokens: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rltk.models.tiny import build_char_tokenizer
    from rltk.rollout.hf import HFRolloutEngine

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    return tokenizer, HFRolloutEngine(model, tokenizer, batch_size=256)


def prompts(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"{10 + i % 90}+{(7 * i) % 90 + 10}="}] for i in range(count)]


def run_direct(engine, tokenizer, conversations, tokens: int) -> dict:
    from rltk.rollout.base import SamplingParams

    ids = [tokenizer(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"] for c in conversations]
    tick, cpu = time.perf_counter(), time.process_time()
    out = engine.generate(ids, SamplingParams(max_new_tokens=tokens, stop_token_ids=[]))
    wall, cpu = time.perf_counter() - tick, time.process_time() - cpu
    generated = sum(len(c.token_ids) for group in out for c in group)
    return {"wall_s": wall, "cpu_s": cpu, "tokens": generated, "tokens_per_s": generated / wall,
            "tokens_per_cpu_s": generated / cpu, "engine_calls": 1}


def run_endpoint(server, conversations, tokens: int, round_number: int) -> dict:
    import openai

    state = server.app.state.rltk
    before = state.batcher.stats()["engine_calls"]
    clients = [openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                             default_headers={"X-Session-Id": f"r{round_number}-a{i}"})
               for i in range(len(conversations))]
    results = [None] * len(conversations)
    go = threading.Barrier(len(conversations) + 1)

    def agent(i):
        go.wait()
        reply = clients[i].chat.completions.create(model="bench", messages=conversations[i], max_tokens=tokens)
        results[i] = reply.usage.completion_tokens

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(conversations))]
    for t in threads:
        t.start()
    go.wait()
    tick, cpu = time.perf_counter(), time.process_time()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - tick, time.process_time() - cpu
    for client in clients:
        client.close()
    generated = sum(results)
    return {"wall_s": wall, "cpu_s": cpu, "tokens": generated, "tokens_per_s": generated / wall,
            "tokens_per_cpu_s": generated / cpu, "engine_calls": state.batcher.stats()["engine_calls"] - before}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--window", type=float, default=0.05, help="batcher window_s")
    args = parser.parse_args()

    import torch

    from rltk.rollout.base import SamplingParams
    from rltk.serve.app import BackgroundServer, create_app
    from rltk.serve.sessions import SessionStore

    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokenizer, engine = build(args.tokens)
    conversations = prompts(args.agents)
    app = create_app(engine, tokenizer, model_name="bench",
                     defaults=SamplingParams(max_new_tokens=args.tokens, stop_token_ids=[]),
                     max_tokens_limit=args.tokens, max_model_len=256, window_s=args.window,
                     max_batch=max(64, args.agents), store=SessionStore())  # recording, as training does
    rows = []
    with BackgroundServer(app) as server:
        run_direct(engine, tokenizer, conversations[:4], 4)  # warm-up: first-call allocations
        run_endpoint(server, conversations[:4], 4, -1)
        for round_number in range(args.rounds):
            order = ["direct", "endpoint"] if round_number % 2 == 0 else ["endpoint", "direct"]
            result = {}
            for case in order:
                # the batcher thread owns the engine while serving; direct calls run between endpoint rounds
                result[case] = (run_direct(engine, tokenizer, conversations, args.tokens) if case == "direct"
                                else run_endpoint(server, conversations, args.tokens, round_number))
            result["ratio"] = result["endpoint"]["tokens_per_s"] / result["direct"]["tokens_per_s"]
            result["cpu_ratio"] = result["endpoint"]["tokens_per_cpu_s"] / result["direct"]["tokens_per_cpu_s"]
            rows.append(result)
            print(f"round {round_number}: direct {result['direct']['tokens_per_s']:8.1f} tok/s | endpoint "
                  f"{result['endpoint']['tokens_per_s']:8.1f} tok/s in {result['endpoint']['engine_calls']} engine "
                  f"call(s) | ratio {result['ratio']:.3f} (cpu time {result['cpu_ratio']:.3f})", flush=True)
    ratios = [r["ratio"] for r in rows]
    cpu_ratios = [r["cpu_ratio"] for r in rows]
    summary = {
        "agents": args.agents, "tokens": args.tokens, "rounds": args.rounds, "window_s": args.window,
        "median_ratio": statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
        "median_cpu_ratio": statistics.median(cpu_ratios), "min_cpu_ratio": min(cpu_ratios),
        "max_cpu_ratio": max(cpu_ratios),
        "median_engine_calls": statistics.median(r["endpoint"]["engine_calls"] for r in rows),
        "target": 0.7, "rows": rows, "python": sys.version.split()[0], "machine": platform.machine(),
        "torch_threads": torch.get_num_threads(), "when": datetime.now(timezone.utc).isoformat(),
    }
    print(f"\n{'case':<10} {'median tok/s':>13} {'tok/cpu-s':>10}")
    for case in ("direct", "endpoint"):
        print(f"{case:<10} {statistics.median(r[case]['tokens_per_s'] for r in rows):13.1f} "
              f"{statistics.median(r[case]['tokens_per_cpu_s'] for r in rows):10.1f}")
    print(f"endpoint/direct: median {summary['median_ratio']:.3f} (min {summary['min_ratio']:.3f}, max "
          f"{summary['max_ratio']:.3f}; target >= 0.7); by process cpu time median {summary['median_cpu_ratio']:.3f} "
          f"(min {summary['min_cpu_ratio']:.3f}, max {summary['max_cpu_ratio']:.3f}); engine calls per round "
          f"(median) {summary['median_engine_calls']}")
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / f"serve-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%S')}.json"
    out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
