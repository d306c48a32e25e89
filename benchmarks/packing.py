"""Benchmark: token-budget micro-batches (and packing) against padded micro-batches, same gradients.

    python benchmarks/packing.py                 # 32 rows, 2 rounds (~3-5 min on 2 shared cores)
    python benchmarks/packing.py --rows 16 --rounds 1

One policy update (:func:`rltk.training.updates.rl.policy_update`, PPO-clip, token-mean,
entropy bonus) on a random-init Qwen2 of ~20M parameters (hidden 256, 12 layers,
4 heads / 2 KV heads, MLP 1024, vocabulary 32000 tied; sdpa attention), fp32, over
one rollout batch whose prompts are 32 tokens and whose response lengths are
uniform in [16, 512]. Cases:

* ``padded``: today's default, ``trainer.micro_batch_size`` rows per micro-batch
  padded to the batch's longest row;
* ``budget``: ``trainer.max_tokens_per_micro_batch`` (rows sorted by length, each
  micro-batch trimmed to its longest prompt and response);
* ``budget+pack``: the same budget with ``trainer.pack_sequences`` (each micro-batch
  one packed row; on CPU transformers' sdpa then masks a block-diagonal
  ``[L, L]`` square, so attention costs grow with the packed length).

Training tokens/s counts the batch's real (attention-mask) tokens per second of
update. The cases run interleaved, round after round, and the ratios are taken
within each round; process CPU time is reported beside wall time since other jobs
share the cores. The gradients of every case are compared with ``padded``'s in the
same run (max abs difference and relative to the gradient's scale); a case whose
gradient differs beyond fp32 tolerance is flagged. Prints a table and writes JSON
under ``benchmarks/results/``.

Target (issue #13, item 2): token-budget >= 1.5x padded tokens/s, same gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PROMPT_LEN = 32
VOCAB = 32000


def build_model(seed: int):
    """The ~20M-parameter Qwen2 shape, random init, fp32, sdpa attention."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(hidden_size=256, num_hidden_layers=12, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=1024, vocab_size=VOCAB,
                                      tie_word_embeddings=True, attn_implementation="sdpa")
    return transformers.Qwen2ForCausalLM(config)


def build_batch(rows: int, seed: int) -> dict:
    """A collated rollout batch: prompts of 32 tokens, responses uniform in [16, 512] tokens."""
    import torch

    from rltk.batch import Experience, collate

    g = torch.Generator().manual_seed(seed)
    experiences = []
    for i in range(rows):
        length = int(torch.randint(16, 513, (1,), generator=g))
        experiences.append(Experience(torch.randint(1, VOCAB, (PROMPT_LEN,), generator=g).tolist(),
                                      torch.randint(1, VOCAB, (length,), generator=g).tolist(),
                                      float(torch.rand((), generator=g)), group_id=i // 8))
    batch = collate(experiences, pad_token_id=0)
    mask = batch["response_mask"]
    batch["old_logprobs"] = (-torch.rand(mask.shape, generator=g) * 3 - 9) * mask  # ~log(1/32000)
    batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    return batch


class _KeepGrads:
    """Mixed into the strategy: step() records the summed gradient and zeroes it instead of stepping,
    so every case starts from the same weights and its gradient can be compared."""

    def step(self):
        self.kept = {n: p.grad.detach().clone() for n, p in self.unwrap().named_parameters() if p.grad is not None}
        self.optimizer.zero_grad(set_to_none=True)
        return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32, help="sequences in the rollout batch")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=4, help="rows per padded micro-batch")
    parser.add_argument("--max-tokens", type=int, default=2048, help="trainer.max_tokens_per_micro_batch")
    parser.add_argument("--pack-max-tokens", type=int, default=1024,
                        help="the budget of the packed case (attention over a packed row grows with its length^2 "
                             "on CPU, so it wants a smaller one)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on shared cores)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    os.environ.setdefault("RLTK_DISABLE_PLUGIN_AUTOLOAD", "1")
    import torch

    import rltk
    from rltk.strategies.accelerate_strategy import AccelerateStrategy
    from rltk.training.step.forward import ForwardSettings
    from rltk.training.step.loss_components import LossComponents
    from rltk.training.updates.rl import policy_update

    torch.set_num_threads(args.threads)
    Strategy = type("KeepGradsStrategy", (_KeepGrads, AccelerateStrategy), {})
    strategy = Strategy(cpu=True)
    model = build_model(args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    strategy.setup(model, lr=1e-5, total_steps=1, weight_decay=0.0, warmup_steps=0, lr_schedule="constant",
                   grad_clip=None)
    batch = build_batch(args.rows, args.seed)
    tokens = int(batch["attention_mask"].sum())
    loss = LossComponents(policy_loss=rltk.get_component("policy_loss", "ppo_clip"),
                          loss_agg=rltk.get_component("loss_agg", "token-mean"), entropy_coef=0.01)
    cases = {
        "padded": dict(micro_batch_size=args.micro_batch_size),
        "budget": dict(micro_batch_size=args.micro_batch_size, max_tokens_per_micro_batch=args.max_tokens),
        "budget+pack": dict(micro_batch_size=args.micro_batch_size,
                            max_tokens_per_micro_batch=args.pack_max_tokens, pack_sequences=True),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    grads: dict[str, dict] = {}
    for round_ in range(args.rounds):
        for name, micro in cases.items():
            wall, cpu = time.perf_counter(), time.process_time()
            policy_update(strategy, batch, loss, ForwardSettings(**micro), kl_coef=0.0, mini_batches=1, ppo_epochs=1,
                          generator=torch.Generator().manual_seed(0))
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
            grads.setdefault(name, strategy.kept)
            print(f"round {round_} {name:12s} wall {times[name][-1][0]:6.1f} s  cpu {times[name][-1][1]:6.1f} s",
                  file=sys.stderr, flush=True)

    reference = grads["padded"]
    scale = max(g.abs().max().item() for g in reference.values())
    results = {}
    for name in cases:
        walls = [w for w, _ in times[name]]
        cpus = [c for _, c in times[name]]
        diff = max((grads[name][k] - g).abs().max().item() for k, g in reference.items())
        ratios = [times["padded"][r][0] / times[name][r][0] for r in range(args.rounds)]
        cpu_ratios = [times["padded"][r][1] / times[name][r][1] for r in range(args.rounds)]
        results[name] = {
            "wall_s_median": statistics.median(walls), "cpu_s_median": statistics.median(cpus),
            "tokens_per_s": tokens / statistics.median(walls),
            "speedup_wall_median": statistics.median(ratios), "speedup_cpu_median": statistics.median(cpu_ratios),
            "speedup_wall_per_round": ratios, "speedup_cpu_per_round": cpu_ratios,
            "grad_max_abs_diff": diff, "grad_max_rel_diff": diff / scale, "same_gradient": diff <= 1e-5 * scale + 1e-7,
        }

    print(f"\npolicy update, Qwen2 {n_params / 1e6:.1f}M params fp32 sdpa, {args.rows} rows, prompts {PROMPT_LEN}, "
          f"responses U[16, 512], {tokens} real tokens of {batch['attention_mask'].numel()} padded; "
          f"micro_batch_size={args.micro_batch_size}, max_tokens_per_micro_batch={args.max_tokens} "
          f"({args.pack_max_tokens} packed), "
          f"{args.rounds} rounds, {args.threads} threads\n")
    print("| case | wall s | cpu s | tokens/s | speedup (wall) | speedup (cpu) | grad max abs diff | same grad |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['wall_s_median']:.1f} | {r['cpu_s_median']:.1f} | {r['tokens_per_s']:.0f} | "
              f"{r['speedup_wall_median']:.2f}x | {r['speedup_cpu_median']:.2f}x | {r['grad_max_abs_diff']:.1e} | "
              f"{'yes' if r['same_gradient'] else 'NO'} |")
    print(f"\ntoken-budget vs padded: {results['budget']['speedup_cpu_median']:.2f}x training tokens/s (cpu time), "
          f"{results['budget']['speedup_wall_median']:.2f}x (wall); target >= 1.5x")
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / f"packing-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps({
        "args": vars(args), "params": n_params, "real_tokens": tokens,
        "padded_tokens": batch["attention_mask"].numel(), "machine": platform.machine(),
        "torch": torch.__version__, "load_average": os.getloadavg(), "results": results,
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
