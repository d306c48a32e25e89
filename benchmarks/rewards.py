"""Reward scoring per step: worker processes and in-process builtins against the old thread per call.

rltk used to call every reward function in a fresh thread joined with a
timeout (``old`` below): a call that overran was abandoned but kept running,
so a reward that spins made every later step slower, and hung calls were
waited for one after another. Now builtins (marked bounded) run in-process in
one pass per step, and other rewards run in worker processes that are killed
on timeout, all samples of a step timed in parallel (``new``).

Each row times scoring one step's samples (default 16 prompts x 8 samples,
the shipped GRPO default), medians over ``--rounds`` alternated old/new
rounds (the spin cases: ratios to the clean steps just before, within each round):

* builtins: the default ``exact_match``, and ``math_answer`` + ``format_tags``.
* a user reward (not marked bounded, so it runs in workers; defined in this
  file): a clean step; a step where one sample spins in a pure-Python loop
  (target: new <= 1.2 x (timeout + clean step)); then the clean steps after it
  (target: back to the clean step's time). The old path's spinning threads
  never end, so its spin case runs last, in a subprocess of its own.

    python benchmarks/rewards.py [--samples 128] [--timeout 1.0] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import warnings

from rltk.rewards.builtin import rltk_reward_fns
from rltk.rewards.compose import RewardComposer, RewardSpec


# ---- a user's reward: not marked bounded, so it runs in worker processes ----


def user_reward(*, response: str, ground_truth: str) -> float:
    """Exact match on the last line; spins forever on a response containing SPIN (a bug in the reward)."""
    if "SPIN" in response:
        n = 0
        while True:
            n += 1
    return float(response.strip().splitlines()[-1:] == [ground_truth])


# ---- the old path, for the baseline: one daemon thread per call, joined with the timeout ----


class ThreadPerCall:
    """What RewardComposer did before: each call in a fresh thread, waited for up to ``timeout_s``."""

    def __init__(self, specs: list[RewardSpec], timeout_s: float, fallback: float = 0.0):
        self.specs, self.timeout_s, self.fallback = specs, timeout_s, fallback

    def score_batch(self, samples):
        return [self.score(s) for s in samples]

    def score(self, sample):
        total, details = 0.0, {}
        for spec in self.specs:
            outcome = {}

            def run(spec=spec, outcome=outcome):
                try:
                    outcome["value"] = spec.fn(**{k: sample[k] for k in _fields(spec.fn)}, **spec.args)
                except BaseException as exc:  # noqa: BLE001 - the old path caught everything too
                    outcome["error"] = exc

            worker = threading.Thread(target=run, daemon=True)
            worker.start()
            worker.join(self.timeout_s)
            if worker.is_alive() or "error" in outcome:
                score = self.fallback
            else:
                score = float(outcome["value"])
            details[spec.name] = score
            total += spec.weight * score
        return total, details


def _fields(fn):
    import inspect

    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return ("prompt", "response", "ground_truth", "extras")
    return tuple(a for a in ("prompt", "response", "ground_truth", "extras") if a in params)


# ---- the batch ----


def make_samples(count: int, spin_at: int | None = None) -> list[dict]:
    samples = []
    for i in range(count):
        a, b = divmod(i * 37 % 100, 10)
        truth = str(a + b)
        response = truth if i % 3 else str(a + b + 1)  # two in three correct
        samples.append({"prompt": f"{a}+{b}=", "response": response, "ground_truth": truth, "extras": {}})
    if spin_at is not None:
        samples[spin_at]["response"] = "SPIN"
    return samples


def builtin_specs(names):
    return [RewardSpec(n, rltk_reward_fns()[n], 1.0,
                       {"tags": ["answer"]} if n == "format_tags" else {}) for n in names]


def timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def median_alternated(old, new, samples, rounds):
    t_old, t_new = [], []
    for _ in range(rounds):
        t_old.append(timed(old.score_batch, samples))
        t_new.append(timed(new.score_batch, samples))
    return statistics.median(t_old), statistics.median(t_new)


def old_spin_case(count: int, timeout: float, after: int) -> dict:
    """The old path with one spinning sample, then clean steps beside the abandoned spinning thread."""
    old = ThreadPerCall([RewardSpec("user", user_reward)], timeout)
    clean = make_samples(count)
    clean_s = statistics.median(timed(old.score_batch, clean) for _ in range(3))
    spin_s = timed(old.score_batch, make_samples(count, spin_at=count // 2))
    after_s = [timed(old.score_batch, clean) for _ in range(after)]
    return {"clean_s": clean_s, "spin_s": spin_s, "after_s": after_s}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=128, help="samples per step (16 prompts x 8 by default)")
    parser.add_argument("--timeout", type=float, default=1.0, help="reward timeout_s (seconds)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--after", type=int, default=3, help="clean steps timed after the spinning one")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results/rewards.json")
    parser.add_argument("--old-spin-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.simplefilter("ignore", RuntimeWarning)  # the spinning sample's failure warning
    if args.old_spin_only:
        print(json.dumps(old_spin_case(args.samples, args.timeout, args.after)))
        return

    rows = []

    def report(case, old_s, new_s, ratio_name, ratio, target=""):
        rows.append({"case": case, "old_s": old_s, "new_s": new_s, ratio_name: ratio})
        old_text = f"{old_s:9.4f}" if old_s is not None else f"{'-':>9s}"
        print(f"{case:52s} {old_text} {new_s:9.4f} {ratio_name:>24s} {ratio:7.2f} {target}")

    print(f"{args.samples} samples per step, timeout_s={args.timeout}, {args.workers} workers, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"{'case':52s} {'old s':>9s} {'new s':>9s} {'ratio':>24s}")
    clean = make_samples(args.samples)

    # builtins: in-process, one pass, no thread per call
    for names in (["exact_match"], ["math_answer", "format_tags"]):
        specs = builtin_specs(names)
        new = RewardComposer(specs, timeout_s=args.timeout)
        assert new.in_process == names
        old = ThreadPerCall(builtin_specs(names), args.timeout)
        assert [r[0] for r in old.score_batch(clean)] == [r[0] for r in new.score_batch(clean)]
        t_old, t_new = median_alternated(old, new, clean, args.rounds)
        report(f"builtins {'+'.join(names)}", t_old, t_new, "old / new", t_old / t_new)

    # a user reward in worker processes
    new = RewardComposer([RewardSpec("user", user_reward)], timeout_s=args.timeout, workers=args.workers)
    old = ThreadPerCall([RewardSpec("user", user_reward)], args.timeout)
    new.score_batch(clean)  # workers started once, then reused by every step
    t_old, t_clean = median_alternated(old, new, clean, args.rounds)
    report("user reward, clean step", t_old, t_clean, "old / new", t_old / t_clean)
    # Per round: clean steps just before, the spinning step, clean steps after; ratios within the
    # round, so load from other processes on a shared machine moves both sides alike.
    spin_ratios, first_ratios, rest_ratios, t_spins, t_firsts, t_rests, over_clean = [], [], [], [], [], [], []
    for _ in range(args.rounds):
        before = statistics.median(timed(new.score_batch, clean) for _ in range(3))
        spun = []
        t_spin = timed(lambda: spun.append(new.score_batch(make_samples(args.samples, 5))))
        assert spun[0][5] == (0.0, {"user": 0.0}), "the spinning sample must get the fallback"
        after = [timed(new.score_batch, clean) for _ in range(args.after)]
        rest = statistics.median(after[1:] or after)
        spin_ratios.append(t_spin / (args.timeout + before))
        over_clean.append(t_spin / before)
        first_ratios.append(after[0] / before)
        rest_ratios.append(rest / before)
        t_spins.append(t_spin)
        t_firsts.append(after[0])
        t_rests.append(rest)
    t_spin, after_first, after_rest = (statistics.median(x) for x in (t_spins, t_firsts, t_rests))
    spin_ratio, first_ratio, rest_ratio = (statistics.median(x) for x in (spin_ratios, first_ratios, rest_ratios))

    # the old path with a spinning sample, last and in its own process: its thread never stops
    out = subprocess.run([sys.executable, __file__, "--old-spin-only", "--samples", str(args.samples),
                          "--timeout", str(args.timeout), "--after", str(args.after)],
                         capture_output=True, text=True, timeout=600, env={**os.environ})
    old_spin = json.loads(out.stdout.strip().splitlines()[-1])
    report("user reward, step with one spinning sample", old_spin["spin_s"], t_spin,
           "new / (timeout + clean)", spin_ratio, "(target <= 1.2)")
    old_first = old_spin["after_s"][0]
    old_rest = statistics.median(old_spin["after_s"][1:] or old_spin["after_s"])
    report("user reward, first clean step after it", old_first, after_first, "new / clean",
           first_ratio, f"(old / old clean: {old_first / old_spin['clean_s']:.1f})")
    report("user reward, later clean steps", old_rest, after_rest, "new / clean",
           rest_ratio, f"(old / old clean: {old_rest / old_spin['clean_s']:.1f})")
    stats = new.stats()
    new.close()
    print(f"new: {stats['timeouts/user']:.0f} timeouts, {stats['worker_restarts']:.0f} workers replaced; the spinning "
          f"step took {statistics.median(over_clean):.0f}x a clean step, i.e. one timeout")

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"samples": args.samples, "timeout_s": args.timeout, "workers": args.workers,
                   "rounds": args.rounds, "cpus": os.cpu_count(), "load_average": os.getloadavg()[0],
                   "spin_ratio_target": 1.2, "spin_step_over_clean_step": statistics.median(over_clean),
                   "old_spin_case": old_spin, "results": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
