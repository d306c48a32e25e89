"""Worker of test_tensor_parallel.py: ``torchrun --nproc_per_node W tensor_parallel_worker.py OUT_DIR FSDP``.

Every rank sets up the accelerate strategy with ``tensor_parallel_size=2`` (and FSDP2 over the data-parallel
ranks when ``FSDP`` is ``1``: 4 processes make a 2 x 2 mesh), takes its data share of a fixed global batch,
computes response log-probs and entropy through the vocabulary-parallel head, backpropagates a loss normalised
by the global token count, gathers every parameter's gradient to full, takes one optimizer step and writes
``OUT_DIR/rank<r>.pt``; the test compares them with one process on the whole batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

VOCAB, BATCH, SEQ, RESPONSE = 50, 4, 9, 4
TEMPERATURE = 0.8
ENTROPY_COEF = 0.1
# Adam's first step is lr * g / (|g| + eps): with the default eps a gradient of ~1e-8 turns rounding noise into a
# full-size step; eps = 1e-2 keeps the update a smooth function of the gradient, so equal gradients mean equal weights
SETUP = dict(lr=1e-2, total_steps=2, weight_decay=0.0, eps=1e-2, warmup_steps=0, lr_schedule="constant",
             grad_clip=1.0)


def tiny_qwen2(tie: bool) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
                                      initializer_range=0.2, tie_word_embeddings=tie)
    return transformers.Qwen2ForCausalLM(config)


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded to ``SEQ - RESPONSE``, responses right-padded to ``RESPONSE``. Shape: (B, S) each."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[1, -1] = 0
    mask[3, :1] = 0
    mask[3, -2:] = 0
    return ids, mask


def loss_of(logprobs: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, global_tokens) -> torch.Tensor:
    """This share's part of a token-mean objective over the global batch (log-prob and entropy terms)."""
    response = mask[:, -RESPONSE:].float()
    return ((logprobs + ENTROPY_COEF * entropy) * response).sum() / global_tokens


def main(out_dir: Path, fsdp: bool, tie: bool) -> None:
    from rltk.models.folders import full_cpu_copy
    from rltk.models.parallel.tensor_parallel import tensor_parallel_response_logprobs
    from rltk.strategies.accelerate_strategy import AccelerateStrategy

    strategy = AccelerateStrategy(cpu=True, fsdp=fsdp, tensor_parallel_size=2)
    layout = strategy.layout
    strategy.setup(tiny_qwen2(tie), **SETUP)
    ids, mask = global_batch()
    rows = BATCH // layout.data_world_size
    share = slice(layout.data_rank(strategy.rank) * rows, (layout.data_rank(strategy.rank) + 1) * rows)
    global_tokens = mask[:, -RESPONSE:].sum()
    logprobs, entropy = tensor_parallel_response_logprobs(
        strategy.model, ids[share], mask[share], RESPONSE, temperature=TEMPERATURE, impl="torch",
        chunk_size=(3, 8), with_entropy=True)
    strategy.backward(loss_of(logprobs, entropy, mask[share], global_tokens))
    grads = {name: full_cpu_copy(p.grad) for name, p in strategy.unwrap().named_parameters()}
    grad_norm = strategy.step()["grad_norm"]
    copy = strategy.full_model_copy()  # a plain module (a rollout engine's, a reference's), rebuilt whole
    torch.save({"copy": {name: tensor.detach().clone() for name, tensor in copy.state_dict().items()},
                "copy_tied": copy.get_output_embeddings().weight is copy.get_input_embeddings().weight, "tied": tie,
                "rows": (share.start, share.stop), "logprobs": logprobs.detach(), "entropy": entropy.detach(),
                "grads": grads, "grad_norm": grad_norm, "weights": strategy.full_state_dict()},
               out_dir / f"rank{strategy.rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), fsdp=sys.argv[2] == "1", tie=sys.argv[3] == "1")
