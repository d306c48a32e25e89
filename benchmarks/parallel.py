"""Benchmark: what model parallelism saves per rank.

    python benchmarks/parallel.py tp-memory            # Qwen2 hidden 256, 4 layers, vocab 8192, tied and untied head

``tp-memory`` (:func:`tensor_parallel_state_memory`): parameter + gradient + AdamW-state bytes held by one rank
after one optimizer step, at ``strategy_args.tensor_parallel_size=1`` (one process) and ``=2`` (two gloo
processes under ``torchrun``), counted from the tensors each rank holds (a DTensor's local shard), so the ratio
is exact and does not move with the machine's load. Replicated tensors (norms; an untied input embedding) are
what keeps it above 0.5. Results are printed and written as JSON under ``benchmarks/results/``.
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


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--tp-worker":
        _tp_worker(int(sys.argv[2]), sys.argv[3] == "1", Path(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("measurement", choices=["tp-memory"])
    args = parser.parse_args()
    rows = tensor_parallel_state_memory()
    RESULTS_DIR.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    (RESULTS_DIR / f"parallel_{args.measurement}_{stamp}.json").write_text(
        json.dumps({"measurement": args.measurement, "model": TP_MODEL, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
