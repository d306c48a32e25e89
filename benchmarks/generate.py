"""Tokens per second of the `hf` rollout engine, with its own sampling loop and through
`transformers.generate`, against a plain KV-cached sampling loop.

Both sample the same batch (prompts x n rows, left-padded) from the same model
at temperature 1 and return what the engine's contract asks for: every token's
log-prob under the distribution it was drawn from. The plain loop is the least
a sampler has to do: one prefill forward, then one single-token forward per new
token on the KV cache, a log-softmax, a multinomial draw and a gather; it stops
when every row has produced an end-of-sequence token. The engine samples
Qwen2 and Llama models with a loop of its own (`rltk/rollout/hf_sampling.py`:
the last prompt token once per distinct prompt, finished rows out of the
forward, generate's tokens bit for bit); "engine via generate" is the same
engine made to call `transformers.generate`, as it does for other models.

Calls rotate the three sides (engine, via generate, loop; via generate, loop,
engine; ...) so that a machine whose load changes affects all alike; the table
gives the median of each and the ratios.

    python benchmarks/generate.py                                  # the default tiny model and the 0.6M one
    python benchmarks/generate.py --calls 40 --n 8 --prompts 4 --max-new-tokens 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

import rltk.rollout.hf as hf_engine

RESULTS = Path(__file__).resolve().parent / "results"
#: model name -> rltk `model.tiny` settings: the shipped default and the 0.6M model of issue #13
MODELS = {
    "tiny default (hidden 64, 2 layers)": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                               intermediate_size=256),
    "0.6M (hidden 128, 4 layers)": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                                        intermediate_size=512),
}


@torch.no_grad()
def plain_sampling_loop(model, prompts: list[list[int]], n: int, max_new_tokens: int, eos_id: int, pad_id: int):
    """Sample ``n`` completions per prompt with a KV cache; ``(tokens [N, L], logprobs [N, L])`` as lists."""
    from transformers import DynamicCache

    rows = [p for p in prompts for _ in range(n)]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, p in enumerate(rows):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                   use_cache=True).logits[:, -1]
    done = torch.zeros(len(rows), dtype=torch.bool)
    tokens, logprobs = [], []
    for _ in range(max_new_tokens):
        logp = torch.log_softmax(logits.float(), dim=-1)
        token = torch.multinomial(logp.exp(), 1).squeeze(1)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        tokens.append(token)
        logprobs.append(logp.gather(1, token[:, None]).squeeze(1))
        done |= token == eos_id
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype)], dim=1)
        positions = positions[:, -1:] + 1
        logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                       past_key_values=cache, use_cache=True).logits[:, -1]
    return torch.stack(tokens, 1).tolist(), torch.stack(logprobs, 1).tolist()


def generated_tokens(tokens: list[list[int]], eos_id: int) -> int:
    """Tokens a completion keeps: up to and including its first end-of-sequence token."""
    return sum(row.index(eos_id) + 1 if eos_id in row else len(row) for row in tokens)


def measure(name: str, tiny: dict, args) -> dict:
    """Alternated calls of the engine and the plain loop on one model; tokens/s of each."""
    import rltk
    from rltk.data.synthetic import make_task
    from rltk.models.tiny import build_char_tokenizer, build_tiny_model
    from rltk.rollout.base import SamplingParams

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, **tiny, seed=0)
    model.eval()
    rows = make_task("arithmetic", split="train", size=args.prompts * args.calls, seed=0,
                     min_digits=1, max_digits=2, operators="+")
    engine = rltk.get_component("rollout_engine", "hf")(model=model, tokenizer=tokenizer)
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    sides = ["engine", "engine via generate", "plain loop"]
    samples: dict[str, list[float]] = {side: [] for side in sides}
    tokens: dict[str, int] = {side: 0 for side in sides}
    for call in range(args.calls + args.warmup):
        batch = rows[(call % args.calls) * args.prompts:][: args.prompts]
        prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in batch]
        for side in sides[call % 3:] + sides[: call % 3]:
            torch.manual_seed(call)
            tick = time.perf_counter()
            if side == "engine":
                groups = engine.generate(prompts, params)
                count = sum(len(c.token_ids) for g in groups for c in g)
            elif side == "engine via generate":
                with mock.patch.object(hf_engine, "sampling_blocker", lambda model: "switched off by the benchmark"):
                    groups = engine.generate(prompts, params)
                count = sum(len(c.token_ids) for g in groups for c in g)
            else:
                out, _ = plain_sampling_loop(model, prompts, args.n, args.max_new_tokens, eos, pad)
                count = generated_tokens(out, eos)
            elapsed = time.perf_counter() - tick
            if call >= args.warmup:
                samples[side].append(elapsed)
                tokens[side] += count
    result = {}
    for side, times in samples.items():
        per_call = tokens[side] / len(times)
        result[side] = {"median_call_s": statistics.median(times), "tokens_per_call": per_call,
                        "tokens_per_s": per_call / statistics.median(times)}
    result["ratio_engine_over_loop"] = result["engine"]["tokens_per_s"] / result["plain loop"]["tokens_per_s"]
    result["ratio_engine_over_generate"] = (result["engine"]["tokens_per_s"]
                                            / result["engine via generate"]["tokens_per_s"])
    print(f"| {name} | {result['engine']['tokens_per_s']:.0f} | {result['engine via generate']['tokens_per_s']:.0f} | "
          f"{result['plain loop']['tokens_per_s']:.0f} | {result['ratio_engine_over_generate']:.2f} | "
          f"{result['ratio_engine_over_loop']:.2f} | "
          + " | ".join(f"{result[side]['median_call_s'] * 1e3:.1f}" for side in sides) + " |", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--calls", type=int, default=100, help="timed calls of each, alternated")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=RESULTS / "generate.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{args.prompts} prompts x {args.n} samples, at most {args.max_new_tokens} new tokens, "
          f"{args.calls} alternated calls each")
    print("| model | engine tokens/s | via generate tokens/s | plain loop tokens/s | engine / via generate | "
          "engine / loop | engine ms/call | via generate ms/call | loop ms/call |")
    print("|---|---|---|---|---|---|---|---|---|")
    results = {name: measure(name, tiny, args) for name, tiny in MODELS.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)}, "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
