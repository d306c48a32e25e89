"""The tiny MoE default with and without routing replay: the rollout/trainer log-prob gap and the learning gain.

Two parts, both printed as tables and written to benchmarks/results/moe.json:

1. **A disagreeing engine** (in-process, seconds): for each seed, the tiny MoE samples a batch through the hf
   engine while every router picks its 2nd and 3rd most likely experts (the routing of an engine whose kernels
   break the router's choice differently, exaggerated to every token); the trainer then computes the log-probs
   of those tokens with its own top-k and with the rollout's replayed (rltk.training.step.moe_metrics).
2. **Learning** (one `rltk run grpo model.tiny.moe.num_experts=8` per seed, level and replay mode, each a fresh
   single-threaded process, as benchmarks/learning.py runs the dense default): held-out greedy accuracy when RL
   starts and at the end, and the MoE metrics averaged over the RL steps.

    python benchmarks/moe.py                                     # seeds 0-2, the machine's best level, both modes
    python benchmarks/moe.py --seeds 0 --levels avx2 default     # other kernel levels
    python benchmarks/moe.py --skip-learning                     # part 1 only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning import RESULTS, cpu_levels, learning_curve, run_rltk  # noqa: E402

MOE = ["run", "grpo", "model.tiny.moe.num_experts=8"]
MOE_KEYS = ("moe/topk_mismatch", "moe/mismatch_kl_own_routing", "moe/mismatch_kl_replay",
            "moe/logprob_gap_own_routing", "moe/logprob_gap_replay", "moe/load_entropy", "moe/load_max_share")


def disagreeing_engine(seed: int) -> dict:
    """Part 1 for one seed: 16 prompts x 8 samples of the task's prompts."""
    from rltk.batch import Experience, collate
    from rltk.models.moe import route_by_rank
    from rltk.models.tiny import build_char_tokenizer
    from rltk.models.tiny import build_tiny_moe_model
    from rltk.rollout.base import SamplingParams
    from rltk.rollout.hf import HFRolloutEngine
    from rltk.training.step.forward import ForwardSettings
    from rltk.training.step.moe_metrics import moe_step_metrics

    tokenizer = build_char_tokenizer()
    model = build_tiny_moe_model(tokenizer, seed=seed).eval()
    prompts = [tokenizer.encode(f"{a}+{b}=", add_special_tokens=False) for a, b in zip(range(3, 99, 6), range(50, 2, -3))]
    with route_by_rank(model, (1, 2)):
        groups = HFRolloutEngine(model, tokenizer).generate(prompts, SamplingParams(n=8, max_new_tokens=5, seed=seed))
    experiences = [Experience(prompts[c.prompt_index], c.token_ids, 0.0, c.prompt_index, rollout_logprobs=c.logprobs,
                              routed_experts=c.routed_experts) for group in groups for c in group]
    batch = collate(experiences, tokenizer.pad_token_id)
    metrics = moe_step_metrics(model, batch, ForwardSettings(micro_batch_size=64, share_prompts=False))
    return {"seed": seed, **{k: metrics[k] for k in MOE_KEYS}}


def learning_run(seed: int, level: str, replay: str, workdir: Path) -> dict:
    run_dir = workdir / f"moe-{level}-{seed}-{replay}"
    wall = run_rltk([*MOE, f"seed={seed}", f"algorithm.routing_replay={replay}"], run_dir, level,
                    workdir / f"{run_dir.name}.log")
    curve = learning_curve(run_dir)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "moe/topk_mismatch" in m]
    means = {k: statistics.fmean(m[k] for m in steps) for k in MOE_KEYS} if steps else {}
    return {"seed": seed, "level": level, "replay": replay, "wall_s": wall, "rl_steps": len(steps),
            **{k: curve[k] for k in ("warmup_steps", "greedy_start", "greedy_end", "greedy_gain", "reward_rise")},
            **means}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--levels", nargs="+", default=None, help="default: the machine's best level")
    parser.add_argument("--replay", nargs="+", default=["none", "rollout"])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--skip-learning", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "moe.json")
    args = parser.parse_args(argv)
    levels = args.levels or [cpu_levels()[-1]]

    print("1. a disagreeing engine (routers at rollout pick their 2nd and 3rd experts); trainer vs engine")
    engine_rows = [disagreeing_engine(seed) for seed in args.seeds]
    print(f"{'seed':>4} {'topk differs':>12} {'KL own':>10} {'KL replay':>10} {'gap own':>10} {'gap replay':>10}")
    for r in engine_rows:
        print(f"{r['seed']:>4} {r['moe/topk_mismatch']:>12.3f} {r['moe/mismatch_kl_own_routing']:>10.2e} "
              f"{r['moe/mismatch_kl_replay']:>10.2e} {r['moe/logprob_gap_own_routing']:>10.2e} "
              f"{r['moe/logprob_gap_replay']:>10.2e}")
    learning_rows: list[dict] = []
    if not args.skip_learning:
        print(f"\n2. rltk run grpo model.tiny.moe.num_experts=8, levels {levels}, seeds {args.seeds}")
        jobs = [(seed, level, replay) for level in levels for seed in args.seeds for replay in args.replay]
        with tempfile.TemporaryDirectory(prefix="rltk-moe-") as tmp, ThreadPoolExecutor(args.jobs) as pool:
            learning_rows = list(pool.map(lambda job: learning_run(*job, Path(tmp)), jobs))
        print(f"{'level':>8} {'seed':>4} {'replay':>8} {'warmup':>6} {'start':>6} {'end':>6} {'gain':>6} "
              f"{'topk differs':>12} {'gap own':>9} {'gap replay':>10} {'KL own':>9} {'wall s':>7}")
        for r in learning_rows:
            print(f"{r['level']:>8} {r['seed']:>4} {r['replay']:>8} {r['warmup_steps']:>6} {r['greedy_start']:>6.3f} "
                  f"{r['greedy_end']:>6.3f} {r['greedy_gain']:>+6.3f} {r.get('moe/topk_mismatch', 0):>12.4f} "
                  f"{r.get('moe/logprob_gap_own_routing', 0):>9.1e} {r.get('moe/logprob_gap_replay', 0):>10.1e} "
                  f"{r.get('moe/mismatch_kl_own_routing', 0):>9.1e} {r['wall_s']:>7.0f}")
        for replay in args.replay:
            gains = [r["greedy_gain"] for r in learning_rows if r["replay"] == replay]
            print(f"greedy gain, replay={replay}: min {min(gains):+.3f} median {statistics.median(gains):+.3f} "
                  f"max {max(gains):+.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"disagreeing_engine": engine_rows, "learning": learning_rows}, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
