"""Two-process worker for test_expert_parallel.py: the tiny MoE with its experts split over both ranks.

Run as ``python -m torch.distributed.run --standalone --nproc_per_node 2 expert_parallel_worker.py OUT_DIR``
(or ``--nproc_per_node 4 ... OUT_DIR grads``: two expert groups of two ranks, the gradient phases only).
Each rank takes half of fixed global batches (its own rows: expert parallelism does not split rows), and writes
to ``OUT_DIR/rank<r>.pt``:

* ``logprobs`` / ``grads`` (and ``*_replay``, with recorded routing replayed; ``*_one_sided``, every token
  replayed to rank 0's experts; ``*_qwen2_moe``, a Qwen2-MoE with a shared expert): its rows' per-token log-probs and every parameter's gradient after the
  strategy's reduction, expert slices gathered back to whole;
* ``trained``: whole weights after ``STEPS`` optimizer steps, ``resumed``: the same after saving at step
  ``CHECKPOINT_STEP`` and resuming into a fresh model and strategy, and the checkpoint directory.

The test runs :func:`forward_backward` and :func:`train` in one process on the whole batch and compares.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROWS, PROMPT, RESPONSE = 8, 3, 5
STEPS, CHECKPOINT_STEP = 3, 2
SETUP = dict(lr=3e-3, total_steps=STEPS, weight_decay=0.01, warmup_steps=1, grad_clip=0.5)


def tiny_moe(seed: int = 0) -> torch.nn.Module:
    """The tiny MoE default (rltk.models.tiny) at 4 experts, top-2, hidden 32: small enough for a test."""
    from rltk.models.tiny import build_char_tokenizer, build_tiny_moe_model

    return build_tiny_moe_model(build_char_tokenizer(), num_experts=4, top_k=2, expert_size=16, seed=seed,
                                hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)


def tiny_qwen2_moe(seed: int = 0) -> torch.nn.Module:
    """A Qwen2-MoE (a shared expert beside 4 routed ones, top-2): the shared expert stays replicated."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2MoeConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        intermediate_size=16, decoder_sparse_step=1, norm_topk_prob=False)
    return transformers.Qwen2MoeForCausalLM(config)


def global_batch(vocab: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts, right-padded responses, and recorded routing (``-1`` on some tokens)."""
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(3, vocab, (ROWS, PROMPT + RESPONSE), generator=generator)
    lengths = torch.randint(2, RESPONSE + 1, (ROWS,), generator=generator)
    mask = torch.ones(ROWS, PROMPT + RESPONSE, dtype=torch.long)
    mask[:, PROMPT:] = (torch.arange(RESPONSE)[None, :] < lengths[:, None]).long()
    mask[0, 0] = 0
    # [B, S, L=2, k=2]: two different experts of 4 per token, as an engine would have recorded them
    first = torch.randint(0, 4, (ROWS, PROMPT + RESPONSE, 2), generator=generator)
    second = (first + torch.randint(1, 4, first.shape, generator=generator)) % 4
    routed = torch.stack([first, second], dim=-1)
    routed[1, -2:] = -1  # not recorded: those tokens keep the trainer's own routing
    return {"input_ids": input_ids, "attention_mask": mask, "routed_experts": routed}


def one_sided(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` with every token replayed to experts 0 and 1: rank 1's experts receive no token at all."""
    routed = torch.empty_like(batch["routed_experts"])
    routed[..., 0], routed[..., 1] = 0, 1
    return {**batch, "routed_experts": routed}


def forward_backward(strategy, batch: dict[str, torch.Tensor], replay: bool):
    """Per-token log-probs of the rows, and the backward of their sum over the *global* token count."""
    from rltk.models.logprobs import response_logprobs

    tokens = batch["global_tokens"]
    routed = batch["routed_experts"] if replay else None
    logprobs = response_logprobs(strategy.model, batch["input_ids"], batch["attention_mask"], RESPONSE,
                                 routed_experts=routed, impl="torch")[0]
    response_mask = batch["attention_mask"][:, PROMPT:].float()
    strategy.backward(-(logprobs * response_mask).sum() / tokens)
    return logprobs.detach() * response_mask


def train(strategy, batch, steps: int) -> None:
    for _ in range(steps):
        forward_backward(strategy, batch, replay=True)
        strategy.step()


def rows_of(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    out = {k: v[rank::world] for k, v in batch.items()}
    out["global_tokens"] = batch["attention_mask"][:, PROMPT:].sum()
    return out


def reduced_gradients(strategy) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as one process has it: the strategy's reduction (what its ``step`` runs
    before the update), expert slices gathered whole."""
    from rltk.models.folders import full_cpu_copy

    params = list(strategy.model.parameters())
    if strategy._experts is not None:
        strategy._experts.reduce_and_clip(params, float("inf"))
    return {name: full_cpu_copy(p.grad, of=p) for name, p in strategy.unwrap().named_parameters()}


def main(out_dir: Path, phases: str) -> None:
    """``phases``: ``all``, or ``grads`` (the gradients and a short training run only: the 4-process run)."""
    from rltk.strategies.accelerate_strategy import AccelerateStrategy

    results = {}
    for suffix in ("", "_replay", "_one_sided") if phases == "all" else ("", "_replay"):
        strategy = AccelerateStrategy(cpu=True, expert_parallel_size=2)
        strategy.setup(tiny_moe(), **SETUP)
        rows = rows_of(global_batch(strategy.unwrap().config.vocab_size), strategy.rank, strategy.world_size)
        replay = bool(suffix)
        if suffix == "_one_sided":
            rows = one_sided(rows)
        results["logprobs" + suffix] = forward_backward(strategy, rows, replay)
        results["grads" + suffix] = reduced_gradients(strategy)
        results["rows"] = torch.arange(ROWS)[strategy.rank::strategy.world_size]
    if phases == "all":
        strategy = AccelerateStrategy(cpu=True, expert_parallel_size=2)
        strategy.setup(tiny_qwen2_moe(), **SETUP)
        results["logprobs_qwen2_moe"] = forward_backward(strategy, rows_of(global_batch(50), strategy.rank, 2), False)
        results["grads_qwen2_moe"] = reduced_gradients(strategy)
    strategy = AccelerateStrategy(cpu=True, expert_parallel_size=2)
    strategy.setup(tiny_moe(), **SETUP)
    rows = rows_of(global_batch(strategy.unwrap().config.vocab_size), strategy.rank, strategy.world_size)
    train(strategy, rows, CHECKPOINT_STEP)
    if phases == "all":
        strategy.save(out_dir / "checkpoint")
    train(strategy, rows, STEPS - CHECKPOINT_STEP)
    results["trained"] = strategy.full_state_dict()
    if phases == "all":
        copy = strategy.full_model_copy()
        results["reference_copy"] = copy.state_dict()
        results["copy_ddp_ignores"] = list(getattr(copy, "_ddp_params_and_buffers_to_ignore", []))
        resumed = AccelerateStrategy(cpu=True, expert_parallel_size=2)
        resumed.setup(tiny_moe(seed=1), **SETUP)
        resumed.load(out_dir / "checkpoint")
        train(resumed, rows, STEPS - CHECKPOINT_STEP)
        results["resumed"] = resumed.full_state_dict()
    results["local_expert_shape"] = tuple(strategy.unwrap().model.layers[0].mlp.experts.gate_up_proj.shape)
    torch.save(results, out_dir / f"rank{strategy.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "all")
