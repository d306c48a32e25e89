"""Benchmark: the `hf` engine's shared-prompt prefill on a LoRA policy, against every row prefilling its prompt.

A GRPO step samples ``n`` completions of each prompt: ``n`` identical rows. The engine runs the
prompt (but its last token) once per distinct prompt and indexes the cache out to the rows
(``_shared_prompt_cache`` in ``rltk/rollout/hf.py``); a LoRA policy, a ``peft.PeftModel``, samples
through ``transformers.generate``, and got no shared prefill before issue 54 (item 10). Sides, on the
same seeded batch, calls alternated so load changes hit both alike:

* ``shared``: the engine as it runs a LoRA policy;
* ``per row``: the same engine with the shared prefill switched off (every row its whole prompt).

Each side's completions are checked to be the same tokens. Prompts are random tokens of
``--prompt-lengths`` (the shared part grows with them: 6 tokens is about the default task's prompt);
the model is the tiny default or the 0.6M one with LoRA r=8 on every linear layer. The table gives the
median ms per ``generate`` call of each side and their ratio; JSON under ``benchmarks/results/``.

    python benchmarks/lora_prefill.py                              # 4 prompts x 8, 6 new tokens, 30 calls
    python benchmarks/lora_prefill.py --prompt-lengths 22 54 --calls 60
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
MODELS = {  # rltk `model.tiny` settings: the shipped default and the 0.6M model of issue #13
    "tiny default": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256),
    "0.6M": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512),
}
SIDES = ("shared", "per row")


def lora_policy(tiny: dict):
    """A tiny model with LoRA r=8 on every linear layer, its B matrices nonzero (the adapters change outputs)."""
    from rltk.models.lora import apply_lora
    from rltk.models.tiny import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer()
    policy = apply_lora(build_tiny_model(tokenizer, **tiny, seed=0),
                        {"r": 8, "alpha": 16, "target_modules": "all-linear"})
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for name, weight in policy.named_parameters():
            if "lora_B" in name:
                weight.normal_(0.0, 0.02)
    return policy, tokenizer


def measure(tiny: dict, prompt_length: int, args) -> dict:
    """Median seconds per generate call of each side, alternated, on one model and prompt length."""
    from rltk.rollout.base import SamplingParams
    from rltk.rollout.hf import HFRolloutEngine

    policy, tokenizer = lora_policy(tiny)
    engine = HFRolloutEngine(policy, tokenizer)
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, stop_token_ids=[],
                            seed=0)
    generator = torch.Generator().manual_seed(prompt_length)
    low = max(tokenizer.all_special_ids) + 1
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for call in range(args.calls + args.warmup):
        prompts = torch.randint(low, len(tokenizer), (args.prompts, prompt_length), generator=generator).tolist()
        tokens = {}
        for side in SIDES[call % 2:] + SIDES[: call % 2]:
            switched_off = mock.patch.object(hf_engine, "_shared_prompt_cache", lambda *a: {})
            tick = time.perf_counter()
            if side == "shared":
                groups = engine.generate(prompts, params)
            else:
                with switched_off:
                    groups = engine.generate(prompts, params)
            elapsed = time.perf_counter() - tick
            tokens[side] = [[c.token_ids for c in g] for g in groups]
            if call >= args.warmup:
                times[side].append(elapsed)
        if tokens["shared"] != tokens["per row"]:
            raise SystemExit(f"call {call}: the shared prefill sampled other tokens than the per-row one")
    medians = {side: statistics.median(t) for side, t in times.items()}
    return {"median_call_s": medians, "shared_over_per_row": medians["shared"] / medians["per row"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[6, 22, 54])
    parser.add_argument("--calls", type=int, default=30, help="timed calls of each side, alternated")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=RESULTS / "lora_prefill.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"LoRA r=8 policy, {args.prompts} prompts x {args.n} samples, {args.max_new_tokens} new tokens, "
          f"{args.calls} alternated calls each")
    print("| model | prompt tokens | shared ms/call | per row ms/call | shared / per row |")
    print("|---|---|---|---|---|")
    results = {}
    for name, tiny in MODELS.items():
        for length in args.prompt_lengths:
            result = measure(tiny, length, args)
            results[f"{name}, {length} prompt tokens"] = result
            ms = {side: 1e3 * s for side, s in result["median_call_s"].items()}
            print(f"| {name} | {length} | {ms['shared']:.1f} | {ms['per row']:.1f} | "
                  f"{result['shared_over_per_row']:.2f} |", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)}, "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
