"""The reward-model path end to end (issue 31, item 5): a reward model learned from preference pairs of
the addition task, then GRPO against it, judged by the task's true reward on held-out sums.

Per seed and CPU kernel level, each step a fresh single-threaded `rltk` process (as benchmarks/learning.py):

    1. rltk run rm seed=S                                   -> the shipped default: 1500 SFT steps, then a
                                                               Bradley-Terry reward model from the SFT model
                                                               (InstructGPT's order); exactly learning.py's run
    2. rltk export RM_RUN/checkpoints/step_001500 P0        -> the SFT model, the policy GRPO starts from
    3. rltk run grpo seed=S model.path=P0 'stages=[{name: grpo, type: rl}]' \
           reward.reward_fn=[reward_model,exact_match] reward.weights.exact_match=0 \
           reward.reward_fn_args.reward_model.path=RM_RUN/reward_model
                                                            -> P1, trained on the reward model's score alone
                                                               (exact_match at weight 0 only logs the true reward)
    4. rltk run sft model.path=P 'stages=[]'                -> held-out greedy / sampled exact match of P0 and P1
                                                               (no training: the same evaluation as every figure)

`--control` also runs step 3 with the true reward (`exact_match`), the ceiling the learned reward is
measured against. Prints one row per run and min / median / max of the gains; writes JSON.

    python benchmarks/rm_then_grpo.py --seeds 0 1 2 --levels default avx512 --jobs 2
    python benchmarks/rm_then_grpo.py --seeds 0 --levels avx2 --control
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning import RESULTS, cpu_levels, run_rltk, spread  # noqa: E402

RL_ONLY = "stages=[{name: grpo, type: rl}]"
# GRPO's held-out evaluation scores with the run's reward functions: against the reward model its
# "accuracy" is no task accuracy, so the run skips it and step 4 measures the true one.
GRPO = ["trainer.eval_every=0"]


def against(rm_folder: Path) -> list[str]:
    # exact_match at weight 0 trains nothing; it logs the true reward of the training samples (reward/exact_match)
    return ["reward.reward_fn=[reward_model,exact_match]", "reward.weights.exact_match=0",
            f"reward.reward_fn_args.reward_model.path={rm_folder}", "reward.reward_fn_args.reward_model.sigmoid=true"]


def export_last(run_dir: Path, out: Path) -> Path:
    """The run's last checkpoint as a model folder (a reward-model run's is the end of its SFT stage: the
    reward-model loop itself saves none)."""
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    subprocess.run([sys.executable, "-m", "rltk.commands.cli", "export", str(last), str(out)], check=True,
                   capture_output=True)
    return out


def held_out(model: Path, seed: int, level: str, workdir: Path, name: str) -> dict:
    """Greedy and sampled exact match of ``model`` on the held-out sums (an sft run with no stages)."""
    run_dir = workdir / f"eval-{name}"
    run_rltk(["run", "sft", f"seed={seed}", f"model.path={model}", "stages=[]"], run_dir, level,
             workdir / f"eval-{name}.log")
    final = json.loads((run_dir / "summary.json").read_text())["final"]
    return {"greedy": final["eval/accuracy"], "sampled": final["eval/sampled_accuracy"]}


def one(seed: int, level: str, root: Path, control: bool, overrides: list[str]) -> dict:
    w = root / f"s{seed}-{level}"
    w.mkdir(parents=True, exist_ok=True)
    tick = time.perf_counter()
    run_rltk(["run", "rm", f"seed={seed}", *overrides], w / "rm", level, w / "rm.log")
    p0 = export_last(w / "rm", w / "policy0")
    rm = json.loads((w / "rm" / "summary.json").read_text())["final"]
    run_rltk(["run", "grpo", f"seed={seed}", f"model.path={p0}", RL_ONLY, *GRPO, *against(w / "rm" / "reward_model")],
             w / "grpo_rm", level, w / "grpo_rm.log")
    metrics = [json.loads(line) for line in (w / "grpo_rm" / "metrics.jsonl").read_text().splitlines()]
    true = [m["reward/exact_match"] for m in metrics if "reward/exact_match" in m]
    row = {"seed": seed, "level": level, "rm_pairwise_accuracy": rm["eval/pairwise_accuracy"],
           # the true reward of GRPO's own samples, which it never trained on: last 25 steps against the first 25
           "true_reward_rise": sum(true[-25:]) / 25 - sum(true[:25]) / 25,
           "start": held_out(p0, seed, level, w, "p0"),
           "rm": held_out(export_last(w / "grpo_rm", w / "policy_rm"), seed, level, w, "rm")}
    if control:
        run_rltk(["run", "grpo", f"seed={seed}", f"model.path={p0}", RL_ONLY, *GRPO], w / "grpo_true", level,
                 w / "grpo_true.log")
        row["true"] = held_out(export_last(w / "grpo_true", w / "policy_true"), seed, level, w, "true")
    for arm in ("rm", "true"):
        if arm in row:
            row[arm]["greedy_gain"] = row[arm]["greedy"] - row["start"]["greedy"]
            row[arm]["sampled_gain"] = row[arm]["sampled"] - row["start"]["sampled"]
    row["wall_s"] = time.perf_counter() - tick
    print(f"seed {seed} {level:<8} rm pairwise {row['rm_pairwise_accuracy']:.3f}  held-out greedy "
          f"{row['start']['greedy']:.3f} -> {row['rm']['greedy']:.3f} ({row['rm']['greedy_gain']:+.3f})  sampled "
          f"{row['start']['sampled']:.3f} -> {row['rm']['sampled']:.3f} ({row['rm']['sampled_gain']:+.3f})  "
          f"train exact-match rise {row['true_reward_rise']:+.3f}"
          + (f"  true-reward GRPO greedy {row['true']['greedy_gain']:+.3f} sampled {row['true']['sampled_gain']:+.3f}"
             if control else "") + f"  {row['wall_s']:.0f}s", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--levels", nargs="+", default=None, help="ATEN_CPU_CAPABILITY levels (default: all)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--control", action="store_true", help="also GRPO on the true reward (exact_match)")
    parser.add_argument("--out", type=Path, default=RESULTS / "rm_then_grpo.json")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for the reward-model run")
    args = parser.parse_args()
    levels = args.levels or cpu_levels()
    tick = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rltk-rm-grpo-") as tmp:
        with ThreadPoolExecutor(args.jobs) as pool:
            rows = list(pool.map(lambda job: one(*job, Path(tmp), args.control, args.overrides),
                                 [(s, lv) for lv in levels for s in args.seeds]))
    summary = {arm: {k: spread([r[arm][k] for r in rows]) for k in ("greedy_gain", "sampled_gain")}
               for arm in ("rm", "true") if arm in rows[0]}
    summary["rm_pairwise_accuracy"] = spread([r["rm_pairwise_accuracy"] for r in rows])
    print(f"\n| GRPO reward | runs | held-out greedy gain min / median / max | sampled gain min / median / max |")
    print("|---|---|---|---|")
    for arm, label in (("rm", "learned reward model"), ("true", "exact_match (control)")):
        if arm in summary:
            g, s = summary[arm]["greedy_gain"], summary[arm]["sampled_gain"]
            print(f"| {label} | {len(rows)} | {g['min']:+.3f} / {g['median']:+.3f} / {g['max']:+.3f} | "
                  f"{s['min']:+.3f} / {s['median']:+.3f} / {s['max']:+.3f} |")
    a = summary["rm_pairwise_accuracy"]
    print(f"reward model held-out pairwise accuracy {a['min']:.3f} / {a['median']:.3f} / {a['max']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": rows, "summary": summary, "levels": levels,
                                    "args": {k: str(v) for k, v in vars(args).items()},
                                    "total_wall_s": time.perf_counter() - tick}, indent=2))
    print(f"\nwrote {args.out} ({(time.perf_counter() - tick) / 60:.1f} min)")


if __name__ == "__main__":
    main()
