"""Benchmark: one GRPO policy update of a Qwen2.5-0.5B-shaped model, with and without the fused log-prob op.

    python benchmarks/gpu_grpo_step.py                       # CUDA: 64 sequences x 512 tokens, bf16
    python benchmarks/gpu_grpo_step.py --precisions bf16-weights amp-bf16 --steps 3 --micro-batch 16
    python benchmarks/gpu_grpo_step.py --tiny --device cpu   # the script's logic on a CPU, tiny shapes

The model is a randomly initialised ``Qwen2ForCausalLM`` with Qwen2.5-0.5B's
shapes (24 layers, hidden 896, MLP 4864, 14 query / 2 key-value heads,
vocabulary 151936, tied embeddings): the step's cost does not depend on the
weights' values, and no checkpoint needs to travel. The batch is 8 prompts x 8
samples, each row 64 prompt + 448 response tokens (64 x 512 = 32768 tokens),
random token ids and advantages. The update is rltk's own
:func:`rltk.training.updates.rl.policy_update` through :class:`AccelerateStrategy`
(``ppo_clip``, ``token-mean``, one mini-batch, on-policy, entropy computed as
in training), so it is the step a recipe runs, micro-batches included.

Variants (``--impls``): ``triton`` (the fused op: no ``[tokens, V]`` logits),
``triton-hopper`` (the same op on the kernels rebuilt for Hopper, issue 59) and ``naive`` (full fp32 logits and ``log_softmax``). Precisions
(``--precisions``): ``bf16-weights`` (the model in bf16, ``model.dtype=bfloat16``)
and ``amp-bf16`` (fp32 weights under bf16 autocast, ``mixed_precision=bf16``;
the op then sees fp32 hidden states and head). Each variant is warmed up with
one step, then the variants' timed steps alternate. Time is wall clock around
``policy_update`` after a device sync (forward, backward and optimizer step of
every micro-batch); peak memory is ``torch.cuda.max_memory_allocated`` during
the step, above what was allocated before it (weights, gradients, optimizer
state); the total peak also counts the other variant's model, which is alive at the same time. JSON (``--out``) is rewritten after every step, so a run stopped by a
time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = dict(vocab_size=1003, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, tie_word_embeddings=True)
PRECISIONS = ("bf16-weights", "amp-bf16")


def build_model(shape: dict, precision: str, device: str, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**shape, attn_implementation="sdpa")
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.to(torch.bfloat16) if precision == "bf16-weights" else model


def build_batch(prompts: int, group: int, prompt_len: int, response_len: int, vocab: int, seed: int) -> dict:
    """``group`` samples of each of ``prompts`` random prompts, full-length random responses."""
    gen = torch.Generator().manual_seed(seed)
    rows = prompts * group
    prompt = torch.randint(0, vocab, (prompts, prompt_len), generator=gen).repeat_interleave(group, 0)
    response = torch.randint(0, vocab, (rows, response_len), generator=gen)
    advantages = torch.randn(rows, 1, generator=gen).expand(rows, response_len).contiguous()
    return {
        "input_ids": torch.cat([prompt, response], 1),
        "attention_mask": torch.ones(rows, prompt_len + response_len, dtype=torch.long),
        "response_mask": torch.ones(rows, response_len),
        "advantages": advantages,
    }


class Variant:
    """One (precision, impl): its model, strategy and step records."""

    def __init__(self, precision: str, impl: str, shape: dict, device: str, seed: int):
        from rltk import get_component
        from rltk.strategies.accelerate_strategy import AccelerateStrategy
        from rltk.training.step.loss_components import LossComponents

        self.precision, self.impl = precision, impl
        self.strategy = AccelerateStrategy(cpu=device == "cpu",
                                           mixed_precision="bf16" if precision == "amp-bf16" else "no")
        self.strategy.setup(build_model(shape, precision, device, seed), lr=1e-6, total_steps=1000)
        self.loss = LossComponents(policy_loss=get_component("policy_loss", "ppo_clip"),
                                   loss_agg=get_component("loss_agg", "token-mean"))
        self.steps: list[dict] = []

    def step(self, batch: dict, micro_batch: int) -> dict:
        from rltk.training.step.forward import ForwardSettings
        from rltk.training.updates.rl import policy_update

        cuda = self.strategy.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        metrics, _ = policy_update(self.strategy, dict(batch), self.loss,
                                   ForwardSettings(micro_batch_size=micro_batch, impl=self.impl), kl_coef=0.0,
                                   mini_batches=1, ppo_epochs=1)
        if cuda:
            torch.cuda.synchronize()
        record = {"time_s": time.perf_counter() - start,
                  "pg_loss": float(metrics.get("pg_loss", float("nan"))),
                  "grad_norm": float(metrics.get("grad_norm", float("nan")))}
        if cuda:
            record["peak_above_start_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            record["peak_total_mib"] = torch.cuda.max_memory_allocated() / 2**20
            record["allocated_before_mib"] = base / 2**20
        return record

    def release(self):
        del self.strategy
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def summarise(results: dict) -> dict:
    out = {}
    for key, rec in results.items():
        timed = rec.get("timed", [])
        if not timed:
            out[key] = {"error": rec.get("error", "no timed step")}
            continue
        out[key] = {"median_step_s": statistics.median(r["time_s"] for r in timed),
                    "peak_above_start_mib": max((r.get("peak_above_start_mib", float("nan")) for r in timed)),
                    "peak_total_mib": max((r.get("peak_total_mib", float("nan")) for r in timed)),
                    "steps": len(timed)}
    for precision in PRECISIONS:
        fused, naive = out.get(f"{precision}/triton"), out.get(f"{precision}/naive")
        if fused and naive and "error" not in fused and "error" not in naive:
            out[f"{precision}/ratios"] = {
                "step_time_triton_over_naive": fused["median_step_s"] / naive["median_step_s"],
                "peak_above_start_triton_over_naive": fused["peak_above_start_mib"] / naive["peak_above_start_mib"],
            }
    return out


def table(report: dict) -> str:
    s = report["setting"]
    lines = [f"GRPO policy update, {s['rows']} sequences x {s['tokens_per_row']} tokens "
             f"({s['prompt_len']} prompt + {s['response_len']} response), micro-batches of {s['micro_batch']}, "
             f"{s['model']}; {report.get('versions', {})}", "",
             "| precision | impl | median step (s) | peak above start (MiB) | peak total (MiB) | steps |",
             "|---|---|---|---|---|---|"]
    summary = report.get("summary", {})
    for key, val in summary.items():
        if key.endswith("/ratios"):
            continue
        precision, impl = key.split("/")
        if "error" in val:
            lines.append(f"| {precision} | {impl} | {val['error'][:80]} | | | |")
        else:
            lines.append(f"| {precision} | {impl} | {val['median_step_s']:.3f} | {val['peak_above_start_mib']:.0f} | "
                         f"{val['peak_total_mib']:.0f} | {val['steps']} |")
    for key, val in summary.items():
        if key.endswith("/ratios"):
            lines.append(f"\n{key.split('/')[0]}: " + ", ".join(f"{k} = {v:.3f}" for k, v in val.items()))
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny Qwen2 and 4 x 2 rows of 8 + 24 tokens (logic check)")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=["bf16-weights"])
    parser.add_argument("--impls", nargs="+", choices=("triton", "triton-hopper", "torch", "naive"),
                        default=["triton", "naive"])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one warm-up step)")
    parser.add_argument("--micro-batch", type=int, default=16, help="rows per micro-batch (trainer.micro_batch_size)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "gpu_grpo_step.json")
    parser.add_argument("--table", type=Path, help="also write the markdown table here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here (use --device cpu --tiny to check the logic)")
    if args.device == "cpu" and {"triton", "triton-hopper"} & set(args.impls):
        parser.error("--device cpu: the triton impls need CUDA tensors; pass --impls torch naive")

    shape = TINY if args.tiny else QWEN25_05B
    prompts, group, prompt_len, response_len = (4, 2, 8, 24) if args.tiny else (8, 8, 64, 448)
    batch = build_batch(prompts, group, prompt_len, response_len, shape["vocab_size"], seed=0)
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    if args.device == "cuda":
        import transformers
        import triton

        versions.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda, triton=triton.__version__,
                        transformers=transformers.__version__)
    report = {"setting": {"rows": prompts * group, "tokens_per_row": prompt_len + response_len,
                          "prompt_len": prompt_len, "response_len": response_len, "micro_batch": args.micro_batch,
                          "model": "tiny Qwen2" if args.tiny else "random-init Qwen2, Qwen2.5-0.5B shapes",
                          "shape": shape, "policy_loss": "ppo_clip", "loss_agg": "token-mean", "lr": 1e-6},
              "versions": versions, "results": {}, "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}

    def save():
        report["summary"] = summarise(report["results"])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))

    for precision in args.precisions:
        # One model per variant, built in turn (two 0.5B models with AdamW state fit together easily);
        # the variants' timed steps then alternate, so drift of clocks or temperature hits both.
        variants = []
        for impl in args.impls:
            key = f"{precision}/{impl}"
            record = report["results"].setdefault(key, {"warmup": None, "timed": []})
            try:
                variant = Variant(precision, impl, shape, args.device, seed=0)
                record["warmup"] = variant.step(batch, args.micro_batch)
                print(f"{key}: warm-up step {record['warmup']['time_s']:.3f} s", flush=True)
                variants.append((key, variant))
            except torch.cuda.OutOfMemoryError as err:
                record["error"] = f"OutOfMemoryError: {str(err).splitlines()[0]}"
                print(f"{key}: {record['error']}", flush=True)
            save()
        for i in range(args.steps):
            for key, variant in variants:
                try:
                    rec = variant.step(batch, args.micro_batch)
                except torch.cuda.OutOfMemoryError as err:
                    report["results"][key]["error"] = f"OutOfMemoryError: {str(err).splitlines()[0]}"
                    continue
                report["results"][key]["timed"].append(rec)
                peak = f", peak above start {rec['peak_above_start_mib']:.0f} MiB" if "peak_total_mib" in rec else ""
                print(f"{key}: step {i + 1} {rec['time_s']:.3f} s{peak}, pg_loss {rec['pg_loss']:.4f}", flush=True)
                save()
        for _, variant in variants:
            variant.release()
        variants.clear()
    save()
    text = table(report)
    print("\n" + text)
    if args.table:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text(text + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
