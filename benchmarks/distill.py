"""Does on-policy distillation lift a small student toward its teacher faster per step than GRPO?

The setting of issue 32, item 4, on the embedded task (two-digit addition):

* the teacher is the tiny default model (hidden 64) after `rltk run sft` (the shipped sft default,
  1500 steps, seed 0, built once at the machine's best kernel level), its last checkpoint passed as
  `distill.teacher_path`;
* the student is a smaller tiny model (`--student-hidden`, default 48: 75k parameters to 130k), fresh
  (random init, seed S), given a short SFT warm-up of its own (`--student-sft-steps`: `rltk run sft` with
  a constant learning rate) so that it emits answers at all, exported, and passed as `model.path` to both
  arms, so both start from the very same weights;
* distill: `rltk run distill` at its shipped settings (lr 3e-4, 8 samples per prompt) but for the step count,
  with its own warm-up stage dropped (the student above had it);
* grpo: `rltk run grpo` at its shipped settings (lr 1e-4, k3 KL 0.05 to the start, 8 samples per prompt)
  with its warm-up stage dropped, and again at each of `--grpo-lrs` (GRPO's best learning rate is not
  assumed to be its default's).

Each (seed, kernel level) is one job: the student's warm-up, then every arm, each a fresh one-thread
process at that `ATEN_CPU_CAPABILITY`; `--jobs` jobs at a time. Prints held-out greedy and sampled
accuracy (200 sums never trained on) at each evaluation of every arm, the gains, distillation's greedy
accuracy minus every GRPO arm's, and the teacher's accuracy, and writes everything as JSON. Trailing
`key=value` arguments override the distillation runs only.

    # docs/tutorials/distillation.md's tables (every level; --teacher reuses a teacher)
    python benchmarks/distill.py --jobs 2                                   # 200 steps, ~1 h on 2 busy cores
    python benchmarks/distill.py --jobs 2 --steps 1000 --eval-every 250 --seeds 0 1 2 3 4
    python benchmarks/distill.py --seeds 0 --levels avx512 --steps 300 --grpo-lrs 1e-3
    # a fresh student (GRPO has no reward to learn from): hidden 48 over 2000 steps; the earlier default, hidden 32
    python benchmarks/distill.py --student-sft-steps 0 --steps 2000 --eval-every 500 --jobs 2 trainer.lr=3e-3
    python benchmarks/distill.py --student-hidden 32 --student-sft-steps 0 --steps 300 --levels avx512 \
        trainer.lr=3e-3 rollout.n=4
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning import RESULTS, build_teacher, cpu_levels, run_rltk, spread  # noqa: E402

QUIET = ["logging.traces=false"]


def evaluations(run_dir: Path) -> list[dict]:
    """``[{step, greedy, sampled}]`` of every held-out evaluation of a run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], "greedy": r["eval/accuracy"], "sampled": r["eval/sampled_accuracy"]}
            for r in rows if "eval/accuracy" in r]


def step_means(run_dir: Path, window: int) -> dict:
    """Mean of the per-step metrics over the first and the last ``window`` steps: the task reward, and for
    a distillation run the reverse KL to the teacher of the student's own samples and the teacher's
    log-prob of them."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    out = {}
    for key, name in (("distill/reverse_kl", "reverse_kl"), ("distill/teacher_logprob", "teacher_logprob"),
                      ("reward", "reward")):
        if steps and key in steps[0]:
            out[name] = {"first": statistics.mean(r[key] for r in steps[:window]),
                         "last": statistics.mean(r[key] for r in steps[-window:])}
    return out


def last_checkpoint(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step_*"))[-1]


def export(checkpoint: Path, out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "rltk.commands.cli", "export", str(checkpoint), str(out)], check=True,
                   capture_output=True)
    return out


def final_accuracy(run_dir: Path) -> dict:
    final = json.loads((run_dir / "summary.json").read_text())["final"]
    return {"greedy": final["eval/accuracy"], "sampled": final["eval/sampled_accuracy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--levels", nargs="+", default=None, help="ATEN_CPU_CAPABILITY levels (default: all)")
    parser.add_argument("--steps", type=int, default=200, help="distillation / GRPO steps per run")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--student-hidden", type=int, default=48,
                        help="the student's hidden size (intermediate 4x; the teacher's is 64)")
    parser.add_argument("--student-sft-steps", type=int, default=500, help="the student's own SFT warm-up (0: fresh)")
    parser.add_argument("--grpo-lrs", type=float, nargs="*", default=[],
                        help="GRPO arms besides the shipped default's learning rate")
    parser.add_argument("--teacher", type=Path, default=None, help="a teacher checkpoint to reuse (default: build one)")
    parser.add_argument("--window", type=int, default=25, help="steps averaged at the start and the end")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS / "distill.json")
    parser.add_argument("overrides", nargs="*", help="key=value for every distillation run")
    args = parser.parse_args()
    levels = args.levels or cpu_levels()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rltk-distill-"))
    workdir.mkdir(parents=True, exist_ok=True)
    tick = time.perf_counter()

    teacher = args.teacher or build_teacher(levels[-1], workdir)
    teacher_acc = final_accuracy(teacher.parent.parent)
    print(f"teacher {teacher}: held-out greedy {teacher_acc['greedy']:.3f}, sampled {teacher_acc['sampled']:.3f}",
          flush=True)

    # the layers, heads and context of the tiny default (the same in the sft, grpo and distill configs)
    student = [f"model.tiny.hidden_size={args.student_hidden}", f"model.tiny.intermediate_size={4 * args.student_hidden}"]
    steps = [f"trainer.total_steps={args.steps}", f"trainer.eval_every={args.eval_every}", "checkpoint.every=0", *QUIET]
    arms = {"distill": ["run", "distill", "stages=[{name: distill, type: distill}]", f"distill.teacher_path={teacher}",
                        *steps, *args.overrides],
            "grpo": ["run", "grpo", "stages=[{name: grpo, type: rl}]", *steps]}
    for lr in args.grpo_lrs:
        arms[f"grpo_lr{lr:g}"] = [*arms["grpo"], f"trainer.lr={lr}"]

    def one(job):
        seed, level = job
        w = workdir / f"s{seed}-{level}"
        w.mkdir(parents=True, exist_ok=True)
        if args.student_sft_steps:
            # the student's own warm-up under `rltk run sft`, exported as the start of every arm
            run_rltk(["run", "sft", f"seed={seed}", *student, f"sft.steps={args.student_sft_steps}",
                      "sft.lr_schedule=constant", f"sft.eval_every={args.student_sft_steps}",
                      f"checkpoint.every={args.student_sft_steps}", *QUIET], w / "student", level, w / "student.log")
            start = ["model.path=" + str(export(last_checkpoint(w / "student"), w / "student_model"))]
        else:
            start = student
        row = {"seed": seed, "level": level, "arms": {}}
        for arm, command in arms.items():
            t0 = time.perf_counter()
            run_rltk([*command, f"seed={seed}", *start], w / arm, level, w / f"{arm}.log")
            evals = evaluations(w / arm)
            row["arms"][arm] = {"seconds": time.perf_counter() - t0, "evals": evals,
                                "step_means": step_means(w / arm, args.window),
                                "greedy_gain": evals[-1]["greedy"] - evals[0]["greedy"],
                                "sampled_gain": evals[-1]["sampled"] - evals[0]["sampled"]}
        print(f"seed {seed} {level}: held-out greedy/sampled at steps {[e['step'] for e in evals]}")
        for arm, r in row["arms"].items():
            curve = "  ".join(f"{e['greedy']:.3f}/{e['sampled']:.3f}" for e in r["evals"])
            means = "  ".join(f"{k} {v['first']:.3f} -> {v['last']:.3f}" for k, v in r["step_means"].items())
            print(f"  {arm:14} {curve}  ({r['seconds']:.0f} s)  {means}", flush=True)
        return row

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(one, [(s, lv) for s in args.seeds for lv in levels]))

    summary = {}
    for arm in arms:
        mine = [r["arms"][arm] for r in rows]
        summary[arm] = {"greedy_start": spread([m["evals"][0]["greedy"] for m in mine]),
                        "greedy_end": spread([m["evals"][-1]["greedy"] for m in mine]),
                        "greedy_gain": spread([m["greedy_gain"] for m in mine]),
                        "sampled_gain": spread([m["sampled_gain"] for m in mine])}
        s = summary[arm]
        print(f"{arm:14} greedy {s['greedy_start']['min']:.3f}-{s['greedy_start']['max']:.3f} -> "
              f"{s['greedy_end']['min']:.3f}-{s['greedy_end']['max']:.3f}, gain min/median/max "
              f"{s['greedy_gain']['min']:+.3f} / {s['greedy_gain']['median']:+.3f} / {s['greedy_gain']['max']:+.3f}"
              f"   sampled gain {s['sampled_gain']['min']:+.3f} / {s['sampled_gain']['median']:+.3f} / "
              f"{s['sampled_gain']['max']:+.3f}")
    # per step: distillation's greedy gain at every evaluation minus each GRPO arm's, on the same start
    ahead = {}
    for arm in arms:
        if arm == "distill":
            continue
        diffs = [[d["greedy"] - g["greedy"] for d, g in zip(r["arms"]["distill"]["evals"][1:], r["arms"][arm]["evals"][1:])]
                 for r in rows]
        ahead[arm] = {"per_job": diffs, "min_at_any_eval": min(min(d) for d in diffs),
                      "min_at_end": min(d[-1] for d in diffs)}
        print(f"distill - {arm}: greedy accuracy difference at the last evaluation min "
              f"{ahead[arm]['min_at_end']:+.3f}, at any evaluation min {ahead[arm]['min_at_any_eval']:+.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "teacher": str(teacher), "teacher_accuracy": teacher_acc, "args": {k: str(v) for k, v in vars(args).items()},
        "levels": levels, "runs": rows, "summary": summary, "distill_minus": ahead,
        "total_wall_s": time.perf_counter() - tick}, indent=2))
    print(f"wrote {args.out} ({(time.perf_counter() - tick) / 60:.1f} min)")


if __name__ == "__main__":
    main()
