"""Two-process worker for test_distributed.py, and the training loop it shares with the single-process reference.

Run as ``python -m torch.distributed.run --standalone --nproc_per_node 2
distributed_worker.py OUT_DIR [PHASE...]``. For each phase (default: ``ddp`` and
``fsdp``; also ``ddp_lora``, DDP training a LoRA adapter on the same tiny model)
it trains a tiny Qwen2 for a few steps on fixed global batches (each rank takes
its half, two micro-batches each, losses normalised by the global token count),
saves a checkpoint part-way, resumes it into fresh objects, and writes per-rank
results to ``OUT_DIR/<phase>_rank<r>.pt`` for the test to compare.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

GLOBAL_BATCH = 8
SEQ_LEN = 10
VOCAB = 50
TOTAL_STEPS = 5
CHECKPOINT_STEP = 3
SETUP = dict(lr=1e-3, total_steps=TOTAL_STEPS, weight_decay=0.01, warmup_steps=1, lr_schedule="cosine",
             min_lr_ratio=0.1, grad_clip=1.0)


def tiny_qwen2(seed: int) -> torch.nn.Module:
    """A 1-layer Qwen2 (hidden 32) with weights drawn from ``seed``."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB)
    return transformers.Qwen2ForCausalLM(config)


# model.lora of the LoRA phases: rank 4 on every linear layer but the head, no dropout
LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}


def tiny_lora_qwen2(seed: int, adapter_seed: int | None = None) -> torch.nn.Module:
    """:func:`tiny_qwen2` (weights from ``seed``) with a fresh LoRA adapter (``LORA``) drawn from
    ``adapter_seed`` (default ``seed``): B starts at zero, as peft initialises it."""
    from rltk.models.lora import apply_lora

    model = tiny_qwen2(seed)
    torch.manual_seed(seed if adapter_seed is None else adapter_seed)
    return apply_lora(model, LORA)


def global_batches() -> list[dict[str, torch.Tensor]]:
    """``TOTAL_STEPS`` fixed batches of right-padded token rows with different lengths."""
    generator = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(TOTAL_STEPS):
        input_ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=generator)
        lengths = torch.randint(3, SEQ_LEN + 1, (GLOBAL_BATCH,), generator=generator)
        attention_mask = (torch.arange(SEQ_LEN)[None, :] < lengths[:, None]).long()
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask})
    return batches


def train_steps(strategy, batches, *, micro_batches: int) -> tuple[list[float], list[float]]:
    """One optimizer step per batch; returns each step's global mean token loss and gradient norm.

    Rank ``r`` of ``W`` takes rows ``[r*B/W, (r+1)*B/W)``; the loss of every
    micro-batch is its token-loss sum divided by the token count of the whole
    global batch, the normalisation :meth:`TrainingStrategy.backward` expects.
    """
    losses, grad_norms = [], []
    for batch in batches:
        rows = GLOBAL_BATCH // strategy.world_size
        local = {k: v[strategy.rank * rows:(strategy.rank + 1) * rows] for k, v in batch.items()}
        target_mask = local["attention_mask"][:, 1:].float()
        global_tokens = strategy.all_reduce_sum(target_mask.sum())
        per_micro = rows // micro_batches
        loss_sum = torch.zeros(())
        for i in range(micro_batches):
            part = slice(i * per_micro, (i + 1) * per_micro)
            ids, mask = local["input_ids"][part], local["attention_mask"][part]
            with strategy.accumulate(i == micro_batches - 1):  # backward inside: DDP's no_sync must cover it
                with strategy.autocast():
                    logits = strategy.model(input_ids=ids, attention_mask=mask).logits
                token_loss = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), ids[:, 1:], reduction="none")
                loss = (token_loss * target_mask[part]).sum() / global_tokens
                strategy.backward(loss)
            loss_sum += loss.detach()
        grad_norms.append(strategy.step()["grad_norm"])
        losses.append(float(strategy.all_reduce_sum(loss_sum)))
    return losses, grad_norms


PHASES = {"ddp": dict(fsdp=False, lora=False), "fsdp": dict(fsdp=True, lora=False),
          "ddp_lora": dict(fsdp=False, lora=True)}


def main(out_dir: Path, phases: list[str]) -> None:
    from rltk.checkpoint import CheckpointManager
    from rltk.strategies.accelerate_strategy import AccelerateStrategy

    unknown = [phase for phase in phases if phase not in PHASES]
    if unknown:
        raise SystemExit(f"distributed_worker.py: unknown phase(s) {unknown}; valid: {', '.join(PHASES)}")
    batches = global_batches()
    for phase in phases:
        fsdp, lora = PHASES[phase]["fsdp"], PHASES[phase]["lora"]
        strategy = AccelerateStrategy(cpu=True, fsdp=fsdp)
        assert strategy.world_size == 2, f"expected 2 processes, got {strategy.world_size}"
        strategy.setup(tiny_lora_qwen2(seed=0) if lora else tiny_qwen2(seed=0), **SETUP)
        assert strategy.sharded == fsdp
        # every engine steps with the same AdamW implementation (they agree only up to rounding)
        fused = all(group["fused"] for group in strategy.optimizer.param_groups)
        losses, grad_norms = train_steps(strategy, batches[:CHECKPOINT_STEP], micro_batches=2)
        manager = CheckpointManager(out_dir / f"ckpt_{phase}", keep_last=1)
        manager.save(CHECKPOINT_STEP, strategy, {"step": CHECKPOINT_STEP})
        more_losses, more_grad_norms = train_steps(strategy, batches[CHECKPOINT_STEP:], micro_batches=2)
        torch.save({"weights": strategy.full_state_dict(), "losses": losses + more_losses,
                    "grad_norms": grad_norms + more_grad_norms, "fused": fused}, out_dir / f"{phase}_rank{strategy.rank}.pt")

        resumed = AccelerateStrategy(cpu=True, fsdp=fsdp)
        # other initial weights: load must replace them all (under LoRA the checkpoint holds the adapter
        # only, and the frozen base is rebuilt as the run built it: the same seed, another adapter)
        resumed.setup(tiny_lora_qwen2(seed=0, adapter_seed=1) if lora else tiny_qwen2(seed=1), **SETUP)
        state = manager.load(manager.latest(), resumed)
        assert state == {"step": CHECKPOINT_STEP}, state
        resumed_losses, resumed_grad_norms = train_steps(resumed, batches[CHECKPOINT_STEP:], micro_batches=2)
        torch.save({"weights": resumed.full_state_dict(), "losses": resumed_losses, "grad_norms": resumed_grad_norms},
                   out_dir / f"{phase}_resumed_rank{resumed.rank}.pt")
        if lora:
            continue

        # Plain modules from the trained strategy: a copy (rollout engine, reference), then the
        # release that ends a stage; the next stage's strategy must accept the released module.
        copy = strategy.full_model_copy()
        released = strategy.release_model()
        released_class = type(released).__name__  # before the follower shards it in place
        follower = AccelerateStrategy(cpu=True, fsdp=fsdp)
        follower.setup(released, **SETUP)
        torch.save({"copy": {k: v.detach().clone() for k, v in copy.state_dict().items()},
                    "copy_class": type(copy).__name__, "released_class": released_class,
                    "follower": follower.full_state_dict()},
                   out_dir / f"{phase}_plain_rank{strategy.rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or ["ddp", "fsdp"])
