"""Does on-policy distillation lift a small student toward its teacher faster per step than GRPO?

The setting of issue 32, item 4, on the embedded task (two-digit addition):

* the teacher is the tiny default model (hidden 64) after `rltk run sft` (the shipped sft default,
  1500 steps, seed 0), its last checkpoint passed as `distill.teacher_path`;
* the student is the shipped distill default: a smaller tiny model (hidden 32, about a third of the
  teacher's parameters), fresh (random init, seed S) unless `--student-sft-steps N` first gives it a
  short SFT warm-up of its own (a `type: sft` stage before distillation, the same for both methods);
* distill: `rltk run distill` unchanged but for the step count; GRPO: the very same run with
  `algorithm.advantage_fn=grpo` (same loop, student start, prompts, samples, learning rate and steps:
  only the advantage differs, the task reward's group advantage instead of the teacher's per-token one).

Each run is a fresh one-thread process; `--jobs` run at a time. Prints held-out greedy and sampled
accuracy (200 sums never trained on) at each evaluation of every run, the gains, and the teacher's
accuracy, and writes everything as JSON.

    python benchmarks/distill.py                                   # seeds 0 1, 300 steps
    python benchmarks/distill.py --seeds 0 1 2 --steps 100 --jobs 2
    python benchmarks/distill.py --teacher runs/sft-tiny/checkpoints/step_001500   # reuse a teacher
    python benchmarks/distill.py --student-sft-steps 300          # a briefly warmed-up student instead
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = {"distill": [], "grpo": ["algorithm.advantage_fn=grpo"]}


def run_rltk(args: list[str], run_dir: Path, log: Path) -> float:
    """One `rltk` command in a fresh single-threaded process; its wall time."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "RLTK_DISABLE_PLUGIN_AUTOLOAD": "1"}
    command = [sys.executable, "-m", "rltk.cli", *args, f"output_dir={run_dir}", "logging.logger=[jsonl]",
               "logging.plot=false", "logging.traces=false", "checkpoint.resume=never"]
    tick = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}); see {log}")
    return time.perf_counter() - tick


def evaluations(run_dir: Path, first_step: int = 0) -> list[dict]:
    """``[{step, greedy, sampled}]`` of every held-out evaluation from ``first_step`` on."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"] - first_step, "greedy": r["eval/accuracy"], "sampled": r["eval/sampled_accuracy"]}
            for r in rows if "eval/accuracy" in r and r["step"] >= first_step]


def step_means(run_dir: Path, first_step: int = 0, window: int = 10) -> dict:
    """Mean of the per-step metrics over the first and the last ``window`` steps: the reverse KL to the
    teacher of the student's own samples, the teacher's log-prob of them, and the task reward."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "distill/reverse_kl" in r and r["step"] > first_step]
    out = {}
    for key, name in (("distill/reverse_kl", "reverse_kl"), ("distill/teacher_logprob", "teacher_logprob"),
                      ("reward", "reward")):
        out[name] = {"first": statistics.mean(r[key] for r in steps[:window]),
                     "last": statistics.mean(r[key] for r in steps[-window:])}
    return out


def build_teacher(workdir: Path) -> tuple[Path, dict]:
    """`rltk run sft` (the shipped default, seed 0): its last checkpoint and final held-out accuracy."""
    run_dir = workdir / "teacher"
    seconds = run_rltk(["run", "sft", "seed=0"], run_dir, workdir / "teacher.log")
    final = json.loads((run_dir / "summary.json").read_text())["final"]
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return last, {"greedy": final["eval/accuracy"], "sampled": final["eval/sampled_accuracy"], "seconds": seconds}


def teacher_accuracy(teacher: Path) -> dict:
    """Held-out accuracy of a given teacher checkpoint, from its run's summary.json."""
    summary = teacher.parent.parent / "summary.json"
    if not summary.is_file():
        return {}
    final = json.loads(summary.read_text())["final"]
    return {"greedy": final["eval/accuracy"], "sampled": final["eval/sampled_accuracy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=300, help="distillation / GRPO steps per run")
    parser.add_argument("--eval-every", type=int, default=None, help="default: steps / 4")
    parser.add_argument("--student-sft-steps", type=int, default=0,
                        help="an SFT warm-up of the student before both methods (0: a fresh student)")
    parser.add_argument("--teacher", type=Path, default=None, help="a teacher checkpoint to reuse (default: build one)")
    parser.add_argument("--window", type=int, default=25, help="steps averaged at the start and the end")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS / "distill.json")
    parser.add_argument("overrides", nargs="*", help="key=value for every student run")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rltk-distill-"))
    workdir.mkdir(parents=True, exist_ok=True)

    if args.teacher is None:
        teacher, teacher_acc = build_teacher(workdir)
    else:
        teacher, teacher_acc = args.teacher, teacher_accuracy(args.teacher)
    print(f"teacher {teacher}: held-out greedy {teacher_acc.get('greedy')}, sampled {teacher_acc.get('sampled')}",
          flush=True)

    eval_every = args.eval_every or max(1, args.steps // 4)
    common = [f"distill.teacher_path={teacher}", f"trainer.total_steps={args.steps}", f"trainer.eval_every={eval_every}",
              "checkpoint.every=0", *args.overrides]
    if args.student_sft_steps:
        common += [f"sft.steps={args.student_sft_steps}", "sft.lr_schedule=constant",
                   "stages=[{name: warmup, type: sft}, {name: distill, type: distill}]"]
    jobs = [(seed, method) for seed in args.seeds for method in METHODS]

    def one(job):
        seed, method = job
        run_dir = workdir / f"{method}_seed{seed}"
        seconds = run_rltk(["run", "distill", f"seed={seed}", *common, *METHODS[method]], run_dir,
                           workdir / f"{method}_seed{seed}.log")
        evals = evaluations(run_dir, first_step=args.student_sft_steps)
        means = step_means(run_dir, first_step=args.student_sft_steps, window=args.window)
        return {"seed": seed, "method": method, "seconds": seconds, "evals": evals, "step_means": means,
                "kl_drop": means["reverse_kl"]["first"] - means["reverse_kl"]["last"],
                "reward_rise": means["reward"]["last"] - means["reward"]["first"],
                "greedy_gain": evals[-1]["greedy"] - evals[0]["greedy"],
                "sampled_gain": evals[-1]["sampled"] - evals[0]["sampled"]}

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(one, jobs))

    print(f"\n{'method':8} {'seed':>4}  held-out greedy / sampled accuracy at steps "
          f"{[e['step'] for e in runs[0]['evals']]}")
    for r in runs:
        curve = "  ".join(f"{e['greedy']:.3f}/{e['sampled']:.3f}" for e in r["evals"])
        m = r["step_means"]
        print(f"{r['method']:8} {r['seed']:>4}  {curve}   ({r['seconds']:.0f} s)\n{'':14}reverse KL "
              f"{m['reverse_kl']['first']:.3f} -> {m['reverse_kl']['last']:.3f}, teacher log-prob "
              f"{m['teacher_logprob']['first']:.3f} -> {m['teacher_logprob']['last']:.3f}, train reward "
              f"{m['reward']['first']:.3f} -> {m['reward']['last']:.3f} (first / last {args.window} steps)")
    summary = {}
    for method in METHODS:
        mine = [r for r in runs if r["method"] == method]
        value = {kind: [r[f"{kind}_gain" if kind in ("greedy", "sampled") else kind] for r in mine]
                 for kind in ("greedy", "sampled", "kl_drop", "reward_rise")}
        summary[method] = {kind: {"min": min(v), "median": statistics.median(v), "max": max(v)}
                           for kind, v in value.items()}
        s = summary[method]
        print(f"{method:8} gain greedy min/median/max {s['greedy']['min']:+.3f} / {s['greedy']['median']:+.3f} / "
              f"{s['greedy']['max']:+.3f}   sampled {s['sampled']['min']:+.3f} / {s['sampled']['median']:+.3f} / "
              f"{s['sampled']['max']:+.3f}   reverse-KL drop {s['kl_drop']['min']:+.3f} / "
              f"{s['kl_drop']['median']:+.3f} / {s['kl_drop']['max']:+.3f}   train-reward rise "
              f"{s['reward_rise']['min']:+.3f} / {s['reward_rise']['median']:+.3f} / {s['reward_rise']['max']:+.3f}")
    ahead = [next(r for r in runs if r["seed"] == s and r["method"] == "distill")["sampled_gain"]
             - next(r for r in runs if r["seed"] == s and r["method"] == "grpo")["sampled_gain"] for s in args.seeds]
    print(f"distill - grpo sampled gain per seed: {[round(x, 3) for x in ahead]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"teacher": str(teacher), "teacher_accuracy": teacher_acc, "steps": args.steps,
                                    "student_sft_steps": args.student_sft_steps, "overrides": args.overrides,
                                    "runs": runs, "summary": summary, "distill_minus_grpo_sampled": ahead},
                                   indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
