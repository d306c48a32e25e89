"""Worker for test_sequence_parallel.py: one forward and backward of a policy-gradient loss with Ulysses
sequence parallelism, and the same on one process, through the strategy seam.

Run as ``python -m torch.distributed.run --standalone --nproc_per_node N sequence_parallel_worker.py OUT SP
[fsdp] [lora]``: each rank builds the same tiny Qwen2 (:func:`tiny_qwen2`), takes its data rank's rows of
:func:`global_batch`, runs ``strategy.forward_backward`` over two micro-batches of :func:`micro_loss`, and
writes its rows' log-probs and entropy and every parameter's full gradient to ``OUT/rank<r>.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

GLOBAL_BATCH = 4
PROMPT, RESPONSE = 5, 8
VOCAB = 50
SETUP = dict(lr=1e-3, total_steps=2, grad_clip=None)


def tiny_qwen2(seed: int = 0) -> torch.nn.Module:
    """A 2-layer Qwen2 (hidden 32, 4 heads over 2 key/value heads) with weights drawn from ``seed``."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB)
    return transformers.Qwen2ForCausalLM(config)


def tiny_lora_qwen2(seed: int = 0) -> torch.nn.Module:
    """:func:`tiny_qwen2` with a rank-4 LoRA adapter on every linear layer, B drawn non-zero (so every
    adapter weight has a gradient)."""
    from rltk.models.lora import apply_lora

    model = apply_lora(tiny_qwen2(seed), {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"})
    torch.manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return model


def global_batch(left_padding: bool = True) -> dict[str, torch.Tensor]:
    """Left-padded prompts (or, without ``left_padding``, whole ones: the split attention then runs on
    causality alone, no mask) and right-padded responses of different lengths, and advantages."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (GLOBAL_BATCH, PROMPT + RESPONSE), generator=generator)
    mask = torch.ones_like(ids)
    for row, (pad_left, pad_right) in enumerate([(0, 0), (2, 3), (1, 0), (3, 5)]):
        mask[row, :pad_left if left_padding else 0] = 0
        mask[row, PROMPT + RESPONSE - pad_right:] = 0
    ids = ids * mask
    advantages = torch.randn(GLOBAL_BATCH, RESPONSE, generator=generator)
    return {"input_ids": ids, "attention_mask": mask, "response_mask": mask[:, PROMPT:].float(),
            "advantages": advantages}


def micro_loss(strategy, global_tokens: float, outputs: dict):
    """``-sum(A * logp) / N + 0.01 * sum(entropy) / N`` over response tokens, recording the outputs."""

    def loss(data, micro):
        logprobs, entropy = strategy.logprobs(strategy.model, data["input_ids"], data["attention_mask"], RESPONSE,
                                              with_entropy=True)
        mask = data["response_mask"]
        value = (-(data["advantages"] * logprobs * mask).sum() + 0.01 * (entropy * mask).sum()) / global_tokens
        outputs.setdefault("logprobs", []).append(logprobs.detach())
        outputs.setdefault("entropy", []).append(entropy.detach())
        return value, lambda: {"loss": value.item()}

    return loss


def run(strategy, rows: torch.Tensor, left_padding: bool = True) -> dict[str, torch.Tensor]:
    """One forward/backward over ``rows`` of :func:`global_batch` in two micro-batches; outputs and gradients."""
    batch = global_batch(left_padding)
    global_tokens = float(batch["response_mask"].sum())
    part = {k: v[rows] for k, v in batch.items()}
    halves = rows.numel() // 2 or 1
    micro = []
    for i, index in enumerate(torch.arange(rows.numel()).split(halves)):
        micro.append(type("Micro", (), {"data": {k: v[index] for k, v in part.items()},
                                         "is_last": i == len(torch.arange(rows.numel()).split(halves)) - 1,
                                         "padding": False})())
    outputs: dict = {}
    totals = strategy.forward_backward(micro, micro_loss(strategy, global_tokens, outputs))
    grads = {}
    for name, param in strategy.unwrap().named_parameters():
        if not param.requires_grad:  # a LoRA model's base weights
            continue
        grad = param.grad
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        grads[name] = grad.detach().clone()
    return {"rows": rows, "logprobs": torch.cat(outputs["logprobs"]), "entropy": torch.cat(outputs["entropy"]),
            "grads": grads, "loss": torch.tensor(totals["loss"])}


def main() -> None:
    from rltk.strategies.accelerate_strategy import AccelerateStrategy

    out, sp = Path(sys.argv[1]), int(sys.argv[2])
    strategy = AccelerateStrategy(cpu=True, sequence_parallel_size=sp, fsdp="fsdp" in sys.argv[3:])
    strategy.setup(tiny_lora_qwen2() if "lora" in sys.argv[3:] else tiny_qwen2(), **SETUP)
    rows = torch.arange(GLOBAL_BATCH)[strategy.data_rank::strategy.data_world_size]
    result = run(strategy, rows, left_padding="causal" not in sys.argv[3:])
    torch.save(result, out / f"rank{strategy.rank}.pt")


if __name__ == "__main__":
    main()
