"""Benchmark: what model parallelism saves per rank.

    python benchmarks/parallel.py tp-memory            # Qwen2 hidden 256, 4 layers, vocab 8192, tied and untied head
    python benchmarks/parallel.py sp-memory            # the same model, one 4096-token row, SP = 1, 2, 4

``tp-memory`` (:func:`tensor_parallel_state_memory`): parameter + gradient + AdamW-state bytes held by one rank
after one optimizer step, at ``strategy_args.tensor_parallel_size=1`` (one process) and ``=2`` (two gloo
processes under ``torchrun``), counted from the tensors each rank holds (a DTensor's local shard), so the ratio
is exact and does not move with the machine's load. Replicated tensors (norms; an untied input embedding) are
what keeps it above 0.5.

``sp-memory`` (:func:`sequence_parallel_activation_memory`): the bytes one rank keeps for the backward of one
log-prob pass (``strategy.logprobs`` with entropy, the training forward) over one row of 4096 tokens (64 prompt,
4032 response), at ``strategy_args.sequence_parallel_size`` 1, 2 and 4 (1, 2 and 4 gloo processes), counted by
``torch.autograd.graph.saved_tensors_hooks`` over the distinct storages saved, so it does not move with the
machine's load either; and the wall time of that forward and its backward (median of 3 after a warm-up), which
does (on a 2-core machine, SP=4 runs 4 processes on 2 cores). Results are printed and written as JSON under
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TP_MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                intermediate_size=1024, vocab_size=8192)


def _held_bytes(strategy) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state (local shards of DTensors)."""
    def local(tensor):
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    params = [local(p) for p in strategy.unwrap().parameters()]
    counted = {
        "parameters": sum(p.numel() * p.element_size() for p in params),
        "gradients": 0,  # after step() the gradients are freed: counted as the parameters they mirror
        "optimizer": sum(local(v).numel() * local(v).element_size() for state in strategy.optimizer.state.values()
                         for v in state.values() if hasattr(v, "numel") and local(v).dim() > 0),
    }
    counted["gradients"] = counted["parameters"]
    counted["total"] = sum(counted.values())
    return counted


def _tp_worker(tensor_parallel_size: int, tie: bool, out: Path) -> None:
    import torch
    import transformers

    from rltk.strategies.accelerate_strategy import AccelerateStrategy

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TP_MODEL, tie_word_embeddings=tie))
    strategy = AccelerateStrategy(cpu=True, tensor_parallel_size=tensor_parallel_size)
    strategy.setup(model, lr=1e-4, total_steps=1)
    ids = torch.randint(0, TP_MODEL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    strategy.backward(strategy.model(input_ids=ids).logits.float().logsumexp(-1).mean())
    strategy.step()
    if strategy.rank == 0:
        out.write_text(json.dumps(_held_bytes(strategy)))


def tensor_parallel_state_memory() -> list[dict]:
    """Per-rank state bytes at TP=1 and TP=2, tied and untied head; the TP=2 / TP=1 ratio (target <= 0.55)."""
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLTK_DISABLE_PLUGIN_AUTOLOAD": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for tie in (True, False):
        held = {}
        for size in (1, 2):
            with tempfile.TemporaryDirectory() as folder:
                out = Path(folder) / "held.json"
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(size), __file__, "--tp-worker", str(size), "1" if tie else "0", str(out)]
                subprocess.run(command, env=env, check=True, capture_output=True, text=True, timeout=600)
                held[size] = json.loads(out.read_text())
        rows.append({"head": "tied" if tie else "untied", "tp1_bytes": held[1]["total"], "tp2_bytes": held[2]["total"],
                     "ratio": held[2]["total"] / held[1]["total"], "tp2_parts": held[2]})
    print(f"{'head':8} {'TP=1 MiB':>10} {'TP=2 MiB/rank':>14} {'ratio':>7}")
    for row in rows:
        print(f"{row['head']:8} {row['tp1_bytes'] / 2**20:10.2f} {row['tp2_bytes'] / 2**20:14.2f} {row['ratio']:7.3f}")
    return rows


SP_PROMPT, SP_RESPONSE = 64, 4032


def _sp_worker(sequence_parallel_size: int, out: Path) -> None:
    import statistics
    import time

    import torch
    import transformers

    from rltk.strategies.accelerate_strategy import AccelerateStrategy

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TP_MODEL, attn_implementation="sdpa"))
    strategy = AccelerateStrategy(cpu=True, sequence_parallel_size=sequence_parallel_size)
    strategy.setup(model, lr=1e-4, total_steps=1)
    ids = torch.randint(0, TP_MODEL["vocab_size"], (1, SP_PROMPT + SP_RESPONSE),
                        generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    saved: dict[int, int] = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    def step(count: bool) -> float:
        start = time.perf_counter()
        if count:
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
                logprobs, entropy = strategy.logprobs(strategy.model, ids, mask, SP_RESPONSE, with_entropy=True)
        else:
            logprobs, entropy = strategy.logprobs(strategy.model, ids, mask, SP_RESPONSE, with_entropy=True)
        strategy.backward((logprobs.sum() + entropy.sum()) / SP_RESPONSE)
        strategy.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step(count=True)  # the warm-up counts the saved bytes
    seconds = statistics.median(step(count=False) for _ in range(3))
    if strategy.rank == 0:
        out.write_text(json.dumps({"saved_bytes": sum(saved.values()), "forward_backward_s": seconds}))


def sequence_parallel_activation_memory() -> list[dict]:
    """Saved-for-backward bytes per rank and forward+backward time at SP = 1, 2, 4; ratio to SP=1 (targets:
    <= 0.6 at SP=2, <= 0.35 at SP=4)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLTK_DISABLE_PLUGIN_AUTOLOAD": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    rows = []
    for size in (1, 2, 4):
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "saved.json"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(size),
                       __file__, "--sp-worker", str(size), str(out)]
            subprocess.run(command, env=env, check=True, capture_output=True, text=True, timeout=1200)
            rows.append({"sequence_parallel_size": size, **json.loads(out.read_text())})
    for row in rows:
        row["ratio"] = row["saved_bytes"] / rows[0]["saved_bytes"]
    print(f"{'SP':>3} {'saved MiB/rank':>15} {'ratio':>7} {'fwd+bwd s':>10}")
    for row in rows:
        print(f"{row['sequence_parallel_size']:3d} {row['saved_bytes'] / 2**20:15.1f} {row['ratio']:7.3f} "
              f"{row['forward_backward_s']:10.2f}")
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--tp-worker":
        _tp_worker(int(sys.argv[2]), sys.argv[3] == "1", Path(sys.argv[4]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--sp-worker":
        _sp_worker(int(sys.argv[2]), Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("measurement", choices=["tp-memory", "sp-memory"])
    args = parser.parse_args()
    rows = tensor_parallel_state_memory() if args.measurement == "tp-memory" else sequence_parallel_activation_memory()
    RESULTS_DIR.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    (RESULTS_DIR / f"parallel_{args.measurement}_{stamp}.json").write_text(
        json.dumps({"measurement": args.measurement, "model": TP_MODEL, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
