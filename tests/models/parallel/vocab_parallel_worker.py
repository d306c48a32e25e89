"""Worker of test_vocab_parallel.py: ``torchrun --nproc_per_node 2 vocab_parallel_worker.py OUT_DIR IMPL``.

Each rank takes its half of the head's rows of fixed inputs, runs the vocabulary-parallel op on cases with and
without bias, temperature and ignored labels, backpropagates fixed upstream gradients of both outputs, and
saves its outputs and gradients to ``OUT_DIR/<case>_rank<r>.pt``; the test compares them with the unsharded
computation. ``IMPL`` is ``torch`` or ``triton`` (the latter under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

IGNORE = -100
# (tokens, hidden, vocab, bias, temperature): vocab halves of 23 rows are no multiple of the 16-wide tiles
CASES = {"plain": (9, 20, 46, False, 1.0), "bias_temperature": (7, 12, 46, True, 0.7)}


def case_inputs(name: str):
    """``(hidden [N, D], weight [V, D], bias [V] or None, labels [N], grad_lp [N], grad_ent [N], temperature)``."""
    tokens, hidden_size, vocab, with_bias, temperature = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    hidden = torch.randn(tokens, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen) * hidden_size**-0.5 * 3.0
    bias = torch.randn(vocab, generator=gen) if with_bias else None
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[2] = IGNORE
    labels[0], labels[1] = 0, vocab - 1  # the first row of one shard, the last of the other
    return hidden, weight, bias, labels, torch.randn(tokens, generator=gen), torch.randn(tokens, generator=gen), \
        temperature


def hand_inputs():
    """One token, D = 1, h = 1, four vocabulary rows whose logits are (0, 0, ln 2, ln 4), label 3."""
    hidden = torch.ones(1, 1)
    weight = torch.tensor([[0.0], [0.0], [math.log(2.0)], [math.log(4.0)]])
    return hidden, weight, torch.tensor([3])


def run(impl: str, out_dir: Path) -> None:
    from rltk.models.parallel.vocab_parallel import vocab_parallel_logprobs_and_entropy

    rank, world = dist.get_rank(), dist.get_world_size()
    chunk = (16, 16) if impl == "triton" else (4, 8)  # several token and vocab tiles per shard
    for name in CASES:
        hidden, weight, bias, labels, grad_lp, grad_ent, temperature = case_inputs(name)
        rows = weight.shape[0] // world
        hidden = hidden.requires_grad_()
        weight_shard = weight[rank * rows:(rank + 1) * rows].clone().requires_grad_()
        bias_shard = None if bias is None else bias[rank * rows:(rank + 1) * rows].clone().requires_grad_()
        logprobs, entropy, sum_pi_squared = vocab_parallel_logprobs_and_entropy(
            hidden, weight_shard, labels, bias_shard=bias_shard, temperature=temperature, impl=impl,
            chunk_size=chunk, ignore_index=IGNORE, with_sum_pi_squared=True)
        ((logprobs * grad_lp).sum() + (entropy * grad_ent).sum()).backward()
        torch.save({"logprobs": logprobs.detach(), "entropy": entropy.detach(), "sum_pi_squared": sum_pi_squared,
                    "grad_hidden": hidden.grad, "grad_weight": weight_shard.grad,
                    "grad_bias": None if bias_shard is None else bias_shard.grad},
                   out_dir / f"{name}_rank{rank}.pt")
    hidden, weight, labels = hand_inputs()
    hidden = hidden.requires_grad_()
    weight_shard = weight[rank * 2:(rank + 1) * 2].clone().requires_grad_()
    logprobs, entropy = vocab_parallel_logprobs_and_entropy(hidden, weight_shard, labels, impl=impl,
                                                            chunk_size=chunk)
    logprobs.sum().backward()
    torch.save({"logprobs": logprobs.detach(), "entropy": entropy.detach(), "grad_hidden": hidden.grad,
                "grad_weight": weight_shard.grad}, out_dir / f"hand_rank{rank}.pt")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        run(sys.argv[2], Path(sys.argv[1]))
    finally:
        dist.destroy_process_group()
