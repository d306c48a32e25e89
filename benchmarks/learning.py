"""Does the shipped default learn on every seed and every CPU kernel level?

Runs `rltk run RECIPE seed=S` for each recipe, seed and torch CPU kernel level
(`ATEN_CPU_CAPABILITY`: `default`, `avx2`, and `avx512` where the CPU has it),
each in a fresh process with one thread, and reads held-out accuracy at the end
of the supervised warm-up (the first evaluation of the RL stage) and at the end
of the run. Prints one row per run and min / median / max of the gains, and
writes everything as JSON.

    python benchmarks/learning.py                                 # grpo and ppo, seeds 0-4, every level
    python benchmarks/learning.py --recipes grpo --seeds 0 1 --levels avx2
    python benchmarks/learning.py --recipes multi_turn agentic   # the multi-turn defaults (issue #11)
    python benchmarks/learning.py --recipes agentic --seeds 0 1 2 --levels default avx2 --at-step 100
    python benchmarks/learning.py --recipes agentic_tools --seeds 0 1 2 --levels default avx2
    python benchmarks/learning.py --recipes verifiers --seeds 0 1 2 --levels avx2   # a verifiers env (issue 31)
    python benchmarks/learning.py --recipes grpo_head32 grpo_vllm --seeds 0 1 2   # hf vs vLLM sampling
    python benchmarks/learning.py --recipes distill --jobs 2      # on-policy distillation (issue 32)
    python benchmarks/learning.py --lr-sweep                      # GRPO stability over learning rates

`--lr-sweep` is the learning-rate table of docs/measurements.md: two-digit addition on a 0.6M
parameter Qwen2 (4 layers, hidden 128, char tokenizer) warm-started by SFT to
about 15-25% held-out accuracy, then 4 prompts x 8 samples per step, at most 6
new tokens, no KL, for each learning rate and each GRPO variant. The warm-up
runs once per seed and is shared by every variant, so variants differ only in
their RL settings.

Runs are independent processes, `--jobs` at a time (default: one per core);
each pins itself to one thread so that parallel runs neither fight over cores
nor change a run's arithmetic.
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
CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "configs"

#: What `--recipes NAME` runs: a recipe with its own config, or the grpo recipe with a shipped config
#: (`multi_turn`: a tool-calling episode per prompt; `agentic`: an agent over the OpenAI endpoint).
RUNS = {
    "grpo": ["run", "grpo"],
    "ppo": ["run", "ppo"],
    "multi_turn": ["run", "grpo", "--config", str(CONFIGS / "multi_turn.yaml")],
    "agentic": ["run", "grpo", "--config", str(CONFIGS / "agentic.yaml")],
    # a tool-using agent: the calculator through the openai client's tools= (issue 29)
    "agentic_tools": ["run", "grpo", "--config", str(CONFIGS / "agentic_tools.yaml")],
    # GRPO sampling with vLLM (issue 27) against the hf engine on the same model: the embedded default with
    # head size 32, since vLLM's CPU attention has no head size 16 (2 heads of 32 instead of 4 of 16)
    "grpo_head32": ["run", "grpo", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1"],
    "grpo_vllm": ["run", "grpo", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "rollout.engine=vllm"],
    # beyond GRPO (issue 32): offline DPO on the task's synthetic pairs, online DPO on the policy's own best and
    # worst samples, and GRPO's loop with Trinity-RFT's OPMD loss
    "dpo": ["run", "dpo"],
    "dpo_plain": ["run", "dpo", "dpo.nll_coef=0"],  # without the default's RPO term
    "dpo_online": ["run", "dpo", "dpo.online=true", "dpo.nll_coef=0"],
    "grpo_opmd": ["run", "grpo", "algorithm.name=opmd"],
    # issue 32: SFT as a recipe of its own (held-out accuracy from the fresh model), and a Bradley-Terry
    # reward model (held-out pairwise accuracy P(r_right > r_wrong), reported in the greedy columns)
    "sft": ["run", "sft"],
    "reward_model": ["run", "reward_model"],
    # on-policy distillation: the shipped default (a hidden-48 student, its SFT warm-up, then 1000 distillation
    # steps) from the teacher of TEACHER_RUN built at the run's own kernel level, as the learning test builds it
    "distill": ["run", "distill"],
    # issue 31: the grpo default played and scored by a verifiers environment (benchmarks/verifiers_envs/
    # vf_addition.py, its rubric: exact answer 1.0 + a number at all 0.2) through rltk's endpoint; the rows are the
    # grpo default's (their demonstrations feed the warm-up), rendered with the chat template as the env's client
    # sends them. Needs the verifiers extra.
    "verifiers": ["run", "grpo", "rollout.workflow=verifiers", "rollout.workflow_args.env_id=vf_addition",
                  "rollout.workflow_args.concurrency=128", "rollout.workflow_args.max_batch=128",
                  "rollout.workflow_args.batch_max_wait_s=30", "data.use_chat_template=true",
                  "data.max_prompt_tokens=32"],
}

#: The teacher of the `distill` runs: the shipped sft default, seed 0 (held-out greedy ~0.4).
TEACHER_RUN = ["run", "sft", "seed=0", "logging.traces=false"]
NEEDS_TEACHER = {"distill"}

#: Environments of the `verifiers` runs, importable by name as installed ones are (on PYTHONPATH of every run).
VERIFIERS_ENVS = Path(__file__).resolve().parent / "verifiers_envs"

# The 0.6M-parameter model and the step shape of the lr sweep (issue: learning that holds on any machine).
SWEEP_MODEL = ["model.tiny.hidden_size=128", "model.tiny.num_layers=4", "model.tiny.num_heads=4",
               "model.tiny.num_kv_heads=2", "model.tiny.intermediate_size=512"]
SWEEP_WARMUP = [*SWEEP_MODEL, "sft.lr=1e-3", "sft.stop_at_accuracy=0.2", "sft.steps=6000",
                "stages=[{name: warmup, type: sft}]"]
SWEEP_RL = ["trainer.prompts_per_step=4", "rollout.n=8", "rollout.max_new_tokens=6", "algorithm.kl_coef=0",
            "trainer.warmup_steps=0", "stages=[{name: grpo, type: rl}]"]
#: GRPO variants compared at every learning rate: name -> overrides.
SWEEP_VARIANTS = {
    "grpo": [],
    "dr_grpo (no std norm)": ["algorithm.name=dr_grpo"],
    "grpo + k3 KL 0.05": ["algorithm.kl_coef=0.05"],
    "grpo + entropy 0.01": ["algorithm.entropy_coef=0.01"],
}


def cpu_levels() -> list[str]:
    """`default`, `avx2` and the machine's best level, as torch names them (deduplicated)."""
    import torch

    best = torch.backends.cpu.get_cpu_capability().lower()
    levels = ["default", "avx2", best] if best not in ("default", "avx2") else ["default", "avx2"]
    return list(dict.fromkeys(levels))


def run_rltk(args: list[str], run_dir: Path, level: str, log: Path) -> float:
    """One `rltk` command in a fresh single-threaded process at kernel level ``level``; its wall time."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": level, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "RLTK_DISABLE_PLUGIN_AUTOLOAD": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(VERIFIERS_ENVS), os.environ.get("PYTHONPATH")) if p)}
    command = [sys.executable, "-m", "rltk.commands.cli", *args, f"output_dir={run_dir}", "logging.logger=[jsonl]",
               "logging.plot=false", "checkpoint.resume=never"]
    tick = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}); see {log}")
    return time.perf_counter() - tick


def build_teacher(level: str, workdir: Path) -> Path:
    """A distillation teacher (TEACHER_RUN) trained at kernel level ``level``: its last checkpoint."""
    run_dir = workdir / f"teacher-{level}"
    run_rltk(TEACHER_RUN, run_dir, level, workdir / f"{run_dir.name}.log")
    return sorted((run_dir / "checkpoints").glob("step_*"))[-1]


def learning_curve(run_dir: Path, at_step: int | None = None) -> dict:
    """Held-out accuracy when RL starts and at the end, and where the warm-up stopped.

    ``at_step`` adds the same gains after the first ``at_step`` RL steps (``"at_step"``): the eval
    at that step against the first, and the training reward of the 25 steps before it against the
    first 25. With a constant learning rate that is what a run of ``at_step`` steps would measure.
    """
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if any("eval/pairwise_accuracy" in m for m in metrics):  # a reward model: pairwise accuracy, nothing sampled
        metrics = [{**m, "eval/accuracy": m["eval/pairwise_accuracy"], "eval/sampled_accuracy": float("nan")}
                   if "eval/pairwise_accuracy" in m else m for m in metrics]
    evals = [m for m in metrics if "eval/accuracy" in m]
    probes = [m for m in metrics if "sft/train_accuracy" in m]
    start, end = evals[0], evals[-1]
    rewards = [m["reward"] for m in metrics if "reward" in m]
    window = max(1, min(25, len(rewards) // 4))
    # a distillation run: the student's reverse KL to its teacher on its own samples, first vs last steps
    kls = [m["distill/reverse_kl"] for m in metrics if "distill/reverse_kl" in m]
    prefix = {"reverse_kl_drop": sum(kls[:window]) / window - sum(kls[-window:]) / window} if kls else {}
    if at_step is not None:
        at = next((m for m in evals if m["step"] == start["step"] + at_step), None)
        if at is None or len(rewards) < at_step:
            raise ValueError(f"{run_dir}: no evaluation at RL step {at_step} (evals at "
                             f"{[m['step'] - start['step'] for m in evals]}); choose a multiple of trainer.eval_every")
        prefix["at_step"] = {
            "rl_steps": at_step,
            "reward_rise": sum(rewards[at_step - window:at_step]) / window - sum(rewards[:window]) / window,
            "greedy_gain": at["eval/accuracy"] - start["eval/accuracy"],
            "sampled_gain": at["eval/sampled_accuracy"] - start["eval/sampled_accuracy"],
        }
    return {
        # the training reward (sampled accuracy on the prompts of each step), first vs last 25 RL steps
        "reward_rise": sum(rewards[-window:]) / window - sum(rewards[:window]) / window if rewards else None,
        "warmup_steps": probes[-1]["step"] if probes else None,
        "greedy_start": start["eval/accuracy"], "greedy_end": end["eval/accuracy"],
        "sampled_start": start["eval/sampled_accuracy"], "sampled_end": end["eval/sampled_accuracy"],
        "greedy_gain": end["eval/accuracy"] - start["eval/accuracy"],
        "sampled_gain": end["eval/sampled_accuracy"] - start["eval/sampled_accuracy"],
        "curve": [(m["step"], m["eval/accuracy"]) for m in evals],
        "sampled_curve": [(m["step"], m["eval/sampled_accuracy"]) for m in evals],
        **prefix,
    }


def near_miss_accuracy(run_dir: Path) -> float | None:
    """A reward-model run's saved model scored on held-out near misses alone (``wrong_length=0``), the hard
    pairs its own figure mixes with wrong-length ones; ``None`` for other runs."""
    if not (run_dir / "reward_model").is_dir():
        return None
    import torch
    from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

    from rltk.config.loader import load_config
    from rltk.training.updates.reward_model import pair_rewards, preference_pairs, tokenize_pairs
    from rltk.training.scaffold.rows import build_rows

    model = AutoModelForSequenceClassification.from_pretrained(run_dir / "reward_model").eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(run_dir / "reward_model")
    cfg = load_config([run_dir / "config.yaml"], ["reward_model.wrong_length=0"], warn=False)
    _, held_out = build_rows(cfg, tokenizer)
    pairs = tokenize_pairs(preference_pairs(held_out, cfg, split="heldout"), tokenizer, cfg.reward_model.max_length)
    with torch.no_grad():
        chosen, rejected = pair_rewards(model, pairs, tokenizer.pad_token_id, "cpu")
    return ((chosen > rejected).float() + 0.5 * (chosen == rejected).float()).mean().item()


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def default_runs(args, workdir: Path) -> list[dict]:
    jobs = [(recipe, seed, level) for recipe in args.recipes for level in args.levels for seed in args.seeds]
    teachers = {}
    if NEEDS_TEACHER & set(args.recipes) and not args.runs_dir:
        with ThreadPoolExecutor(args.jobs) as pool:
            teachers = dict(zip(args.levels, pool.map(lambda level: build_teacher(level, workdir), args.levels)))
    teacher_accuracy = {}
    for level, checkpoint in teachers.items():  # where the students are heading
        final = json.loads((checkpoint.parent.parent / "summary.json").read_text())["final"]
        teacher_accuracy[level] = {"greedy": final["eval/accuracy"], "sampled": final["eval/sampled_accuracy"]}
        print(f"teacher at {level}: held-out greedy {final['eval/accuracy']:.3f}, "
              f"sampled {final['eval/sampled_accuracy']:.3f}", flush=True)

    def one(job):
        recipe, seed, level = job
        run_dir = workdir / f"{recipe}-s{seed}-{level}"
        if args.runs_dir:  # summarise earlier runs instead
            wall = float("nan")
        else:
            try:
                teacher = [f"distill.teacher_path={teachers[level]}"] if recipe in NEEDS_TEACHER else []
                wall = run_rltk([*RUNS[recipe], f"seed={seed}", *teacher, *args.overrides], run_dir, level,
                                workdir / f"{run_dir.name}.log")
            except RuntimeError as exc:  # the other runs go on; the failure is reported with its log's tail
                tail = (workdir / f"{run_dir.name}.log").read_text(errors="replace").splitlines()[-15:]
                print(f"{recipe:<13} seed {seed} {level:<8} FAILED: {exc}\n" + "\n".join(tail), flush=True)
                return {"recipe": recipe, "seed": seed, "level": level, "failed": str(exc)}
        row = {"recipe": recipe, "seed": seed, "level": level, "wall_s": wall,
               **learning_curve(run_dir, args.at_step), "near_miss_end": near_miss_accuracy(run_dir)}
        print(f"{recipe:<13} seed {seed} {level:<8} warm-up stop {row['warmup_steps']!s:>5}  "
              f"greedy {row['greedy_start']:.3f} -> {row['greedy_end']:.3f} ({row['greedy_gain']:+.3f})  "
              f"sampled {row['sampled_start']:.3f} -> {row['sampled_end']:.3f}  "
              f"train reward {'n/a' if row['reward_rise'] is None else format(row['reward_rise'], '+.3f')}  "
              f"{wall:.0f}s" + ("" if row["near_miss_end"] is None else
                                f"  near misses alone at end {row['near_miss_end']:.3f}")
              + ("" if "reverse_kl_drop" not in row else f"  reverse KL drop {row['reverse_kl_drop']:+.3f}"), flush=True)
        return row

    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(one, jobs))
    failed = [r for r in rows if "failed" in r]
    rows = [r for r in rows if "failed" not in r]
    print()
    print("| recipe | runs | greedy after warm-up | greedy at end | greedy gain min / median / max | "
          "sampled gain min / median / max | train reward rise min / median / max | wall s (median) |")
    print("|---|---|---|---|---|---|---|---|")
    summary = {}
    for recipe in args.recipes:
        mine = [r for r in rows if r["recipe"] == recipe]
        g, s = spread([r["greedy_gain"] for r in mine]), spread([r["sampled_gain"] for r in mine])
        # offline DPO samples nothing in training: no training reward
        rise = spread([r["reward_rise"] for r in mine if r["reward_rise"] is not None] or [float("nan")])
        starts, ends = spread([r["greedy_start"] for r in mine]), spread([r["greedy_end"] for r in mine])
        wall = statistics.median(r["wall_s"] for r in mine)
        summary[recipe] = {"greedy_gain": g, "sampled_gain": s, "reward_rise": rise, "greedy_start": starts,
                           "greedy_end": ends,
                           "median_wall_s": wall, "runs": len(mine)}
        print(f"| {recipe} | {len(mine)} | {starts['min']:.2f}-{starts['max']:.2f} | {ends['min']:.2f}-{ends['max']:.2f} | "
              f"{g['min']:+.3f} / {g['median']:+.3f} / {g['max']:+.3f} | "
              f"{s['min']:+.3f} / {s['median']:+.3f} / {s['max']:+.3f} | "
              f"{rise['min']:+.3f} / {rise['median']:+.3f} / {rise['max']:+.3f} | {wall:.0f} |")
    if args.at_step is not None:
        print(f"\nafter the first {args.at_step} RL steps:")
        print("| recipe | greedy gain min / median / max | sampled gain min / median / max | "
              "train reward rise min / median / max |")
        print("|---|---|---|---|")
        for recipe in args.recipes:
            mine = [r["at_step"] for r in rows if r["recipe"] == recipe]
            g, s = spread([r["greedy_gain"] for r in mine]), spread([r["sampled_gain"] for r in mine])
            rise = spread([r["reward_rise"] for r in mine])
            summary[recipe]["at_step"] = {"rl_steps": args.at_step, "greedy_gain": g, "sampled_gain": s,
                                          "reward_rise": rise}
            print(f"| {recipe} | {g['min']:+.3f} / {g['median']:+.3f} / {g['max']:+.3f} | "
                  f"{s['min']:+.3f} / {s['median']:+.3f} / {s['max']:+.3f} | "
                  f"{rise['min']:+.3f} / {rise['median']:+.3f} / {rise['max']:+.3f} |")
    for recipe in args.recipes:
        near = [r["near_miss_end"] for r in rows if r["recipe"] == recipe and r["near_miss_end"] is not None]
        if near:
            n = spread(near)
            summary[recipe]["near_miss_end"] = n
            print(f"{recipe}: held-out near misses alone at the end {n['min']:.3f} / {n['median']:.3f} / {n['max']:.3f}")
    for recipe in args.recipes:
        drops = [r["reverse_kl_drop"] for r in rows if r["recipe"] == recipe and "reverse_kl_drop" in r]
        if drops:
            d = summary[recipe]["reverse_kl_drop"] = spread(drops)
            print(f"{recipe}: reverse KL to the teacher, drop first vs last 25 steps "
                  f"{d['min']:+.3f} / {d['median']:+.3f} / {d['max']:+.3f}")
    for r in failed:
        print(f"FAILED: {r['recipe']} seed {r['seed']} {r['level']} (left out of the table)")
    return [{"runs": rows, "failed": failed, "summary": summary, "teachers": teacher_accuracy}]


def lr_sweep(args, workdir: Path) -> list[dict]:
    level = args.levels[-1]
    models = {}

    def warm(seed):
        run_dir = workdir / f"warmup-s{seed}"
        run_rltk(["run", "grpo", f"seed={seed}", *SWEEP_WARMUP], run_dir, level, workdir / f"{run_dir.name}.log")
        last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
        subprocess.run([sys.executable, "-m", "rltk.commands.cli", "export", str(last), str(workdir / f"model-s{seed}")],
                       check=True, capture_output=True)
        models[seed] = workdir / f"model-s{seed}"

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(warm, args.seeds))
    jobs = [(variant, lr, seed) for seed in args.seeds for lr in args.lrs for variant in args.variants]

    def one(job):
        variant, lr, seed = job
        run_dir = workdir / f"sweep-{abs(hash(job))}"
        wall = run_rltk(["run", "grpo", f"seed={seed}", f"model.path={models[seed]}", *SWEEP_RL,
                         f"trainer.lr={lr}", f"trainer.total_steps={args.sweep_steps}",
                         f"trainer.eval_every={args.sweep_steps // 4}", "checkpoint.every=0",
                         *SWEEP_VARIANTS[variant]], run_dir, level, workdir / f"{run_dir.name}.log")
        curve = learning_curve(run_dir)
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        entropy = [m["entropy"] for m in metrics if "entropy" in m]
        row = {"variant": variant, "lr": lr, "seed": seed, "wall_s": wall, **curve,
               "final_entropy": statistics.mean(entropy[-50:]) if entropy else None}
        print(f"{variant:<24} lr {lr:<8g} seed {seed}  greedy {row['greedy_start']:.3f} -> {row['greedy_end']:.3f} "
              f"({row['greedy_gain']:+.3f})  entropy at end {row['final_entropy']}", flush=True)
        return row

    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(one, jobs))
    print()
    print(f"| variant | " + " | ".join(f"lr {lr:g}" for lr in args.lrs) + " |")
    print("|---|" + "---|" * len(args.lrs))
    for variant in args.variants:
        cells = []
        for lr in args.lrs:
            mine = [r for r in rows if r["variant"] == variant and r["lr"] == lr]
            gains = ", ".join(f"{r['greedy_gain']:+.2f}" for r in mine)
            ent = statistics.mean(r["final_entropy"] for r in mine if r["final_entropy"] is not None)
            cells.append(f"{gains} (end {statistics.mean(r['greedy_end'] for r in mine):.2f}, entropy {ent:.2f})")
        print(f"| {variant} | " + " | ".join(cells) + " |")
    return [{"sweep": rows, "level": level, "steps": args.sweep_steps}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["grpo", "ppo"], choices=list(RUNS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--levels", nargs="+", default=None, help="ATEN_CPU_CAPABILITY levels (default: all)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--lr-sweep", action="store_true")
    parser.add_argument("--lrs", nargs="+", type=float, default=[5e-5, 1e-4, 2e-4])
    parser.add_argument("--variants", nargs="+", default=list(SWEEP_VARIANTS), choices=list(SWEEP_VARIANTS))
    parser.add_argument("--sweep-steps", type=int, default=4000)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--at-step", type=int, default=None,
                        help="also report the gains after this many RL steps (a multiple of trainer.eval_every)")
    parser.add_argument("--runs-dir", type=Path, default=None,
                        help="summarise the runs already in this folder (RECIPE-sSEED-LEVEL/metrics.jsonl) "
                             "instead of running them")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every default run")
    args = parser.parse_args()
    args.levels = args.levels or cpu_levels()
    if args.lr_sweep and args.seeds == [0, 1, 2, 3, 4]:
        args.seeds = [0]
    with tempfile.TemporaryDirectory(prefix="rltk-learning-") as tmp:
        tick = time.perf_counter()
        result = (lr_sweep if args.lr_sweep else default_runs)(args, args.runs_dir or Path(tmp))[0]
        result.update({"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                       "total_wall_s": time.perf_counter() - tick})
    out = args.out or RESULTS / ("learning_lr_sweep.json" if args.lr_sweep else "learning.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out} ({result['total_wall_s'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
