"""Benchmark: peak memory and step time of a GRPO update with KL, LoRA against full fine-tuning,
gradient checkpointing on against off.

    python benchmarks/lora.py                     # 5-layer Qwen2.5-0.5B-shaped model (103M), 2 rounds (~30 min)
    python benchmarks/lora.py --rows 8 --micro-batch-size 8 --rounds 3
    python benchmarks/lora.py --layers 1 --vocab 151936   # Qwen2.5's real vocabulary (~151M: the embedding alone is 136M)

The model is a random-init Qwen2 with Qwen2.5-0.5B's layer shapes (hidden 896,
14 attention heads, 2 KV heads, MLP 4864, tied embedding, fp32, sdpa) and fewer
layers; its full vocabulary (151936) would make the embedding alone 136M
parameters, so the default keeps 5 layers (74.5M) and a 32000-token vocabulary
(28.7M): 103M parameters. One rollout batch of ``--rows`` sequences of 256 tokens
(64 prompt + 192 response, GRPO groups of up to 8 rows; ``--micro-batch-size`` rows
per forward/backward) is trained on for ``--steps`` steps, each the recipe's update: old log-probs, reference log-probs,
group advantages, one PPO-clip step with a k3 KL term in the loss
(``kl_coef`` 0.05), all through rltk's own functions (``apply_lora``,
``FrozenReference``, ``old_logprobs_pass``, ``compute_advantages``,
``policy_update``, the accelerate strategy's AdamW). Cases:

* ``full``: every weight trains; the KL reference is a frozen copy of the policy
  (``FrozenReference`` without LoRA).
* ``lora``: ``model.lora.r=16``, ``alpha=32``, all linear layers but the head; the
  reference is the same module with its adapters off (no copy).
* ``+ckpt``: either with ``model.gradient_checkpointing=true``.

Memory. Each case runs in a fresh subprocess with
``MALLOC_MMAP_THRESHOLD_=1048576`` (glibc returns every freed buffer above 1 MiB
to the OS, so the resident set follows what torch holds rather than what the
allocator keeps cached). Its peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` once torch, transformers, peft and rltk are imported
and warmed up) minus the resident set at that moment is the case's peak: model,
reference, gradients, optimizer state and activations, from building the model to
the end of the last step. Times are per step (wall and process CPU time); the
first step is left out (optimizer state allocation, first-call costs). Cases run
alternated, in a rotated order each round, and every ratio is taken within one
round; the table gives each ratio's median and its range over rounds. Results are
written as JSON under ``benchmarks/results/``.

Targets (issue #15): LoRA peak <= 0.35x full fine-tuning's (checkpointing off);
step-time ratio and checkpointing's memory and time ratios reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from process_memory import memory_kib, reset_peak

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CASES = ("full", "lora", "full+ckpt", "lora+ckpt")
PROMPT_LEN, RESPONSE_LEN, GROUP = 64, 192, 8
KL_COEF = 0.05


# --------------------------------------------------------------------------
# Child process: one case
# --------------------------------------------------------------------------


def build_config(layers: int, vocab: int):
    """Qwen2.5-0.5B's layer shapes with ``layers`` layers and a ``vocab``-token tied embedding."""
    import transformers

    return transformers.Qwen2Config(
        hidden_size=896, num_hidden_layers=layers, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=vocab, max_position_embeddings=PROMPT_LEN + RESPONSE_LEN,
        tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0, attn_implementation="sdpa",
    )


def build_batch(rows: int, vocab: int, seed: int) -> dict:
    """A collated rollout batch: ``rows`` full-length 64 + 192 token sequences, groups of 8 with both
    rewards present (so every group has advantages)."""
    import torch

    from rltk.batch import Experience, collate

    g = torch.Generator().manual_seed(seed)
    experiences = []
    for i in range(rows):
        group = i // GROUP
        if i % GROUP == 0:
            prompt = torch.randint(3, vocab, (PROMPT_LEN,), generator=g).tolist()
        response = torch.randint(3, vocab, (RESPONSE_LEN,), generator=g).tolist()
        experiences.append(Experience(prompt, response, score=float(i % 2), group_id=group))
    return collate(experiences, pad_token_id=0)


def run_child(case: str, args) -> dict:
    """Build the policy for ``case``, run ``args.steps`` GRPO updates on one batch; peak memory and times."""
    os.environ.setdefault("RLTK_DISABLE_PLUGIN_AUTOLOAD", "1")
    import peft  # noqa: F401  (imported before the baseline in every case, not only the LoRA ones)
    import torch
    import transformers

    import rltk
    from rltk.config.loader import load_config
    from rltk.models.activation_checkpointing import enable_activation_checkpointing
    from rltk.models.lora import apply_lora
    from rltk.training.step.reference import FrozenReference
    from rltk.training.step.forward import ForwardSettings, old_logprobs_pass
    from rltk.training.step.estimator import compute_advantages
    from rltk.training.step.loss_components import LossComponents
    from rltk.training.updates.rl import policy_update
    from rltk.training.scaffold.setup import args_of, build_strategy

    torch.set_num_threads(args.threads)
    lora = case.startswith("lora")
    checkpointing = case.endswith("+ckpt")
    overrides = [f"algorithm.kl_coef={KL_COEF}", f"trainer.micro_batch_size={args.micro_batch_size}",
                 f"model.gradient_checkpointing={checkpointing}", "model.logprob_impl=torch",
                 f"rollout.max_new_tokens={RESPONSE_LEN}"]
    if lora:
        overrides += [f"model.lora.r={args.rank}", f"model.lora.alpha={2 * args.rank}",
                      "model.lora.target_modules=all-linear"]
    cfg = load_config([], overrides, warn=False)
    batch0 = build_batch(args.rows, args.vocab, args.seed)
    # warm up the libraries (thread pools, MKL/oneDNN buffers) so the baseline holds them
    warm = torch.nn.Linear(896, 896)
    warm(torch.randn(64, 896)).sum().backward()
    del warm

    base = memory_kib()["VmRSS"]
    reset_peak()
    torch.manual_seed(args.seed)
    # what rltk.training.scaffold.setup.build_tokenizer_and_policy does to a model loaded from model.path
    model = transformers.Qwen2ForCausalLM(build_config(args.layers, args.vocab))
    if cfg.model.gradient_checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    model = apply_lora(model, cfg.model.lora)
    t = cfg.trainer
    strategy = build_strategy(cfg, model, lr=1e-5, total_steps=args.steps, warmup_steps=0, lr_schedule="constant")
    policy = strategy.unwrap()
    reference = FrozenReference.for_stage(strategy, cfg.algorithm.kl_coef)  # the recipes' reference
    loss = LossComponents.from_config(cfg)
    advantage_fn = rltk.get_component("advantage_fn", cfg.algorithm.advantage_fn)
    settings = ForwardSettings(micro_batch_size=t.micro_batch_size,
                               max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
                               pack_sequences=t.pack_sequences, temperature=1.0, impl=cfg.model.logprob_impl,
                               chunk_size=cfg.model.logprob_chunk_size)
    generator = torch.Generator().manual_seed(args.seed)
    times, cpu_times, step_peaks = [], [], []
    for _ in range(args.steps):
        batch = dict(batch0)
        wall, cpu = time.perf_counter(), time.process_time()
        # the recipe's update step (recipes/grpo.py): old and reference log-probs, advantages, update
        batch["old_logprobs"], _ = old_logprobs_pass(policy, batch, settings, use_rollout_logprobs=False,
                                                     strategy=strategy)
        batch["ref_logprobs"] = reference.logprobs(batch, settings)
        compute_advantages(advantage_fn, batch, args_of(cfg, "algorithm.advantage_fn"), strategy)
        metrics, _ = policy_update(strategy, batch, loss, settings, kl_coef=cfg.algorithm.kl_coef,
                                   mini_batches=t.mini_batches, ppo_epochs=t.ppo_epochs, generator=generator)
        times.append(time.perf_counter() - wall)
        cpu_times.append(time.process_time() - cpu)
        step_peaks.append((memory_kib()["VmHWM"] - base) / 1024)
    params = sum(p.numel() for p in policy.parameters())
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    optimizer_state = sum(v.numel() * v.element_size() for s in strategy.optimizer.state.values()
                          for v in s.values() if isinstance(v, torch.Tensor))
    return {
        "case": case, "peak_mib": (memory_kib()["VmHWM"] - base) / 1024, "peak_after_step_mib": step_peaks,
        "baseline_rss_mib": base / 1024, "times_s": times, "cpu_times_s": cpu_times, "params": params,
        "trainable_params": trainable, "optimizer_state_mib": optimizer_state / 2**20,
        "reference_copy": not reference.shares_policy, "kl_loss": metrics.get("kl_loss"),
        "pg_loss": metrics.get("pg_loss"),
    }


# --------------------------------------------------------------------------
# Parent: alternated rounds, ratios, table, JSON
# --------------------------------------------------------------------------


CHILD_ARGS = ("layers", "vocab", "rows", "micro_batch_size", "steps", "threads", "seed", "rank")


def spawn(case: str, args) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576", RLTK_DISABLE_PLUGIN_AUTOLOAD="1")
    repo_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = repo_root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, __file__, "--child", case]
    for name in CHILD_ARGS:
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"benchmark child {case} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def step_time(record: dict, key: str = "times_s") -> float:
    """Median step time, the first (warm-up) step left out when there are others."""
    times = record[key][1:] or record[key]
    return statistics.median(times)


RATIOS = {
    # name: (numerator case, denominator case)
    "lora / full": ("lora", "full"),
    "lora+ckpt / full+ckpt": ("lora+ckpt", "full+ckpt"),
    "lora+ckpt / full": ("lora+ckpt", "full"),
    "full: ckpt on / off": ("full+ckpt", "full"),
    "lora: ckpt on / off": ("lora+ckpt", "lora"),
}


def summarize(rounds: list[dict[str, dict]]) -> dict:
    out = {}
    for name, (num, den) in RATIOS.items():
        per_round = {
            "peak_memory": [r[num]["peak_mib"] / r[den]["peak_mib"] for r in rounds],
            "step_time_wall": [step_time(r[num]) / step_time(r[den]) for r in rounds],
            "step_time_cpu": [step_time(r[num], "cpu_times_s") / step_time(r[den], "cpu_times_s") for r in rounds],
        }
        out[name] = {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "per_round": v}
                     for k, v in per_round.items()}
    return out


def fmt_range(stat: dict) -> str:
    if len(stat["per_round"]) == 1:
        return f"{stat['median']:.2f}"
    return f"{stat['median']:.2f} ({stat['min']:.2f}-{stat['max']:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=5, help="decoder layers (Qwen2.5-0.5B has 24)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size (Qwen2.5: 151936)")
    parser.add_argument("--rows", type=int, default=4, help="sequences in the rollout batch (groups of up to 8)")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="trainer.micro_batch_size")
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps per case (the first is not timed)")
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds over the cases")
    parser.add_argument("--rank", type=int, default=16, help="model.lora.r (alpha = 2r)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on shared cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    args = parser.parse_args()

    if args.child:
        print(json.dumps(run_child(args.child, args)))
        return

    import torch

    rounds: list[dict[str, dict]] = []
    for round_ in range(args.rounds):
        order = args.cases[round_ % len(args.cases):] + args.cases[: round_ % len(args.cases)]
        records = {}
        for case in order:
            records[case] = spawn(case, args)
            r = records[case]
            print(f"round {round_} {case:10s} peak {r['peak_mib']:7.0f} MiB  step {step_time(r):6.1f} s wall "
                  f"{step_time(r, 'cpu_times_s'):6.1f} s cpu", file=sys.stderr, flush=True)
        rounds.append(records)

    first = rounds[0][args.cases[0]]
    print(f"\nGRPO update with KL (kl_coef {KL_COEF}, k3 in the loss), random-init Qwen2 with Qwen2.5-0.5B layer "
          f"shapes: {args.layers} layers, vocab {args.vocab}, {first['params'] / 1e6:.1f}M params, fp32, sdpa; "
          f"{args.rows} rows x {PROMPT_LEN + RESPONSE_LEN} tokens, micro_batch_size {args.micro_batch_size}, "
          f"LoRA r={args.rank} all-linear; {args.steps} steps per case, {args.rounds} rounds, {args.threads} threads\n")
    print("| case | trainable params | peak MiB (median, range) | step s wall | step s cpu |")
    print("|---|---|---|---|---|")
    for case in args.cases:
        peaks = [r[case]["peak_mib"] for r in rounds]
        walls = [step_time(r[case]) for r in rounds]
        cpus = [step_time(r[case], "cpu_times_s") for r in rounds]
        print(f"| {case} | {rounds[0][case]['trainable_params'] / 1e6:.2f}M | {statistics.median(peaks):.0f} "
              f"({min(peaks):.0f}-{max(peaks):.0f}) | {statistics.median(walls):.1f} | {statistics.median(cpus):.1f} |")
    ratios = summarize(rounds) if set(CASES) <= set(args.cases) else {}
    if ratios:
        print("\n| ratio | peak memory | step time (wall) | step time (cpu) |")
        print("|---|---|---|---|")
        for name, r in ratios.items():
            print(f"| {name} | {fmt_range(r['peak_memory'])} | {fmt_range(r['step_time_wall'])} | "
                  f"{fmt_range(r['step_time_cpu'])} |")
        lora_full = ratios["lora / full"]["peak_memory"]
        print(f"\nLoRA peak memory vs full fine-tuning with a reference copy: {fmt_range(lora_full)}x "
              f"(target <= 0.35x: {'met' if lora_full['max'] <= 0.35 else 'NOT met'})")
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / f"lora-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps({
        "args": vars(args), "machine": platform.machine(), "torch": torch.__version__,
        "load_average": os.getloadavg(), "rounds": rounds, "ratios": ratios,
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
