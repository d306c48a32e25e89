"""Does the tiny VLM default learn its visual task on every seed and CPU kernel level, and where does a step go?

Runs `rltk run grpo --config recipes/configs/vlm.yaml seed=S` (the `shape_colour` task: name the colour of a
shape drawn in code; 1/3 without the picture) for each seed and torch CPU kernel level (`ATEN_CPU_CAPABILITY`:
`default`, `avx2` and the machine's best), each in a fresh single-threaded process, and prints per run:

* held-out greedy and sampled accuracy when GRPO starts (after the warm-up) and at the end, and the gain;
  with the text-only chance level (1/3: the prompts are one text and the colours equally frequent) beside it;
* the median RL step's wall time split into the vision tower's forward passes, the language model's
  forward passes (every pass: sampling, old and reference log-probs, the update) and the rest (backward,
  optimizer, rewards, bookkeeping), timed by wrapping the two modules' ``forward`` in the run's process;
* the process's peak resident memory.

then the gain's min / median / max over the runs, as a table for docs/measurements.md, and all of it as JSON
under benchmarks/results/.

    python benchmarks/vlm.py                                   # seeds 0-2, every level, 2 runs at a time
    python benchmarks/vlm.py --seeds 0 1 2 --jobs 2           # docs' figures: 3 seeds x 3 levels
    python benchmarks/vlm.py --seeds 0 --levels avx2 --jobs 1  # one run
    python benchmarks/vlm.py --seeds 0 1 2 3 4 --levels default avx2 avx512 --jobs 2 trainer.total_steps=40
    python benchmarks/vlm.py --workdir runs/vlm-bench --summarise      # the figures of runs made earlier
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
from learning import RESULTS, cpu_levels, learning_curve  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "recipes" / "configs" / "vlm.yaml"
#: Held-out accuracy of a policy that does not look: every prompt is "Colour?", the 3 colours equally often.
TEXT_ONLY_CHANCE = 1 / 3
#: Where the run's process leaves its peak memory (written by `--child`).
PEAK_FILE = "vlm_bench_peak.json"


def child(argv: list[str]) -> int:
    """Run the rltk CLI in this process with the VLM's two halves timed; their seconds join each step's metrics."""
    import resource

    import rltk
    from rltk.commands.cli import main
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen

    spent = {"vision": 0.0, "language_model": 0.0}

    def timed(cls, bucket):
        forward = cls.forward

        def wrapper(self, *args, **kwargs):
            tick = time.perf_counter()
            try:
                return forward(self, *args, **kwargs)
            finally:
                spent[bucket] += time.perf_counter() - tick
        cls.forward = wrapper

    timed(qwen.Qwen2_5_VisionTransformerPretrainedModel, "vision")
    timed(qwen.Qwen2_5_VLTextModel, "language_model")

    class Timing:
        @rltk.hookimpl
        def rltk_on_step_end(self, step, metrics):
            metrics["bench/vision_forward_s"] = spent["vision"]
            metrics["bench/language_model_forward_s"] = spent["language_model"]
            spent.update(vision=0.0, language_model=0.0)

        @rltk.hookimpl
        def rltk_on_train_end(self, run_dir, metrics):
            peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
            (Path(run_dir) / PEAK_FILE).write_text(json.dumps({"peak_rss_mb": peak_mb}))

    rltk.register_plugin(Timing(), name="vlm-bench-timing")
    return main(argv)


def run(seed: int, level: str, overrides: list[str], workdir: Path, at_step: int, *, again: bool = True) -> dict:
    """One run in a fresh process (or, without ``again``, the run already in ``workdir``) and its figures."""
    run_dir = workdir / f"vlm-s{seed}-{level}"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": level, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "RLTK_DISABLE_PLUGIN_AUTOLOAD": "1"}
    command = [sys.executable, __file__, "--child", "run", "grpo", "--config", str(CONFIG), f"seed={seed}",
               f"output_dir={run_dir}", "logging.logger=[jsonl]", "logging.plot=false", "checkpoint.resume=never",
               *overrides]
    log = workdir / f"{run_dir.name}.log"
    tick = time.perf_counter()
    if again:
        with open(log, "w") as out:
            done = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{tail}")
    wall = time.perf_counter() - tick if again else float("nan")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl_steps = [m for m in metrics if "time/step_s" in m and "bench/vision_forward_s" in m]
    return {"seed": seed, "level": level, "wall_s": wall, **learning_curve(run_dir, at_step),
            "rl_steps": len(rl_steps), "step_s": statistics.median(m["time/step_s"] for m in rl_steps),
            "vision_forward_s": statistics.median(m["bench/vision_forward_s"] for m in rl_steps),
            "language_model_forward_s": statistics.median(m["bench/language_model_forward_s"] for m in rl_steps),
            **json.loads((run_dir / PEAK_FILE).read_text())}


def spread(values: list[float]) -> str:
    return f"{min(values):+.3f} / {statistics.median(values):+.3f} / {max(values):+.3f}"


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--levels", nargs="+", default=None, help="ATEN_CPU_CAPABILITY levels (default: all)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--at-step", type=int, default=40,
                        help="also the gains after this many GRPO steps (a multiple of trainer.eval_every; the "
                             "shipped config's 40 by default), for runs made longer by an override")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    parser.add_argument("--summarise", action="store_true", help="read the runs already in --workdir, run nothing")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (key=value)")
    args = parser.parse_args()
    levels = args.levels or cpu_levels()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rltk-vlm-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)

    def one(job):
        seed, level = job
        row = run(seed, level, args.overrides, workdir, args.at_step, again=not args.summarise)
        rest = row["step_s"] - row["vision_forward_s"] - row["language_model_forward_s"]
        print(f"seed {seed} {level:<8} warm-up stop {row['warmup_steps']!s:>4}  greedy {row['greedy_start']:.3f} -> "
              f"{row['greedy_end']:.3f} ({row['greedy_gain']:+.3f})  sampled {row['sampled_start']:.3f} -> "
              f"{row['sampled_end']:.3f} ({row['sampled_gain']:+.3f}; {row['at_step']['sampled_gain']:+.3f} after "
              f"{args.at_step} steps)  RL step {row['step_s']:.2f}s = vision "
              f"{row['vision_forward_s']:.3f}s + LM forward {row['language_model_forward_s']:.3f}s + rest "
              f"{rest:.2f}s  peak RSS {row['peak_rss_mb']:.0f} MB  {row['wall_s']:.0f}s", flush=True)
        return row

    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(one, [(seed, level) for level in levels for seed in args.seeds]))
    print(f"\ntext-only chance {TEXT_ONLY_CHANCE:.3f}; {len(rows)} runs (seeds {args.seeds}, levels {levels})")
    print(f"after {args.at_step} GRPO steps: sampled gain min / median / max "
          f"{spread([r['at_step']['sampled_gain'] for r in rows])}, greedy gain "
          f"{spread([r['at_step']['greedy_gain'] for r in rows])}")
    print("| greedy after warm-up | greedy at end | greedy gain min / median / max | sampled gain min / median / max "
          "| RL step s (median) | vision forward s | LM forward s | peak RSS MB (max) |")
    print("|---|---|---|---|---|---|---|---|")
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    print(f"| {min(r['greedy_start'] for r in rows):.3f}-{max(r['greedy_start'] for r in rows):.3f} "
          f"| {min(r['greedy_end'] for r in rows):.3f}-{max(r['greedy_end'] for r in rows):.3f} "
          f"| {spread([r['greedy_gain'] for r in rows])} | {spread([r['sampled_gain'] for r in rows])} "
          f"| {med('step_s'):.2f} | {med('vision_forward_s'):.3f} | {med('language_model_forward_s'):.3f} "
          f"| {max(r['peak_rss_mb'] for r in rows):.0f} |")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"vlm-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"config": str(CONFIG), "overrides": args.overrides, "runs": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
