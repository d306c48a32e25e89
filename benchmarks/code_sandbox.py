"""What the ``code_execution`` reward's sandbox costs: per test, per sample, per step, and with a hostile sample.

Rows (medians over ``--rounds``):

* ``bare python``: one ``python -I -S -c pass`` on this machine, the floor a
  fresh interpreter per test cannot beat.
* ``1 test`` / ``3 tests``: one sample scored by ``code_execution`` in this
  process (namespaces, private root, one interpreter per test).
* ``step``: ``--samples`` samples of 3 assert tests each through the composer
  with ``--workers`` worker processes, as a training step scores them.
* ``step + 1 loop``: the same step with one sample's program an infinite
  loop (``timeout_s`` per test): the step should take about one sample's
  worst case, tests x timeout_s, more than the clean step, not more.

    python benchmarks/code_sandbox.py [--samples 16] [--workers 4] [--rounds 3] [--out FILE]

Needs Linux, root and util-linux's ``unshare`` (what the reward needs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from rltk.rewards.compose import build_reward_composer
from rltk.rewards.programs.code_execution import code_execution

TESTS = '["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]'
GOOD = "```python\ndef add(a, b):\n    return a + b\n```"
LOOP = "```python\nwhile True:\n    pass\n```"
LIMITS = {"timeout_s": 2.0, "cpu_s": 2}


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    composer = build_reward_composer([{"fn": "code_execution", "args": LIMITS}], timeout_s=60,
                                     workers=args.workers)
    composer.start()
    clean = [{"prompt": "", "response": GOOD, "ground_truth": TESTS} for _ in range(args.samples)]
    hostile = [{"prompt": "", "response": LOOP, "ground_truth": TESTS}] + clean[1:]
    rows: dict[str, list[float]] = {k: [] for k in ("bare python", "1 test", "3 tests", "step", "step + 1 loop")}
    try:
        composer.score_batch(clean[:args.workers])  # warm the workers
        for _ in range(args.rounds):
            rows["bare python"].append(timed(lambda: subprocess.run([sys.executable, "-I", "-S", "-c", "pass"],
                                                                    check=True)))
            rows["1 test"].append(timed(lambda: code_execution(response=GOOD, ground_truth='["assert True"]',
                                                               **LIMITS)))
            rows["3 tests"].append(timed(lambda: code_execution(response=GOOD, ground_truth=TESTS, **LIMITS)))
            rows["step"].append(timed(lambda: composer.score_batch(clean)))
            rows["step + 1 loop"].append(timed(lambda: composer.score_batch(hostile)))
    finally:
        composer.close()
    medians = {k: statistics.median(v) for k, v in rows.items()}
    print(f"{'case':<16} {'median s':>9}   (samples={args.samples}, workers={args.workers}, "
          f"timeout_s={LIMITS['timeout_s']}, rounds={args.rounds})")
    for name, value in medians.items():
        print(f"{name:<16} {value:>9.3f}")
    extra = medians["step + 1 loop"] - medians["step"]
    print(f"one looping sample added {extra:.2f} s to the step (its worst case: 3 tests x "
          f"{LIMITS['timeout_s']} s = {3 * LIMITS['timeout_s']:.1f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "limits": LIMITS, "seconds": rows, "medians": medians}, f, indent=2)


if __name__ == "__main__":
    main()
