"""Benchmark: multi-turn rollout with batched stepping against one episode at a time.

    python benchmarks/multi_turn.py                 # 64 episodes x 4 turns, 3 rounds (~1-2 min on 2 shared cores)
    python benchmarks/multi_turn.py --episodes 16 --rounds 1

The ``multi_turn`` workflow (:mod:`rltk.workflows.multi_turn`) on the tiny
model (random init, ``rltk.models.tiny``, fp32, one torch thread) and the
``hf`` engine, with an environment (defined here) that answers every
assistant turn with a user message and ends the episode after ``--turns``
turns. Cases, on the same rows:

* ``batched``: one ``run`` over all episodes: one engine call per turn with every live episode;
* ``sequential``: one ``run`` per episode (the same workflow, one row, ``n=1``):
  one engine call per turn per episode, what a loop over episodes does.

Every turn generates exactly ``--tokens`` tokens (no stop token), greedily, so
both cases do the same work and produce the same ids (checked: the script fails
if any trajectory differs). The cases alternate order round after round;
the ratio is taken within each round, on wall time and on process CPU time.
Prints a table and writes JSON under ``benchmarks/results/``.

Target (issue #11): batched >= 5x episodes/s of sequential.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import types
from datetime import datetime, timezone
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def build(turns: int, tokens: int, seed: int):
    import torch

    import rltk
    from rltk.environments.base import Environment, StepResult
    from rltk.models.tiny import build_char_tokenizer, build_tiny_model
    from rltk.rollout.base import SamplingParams
    from rltk.rollout.hf import HFRolloutEngine
    from rltk.workflows.multi_turn import MultiTurnWorkflow

    class Feedback(Environment):
        """Says "try again" after every turn; done after `turns` turns, reward 0.1 a turn."""

        def __init__(self, turns: int):
            self.turns, self.seen = turns, 0

        def reset(self, row):
            return [{"role": "user", "content": row["prompt"]}]

        def step(self, turn):
            self.seen += 1
            return StepResult([{"role": "user", "content": "try again"}], reward=0.1, done=self.seen >= self.turns)

    from rltk.registry import get_registry
    import rltk.tools.parsers

    registry = get_registry()
    if not registry.pm.is_registered(rltk.tools.parsers):  # an install older than the tool_parsers entry point
        rltk.register_plugin(rltk.tools.parsers, "rltk:tool_parsers")
    plugin = types.ModuleType("benchmark_multi_turn")
    plugin.rltk_environments = lambda: {"benchmark_feedback": Feedback}
    rltk.register_plugin(plugin, "benchmark_multi_turn")
    tokenizer = build_char_tokenizer()
    torch.manual_seed(seed)
    model = build_tiny_model(tokenizer, max_position_embeddings=512, seed=seed)
    engine = HFRolloutEngine(model, tokenizer, batch_size=64)
    sampling = SamplingParams(n=1, greedy=True, max_new_tokens=tokens, stop_token_ids=[])
    env = {"environment": "benchmark_feedback", "environment_args": {"turns": turns}, "max_turns": turns,
           "max_total_tokens": 4096}
    return MultiTurnWorkflow(engine=engine, tokenizer=tokenizer, reward=lambda **_: 0.0, sampling=sampling, env=env)


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8, help="tokens generated per turn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    workflow = build(args.turns, args.tokens, args.seed)
    rows = [{"prompt": f"{i * 37 % 1000}+{i * 11 % 100}=", "ground_truth": "", "id": str(i)}
            for i in range(args.episodes)]

    def batched():
        return workflow.run(rows)

    def sequential():
        return [e for row in rows for e in workflow.run([row])]

    workflow.run(rows[:2])  # warm-up: first-call allocations are no case's cost
    rounds = []
    for r in range(args.rounds):
        order = [("batched", batched), ("sequential", sequential)]
        if r % 2:
            order.reverse()
        measured = {}
        for name, fn in order:
            experiences, wall, cpu = timed(fn)
            measured[name] = {"wall_s": wall, "cpu_s": cpu, "experiences": experiences}
        b, s = measured["batched"]["experiences"], measured["sequential"]["experiences"]
        same = all(x.prompt_ids == y.prompt_ids and x.response_ids == y.response_ids and
                   x.response_mask == y.response_mask for x, y in zip(b, s)) and len(b) == len(s)
        if not same:
            print("FAIL: batched and sequential trajectories differ", file=sys.stderr)
            return 1
        turns = sum(e.info["turns"] for e in b)
        rounds.append({
            "batched_wall_s": measured["batched"]["wall_s"], "sequential_wall_s": measured["sequential"]["wall_s"],
            "batched_cpu_s": measured["batched"]["cpu_s"], "sequential_cpu_s": measured["sequential"]["cpu_s"],
            "speedup_wall": measured["sequential"]["wall_s"] / measured["batched"]["wall_s"],
            "speedup_cpu": measured["sequential"]["cpu_s"] / measured["batched"]["cpu_s"],
            "turns": turns, "generated_tokens": sum(sum(e.response_mask) for e in b),
            "response_tokens": sum(len(e.response_ids) for e in b), "first": order[0][0],
        })

    def med(key):
        return statistics.median(r[key] for r in rounds)

    print(f"\nmulti_turn rollout: {args.episodes} episodes x {args.turns} turns x {args.tokens} tokens/turn, "
          f"tiny model, {args.threads} thread(s), {args.rounds} rounds (median; ratios within each round)\n")
    print("| case | wall s | cpu s | episodes/s (wall) | engine calls |")
    print("|---|---|---|---|---|")
    for name, calls in (("batched", args.turns), ("sequential", args.turns * args.episodes)):
        print(f"| {name} | {med(name + '_wall_s'):.3f} | {med(name + '_cpu_s'):.3f} | "
              f"{args.episodes / med(name + '_wall_s'):.1f} | {calls} |")
    per_round = ", ".join(f"{r['speedup_wall']:.1f}" for r in rounds)
    print(f"\nbatched vs sequential: {med('speedup_wall'):.1f}x wall (rounds: "
          f"{per_round}), {med('speedup_cpu'):.1f}x cpu; target >= 5x. "
          f"Identical trajectories in every round.")

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"multi_turn-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps({
        "args": vars(args), "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "load_average": os.getloadavg(), "rounds": rounds,
        "speedup_wall_median": med("speedup_wall"), "speedup_cpu_median": med("speedup_cpu"),
    }, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
