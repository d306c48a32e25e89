"""RL steps per hour and held-out gain of GRPO in each trainer.mode: sync, one_step_off, async (staleness 1, 4).

Each (mode, seed) is one `rltk run grpo` in a fresh process, one producer process beside the trainer in the
asynchronous modes (`rltk.training.rollouts.asynchronous.producer`). Modes run one after another within a
seed, their order rotated from seed to seed, so a load that drifts over the benchmark is spread over the
modes. Same seed, same warm-up: the modes differ only in the RL stage.

Reported per run, from its metrics.jsonl:

* ``steps_per_hour``: RL steps / the RL stage's time, the sum of ``time/step_s`` (each step's sampling or
  waiting for the producer, plus its update; held-out evaluations are outside it);
* ``steps_per_hour_after_first``: the same without the first step, whose wait includes the producers'
  start-up (building the model in a new process: seconds, paid once per stage);
* ``gain``: held-out greedy accuracy at the end of the run minus at the start of the RL stage;
* ``staleness``: the mean of ``staleness/mean`` over the steps (0 for sync);
* ``producer_*`` (async modes): the producer's median batch, from ``producer/*``: sampling, held back by the
  staleness gate, writing to the queue, loading weights;
* ``rollout_s`` / ``train_s``: the median step's sampling (sync) or wait for the producer (async), from
  ``time/rollout_s``, and the rest of its ``time/step_s`` (scoring the batch's advantages, the update).

and per mode: median steps per hour, its ratio to sync's, min / median / max gain.

    python benchmarks/async.py                                # embedded default, seeds 0-2
    python benchmarks/async.py --seeds 0 --quick              # tiny settings: checks that every mode runs
    python benchmarks/async.py --warm-start --set model.tiny.hidden_size=256 model.tiny.num_layers=4   # larger
    python benchmarks/async.py --quick --modes async_1 async_1_ray --baseline async_1   # launcher=ray's cost

Times depend on what else the machine runs: compare ratios from one invocation, not figures across runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

#: mode name -> the overrides that select it
MODES = {
    "sync": ["trainer.mode=sync"],
    "one_step_off": ["trainer.mode=one_step_off", "trainer.max_staleness=1"],
    "async_1": ["trainer.mode=async", "trainer.max_staleness=1"],
    "async_4": ["trainer.mode=async", "trainer.max_staleness=4"],
    # the producer as a Ray actor on a Ray of its own (launcher=ray): queue and weights through Ray, not files
    "async_1_ray": ["trainer.mode=async", "trainer.max_staleness=1", "launcher=ray"],
}
#: --quick: one-digit addition, a short warm-up and a few RL steps (minutes, not hours)
QUICK = ["data.task_args.max_digits=1", "data.train_size=70", "data.eval_size=24", "sft.steps=60",
         "sft.stop_at_accuracy=null", "trainer.total_steps=6", "trainer.warmup_steps=1", "trainer.eval_every=6",
         "trainer.prompts_per_step=4", "rollout.n=4"]


def grpo_command(config: Path | None, run_dir: Path, seed: int) -> list[str]:
    """``rltk run grpo`` (with ``--config``, a config other than the embedded default) into ``run_dir``."""
    return [sys.executable, "-m", "rltk.commands.cli", "run", "grpo", *(["--config", str(config)] if config else []),
            f"output_dir={run_dir}", f"seed={seed}", "logging.logger=[jsonl]", "logging.plot=false"]


def run_one(mode: str, seed: int, extra: list[str], folder: Path, config: Path | None = None) -> dict:
    run_dir = folder / f"{mode}_seed{seed}"
    command = [*grpo_command(config, run_dir, seed), *MODES[mode], *extra]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{mode} seed {seed} exited {done.returncode}:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    first_rl = steps[0]["step"]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    start = [a for s, a in evals if s < first_rl][-1]  # the RL stage's opening evaluation
    seconds = sum(r["time/step_s"] for r in steps)
    later = sum(r["time/step_s"] for r in steps[1:])  # without the first step, which waits for producers to start
    return {"mode": mode, "seed": seed, "rl_steps": len(steps), "rl_seconds": seconds,
            "steps_per_hour": 3600 * len(steps) / seconds,
            "steps_per_hour_after_first": 3600 * (len(steps) - 1) / later if later else float("nan"),
            "first_step_s": steps[0]["time/step_s"], "start": start, "end": evals[-1][1],
            "gain": evals[-1][1] - start,
            # of each step: sampling (sync) or waiting for the producer (async), and the rest (training)
            "rollout_s": statistics.median(r["time/rollout_s"] for r in steps),
            "train_s": statistics.median(r["time/step_s"] - r["time/rollout_s"] for r in steps),
            "staleness": statistics.mean(r.get("staleness/mean", 0.0) for r in steps),
            # the producer's side (async modes): its batch's sampling, and its wait at the staleness gate
            **{f"producer_{k}": statistics.median(r[f"producer/{k}"] for r in steps if f"producer/{k}" in r)
               for k in ("sample_s", "gate_wait_s", "put_s", "weights_s") if any(f"producer/{k}" in r for r in steps)}}


def warm_start(seed: int, extra: list[str], folder: Path, config: Path | None = None) -> list[str]:
    """Run the config's warm-up alone for ``seed`` once, and return the overrides that start an RL-only run
    from its weights (a model folder: the warm-up's last checkpoint and the run's tokenizer).

    Every mode of a seed would run this same warm-up (same seed, same config, same steps); running it once
    keeps a benchmark of a larger model to the RL stages it compares.
    """
    run_dir = folder / f"warmup_seed{seed}"
    command = [*grpo_command(config, run_dir, seed), *extra, "stages=[{name: warmup, type: sft}]"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"warm-up seed {seed} exited {done.returncode}:\n{done.stderr[-3000:]}")
    model = run_dir / "warm_model"
    shutil.copytree(sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "model", model)
    for file in (run_dir / "tokenizer").iterdir():
        shutil.copy(file, model / file.name)
    return [f"model.path={model}", "stages=[{name: rl, type: rl}]"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--modes", nargs="+", default=[m for m in MODES if m != "async_1_ray"], choices=list(MODES))
    parser.add_argument("--baseline", default="sync", choices=list(MODES),
                        help="the mode the table's ratios divide by (e.g. async_1 against async_1_ray)")
    parser.add_argument("--config", type=Path, help="a GRPO config (default: the embedded default), e.g. "
                        "recipes/configs/multi_turn.yaml")
    parser.add_argument("--quick", action="store_true", help="tiny settings, to check every mode runs")
    parser.add_argument("--set", nargs="*", default=[], help="more overrides for every run")
    parser.add_argument("--out", type=Path, default=RESULTS / "async.json")
    parser.add_argument("--warm-start", action="store_true",
                        help="run each seed's warm-up once and start every mode's RL stage from it")
    args = parser.parse_args()
    extra = [*(QUICK if args.quick else []), *args.set]
    results = []
    with tempfile.TemporaryDirectory(prefix="rltk_async_bench_") as tmp:
        for i, seed in enumerate(args.seeds):
            order = args.modes[i % len(args.modes):] + args.modes[:i % len(args.modes)]
            start = warm_start(seed, extra, Path(tmp), args.config) if args.warm_start else []
            for mode in order:
                r = run_one(mode, seed, [*extra, *start], Path(tmp), args.config)
                results.append(r)
                print(f"{mode:>13} seed {seed}: {r['steps_per_hour']:8.0f} RL steps/h (median step: "
                      f"{r['rollout_s']:.2f} s sampling or waiting, {r['train_s']:.2f} s training), held-out "
                      f"{r['start']:.3f} -> {r['end']:.3f} (gain {r['gain']:+.3f}), mean staleness "
                      f"{r['staleness']:.2f}", flush=True)
                if "producer_sample_s" in r:
                    print(f"{'':>13} producer's median batch: {r['producer_sample_s']:.2f} s sampling, "
                          f"{r['producer_gate_wait_s']:.2f} s held by the staleness gate, {r['producer_put_s']:.2f} s "
                          f"putting, {r['producer_weights_s']:.3f} s loading weights", flush=True)
    sync = [r for r in results if r["mode"] == args.baseline]
    base = args.baseline
    print(f"\nmode          steps/h (median)  x {base}  after step 1  x {base}  gain min / median / max")
    for mode in args.modes:
        mine = [r for r in results if r["mode"] == mode]
        ratios = []
        for key in ("steps_per_hour", "steps_per_hour_after_first"):
            speed = statistics.median(r[key] for r in mine)
            ratio = f"{speed / statistics.median(r[key] for r in sync):6.2f}" if sync else "     -"
            ratios.append(f"{speed:12.0f}  {ratio}")
        gains = sorted(r["gain"] for r in mine)
        print(f"{mode:<13} {ratios[0]}  {ratios[1]}  {gains[0]:+.3f} / {statistics.median(gains):+.3f} / "
              f"{gains[-1]:+.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": str(args.config) if args.config else None, "overrides": extra,
                                    "runs": results}, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
