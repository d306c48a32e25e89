"""DeepSpeed worker for test_deepspeed.py: runs phases in one launch and writes per-rank results.

``python -m torch.distributed.run --standalone --nproc_per_node 2 ds_worker.py OUT_DIR PHASE...``,
``deepspeed --num_gpus 2 ds_worker.py OUT_DIR PHASE...`` or, for one process without a launcher,
``python ds_worker.py OUT_DIR PHASE...``. Every run trains the tiny Qwen2 of
distributed_worker.py on its fixed global batches (each rank its share, two
micro-batches, losses normalised by the global token count). Phases:

* ``zero1`` / ``zero2`` / ``zero3`` / ``zero2_offload`` / ``zero3_offload`` (optimizer
  and parameters on CPU) / ``zero2_bf16``: train
  ``TOTAL_STEPS`` steps; write weights, losses and gradient norms (bf16: also
  the fp32 master weights). ``zero2`` checkpoints after ``CHECKPOINT_STEP``
  steps on the way (saving must not change the run), without the full
  weights (``save_full_weights=False``): only DeepSpeed's shards.
* ``zero3_tied``: a Qwen2 whose output layer shares the embedding: two
  steps, then a checkpoint; writes the full weights.
* ``zero2_nonfinite``: one normal step, then a step whose loss is NaN, then one
  more; writes the weights around the bad step and the step metrics.
* ``zero3_crash``: train ``CHECKPOINT_STEP`` steps, checkpoint, train one more
  step and die at once (``os._exit``: no close(), no destroy_process_group, no
  atexit), as a killed job would. Must be the last phase of its launch.
* ``zero2_resume`` / ``zero3_resume``: a model with other weights loads the
  latest checkpoint of ``zero2`` / ``zero3_crash`` (written by any number of
  processes) and trains the remaining steps.
* ``zero2_lora`` / ``zero3_lora``: train a LoRA adapter (``model.lora``) on the
  same tiny model (distributed_worker's ``tiny_lora_qwen2``) for
  ``TOTAL_STEPS`` steps; write weights, losses and gradient norms.
  ``zero3_lora_ckpt``: the same under ZeRO-3 with gradient checkpointing
  (``model.gradient_checkpointing``: the recompute must gather the partitioned
  layers again).

ZeRO-3 runs with ``stage3_param_persistence_threshold=0``: by default DeepSpeed
leaves tensors under 1e5 elements unpartitioned, which is every tensor of
this tiny model, and the test would not exercise partitioning at all.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import distributed_worker as shared  # noqa: E402  (the loop and data every strategy test shares)

ZERO3_CONFIG = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
PHASES = {
    "zero1": dict(zero_stage=1),
    "zero2": dict(zero_stage=2, save_full_weights=False),
    "zero3": dict(zero_stage=3, config=ZERO3_CONFIG),
    "zero3_tied": dict(zero_stage=3, config=ZERO3_CONFIG),
    "zero2_offload": dict(zero_stage=2, offload_optimizer=True),
    "zero3_offload": dict(zero_stage=3, offload_optimizer=True, offload_params=True, config=ZERO3_CONFIG),
    "zero2_bf16": dict(zero_stage=2, mixed_precision="bf16"),
    "zero2_nonfinite": dict(zero_stage=2),
    "zero3_crash": dict(zero_stage=3, config=ZERO3_CONFIG),
    "zero2_resume": dict(zero_stage=2, save_full_weights=False),
    "zero3_resume": dict(zero_stage=3, config=ZERO3_CONFIG),
    "zero2_lora": dict(zero_stage=2),
    "zero3_lora": dict(zero_stage=3, config=ZERO3_CONFIG),
    "zero3_lora_ckpt": dict(zero_stage=3, config=ZERO3_CONFIG),
}
CHECKPOINT_DIRS = {"zero2": "ckpt_zero2", "zero2_resume": "ckpt_zero2",
                   "zero3_crash": "ckpt_zero3", "zero3_resume": "ckpt_zero3"}


def partitioned_fraction(strategy) -> float:
    """Fraction of the model's parameter elements this rank holds (1.0 unless ZeRO-3 partitions them)."""
    held = total = 0
    for param in strategy.unwrap().parameters():
        if hasattr(param, "ds_tensor"):
            held += param.ds_tensor.numel()
            total += param.ds_numel
        else:
            held += param.numel()
            total += param.numel()
    return held / total


def tiny_tied_qwen2(seed: int) -> torch.nn.Module:
    """distributed_worker's tiny Qwen2 with ``lm_head.weight`` tied to the embedding."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=shared.VOCAB,
                                      tie_word_embeddings=True)
    return transformers.Qwen2ForCausalLM(config)


def train_with_nan_step(strategy, batches) -> dict:
    """One step, a step with a NaN loss, one more step; what a test needs to see the NaN step left no trace."""
    shared.train_steps(strategy, batches[:1], micro_batches=2)
    before, lr_before = strategy.full_state_dict(), strategy.current_lr
    with strategy.autocast():
        logits = strategy.model(input_ids=batches[1]["input_ids"]).logits
    strategy.backward(logits.float().mean() * float("nan"))
    metrics = strategy.step()
    lr_after_skip = strategy.current_lr
    after = strategy.full_state_dict()
    next_losses, _ = shared.train_steps(strategy, batches[1:2], micro_batches=2)
    return {"before": before, "after": after, "metrics": metrics, "lr_before": lr_before,
            "lr_after_skip": lr_after_skip, "skipped_steps": strategy.skipped_steps,
            "optimizer_steps": strategy.optimizer_steps, "next_losses": next_losses}


def run_phase(phase: str, out_dir: Path):
    """Run ``phase``; returns its strategy, to be closed once every phase is done."""
    from rltk.checkpoint import CheckpointManager
    from rltk.strategies.deepspeed_strategy import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(**PHASES[phase])
    batches = shared.global_batches()
    manager = CheckpointManager(out_dir / CHECKPOINT_DIRS[phase], keep_last=2) if phase in CHECKPOINT_DIRS else None
    result_file = out_dir / f"{phase}_rank{strategy.rank}_of{strategy.world_size}.pt"

    if phase.endswith("_resume"):
        strategy.setup(shared.tiny_qwen2(seed=1), **shared.SETUP)  # other weights: load must replace them
        state = manager.load(manager.latest(), strategy)
        losses, grad_norms = shared.train_steps(strategy, batches[state["step"]:], micro_batches=2)
        torch.save({"weights": strategy.full_state_dict(), "losses": losses, "grad_norms": grad_norms,
                    "resumed_at": state["step"]}, result_file)
        return strategy

    if phase == "zero3_tied":
        strategy.setup(tiny_tied_qwen2(seed=0), **shared.SETUP)
        shared.train_steps(strategy, batches[:2], micro_batches=2)
        strategy.save(out_dir / "ckpt_tied")
        torch.save({"weights": strategy.full_state_dict()}, result_file)
        return strategy

    model = shared.tiny_lora_qwen2(seed=0) if "_lora" in phase else shared.tiny_qwen2(seed=0)
    if phase.endswith("_ckpt"):
        from rltk.models.activation_checkpointing import enable_activation_checkpointing

        enable_activation_checkpointing(model)
    strategy.setup(model, **shared.SETUP)
    if phase == "zero2_nonfinite":
        torch.save(train_with_nan_step(strategy, batches), result_file)
        return strategy

    fraction = partitioned_fraction(strategy)
    losses, grad_norms = shared.train_steps(strategy, batches[:shared.CHECKPOINT_STEP], micro_batches=2)
    if phase in CHECKPOINT_DIRS:
        manager.save(shared.CHECKPOINT_STEP, strategy, {"step": shared.CHECKPOINT_STEP})
    if phase == "zero3_crash":
        weights_at_checkpoint = strategy.full_state_dict()
        shared.train_steps(strategy, batches[shared.CHECKPOINT_STEP:shared.CHECKPOINT_STEP + 1], micro_batches=2)
        torch.save({"weights": weights_at_checkpoint, "losses": losses, "grad_norms": grad_norms}, result_file)
        sys.stdout.flush()
        os._exit(0)  # killed mid-run, one step after the checkpoint

    more_losses, more_grad_norms = shared.train_steps(strategy, batches[shared.CHECKPOINT_STEP:], micro_batches=2)
    result = {"weights": strategy.full_state_dict(), "losses": losses + more_losses,
              "grad_norms": grad_norms + more_grad_norms, "partitioned_fraction": fraction,
              "skipped_steps": strategy.skipped_steps, "optimizer_steps": strategy.optimizer_steps}
    if strategy.mixed_precision != "no":
        result["master_weights"] = strategy.full_master_state_dict()
    if phase.endswith("_ckpt"):  # decoder layers transformers checkpoints: flagged and in train mode
        from transformers.modeling_layers import GradientCheckpointingLayer

        result["checkpointed_layers"] = sum(isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
                                            and m.training for m in strategy.unwrap().modules())
    torch.save(result, result_file)
    return strategy


def main(out_dir: Path, phases: list[str]) -> None:
    unknown = [phase for phase in phases if phase not in PHASES]
    if unknown or not phases:
        raise SystemExit(f"ds_worker.py: unknown phase(s) {unknown}; valid: {', '.join(PHASES)}")
    # One process group for the whole launch: the first strategy starts it and, closed last, ends it.
    strategies = [run_phase(phase, out_dir) for phase in phases]
    for strategy in reversed(strategies):
        strategy.close()


if __name__ == "__main__":
    from rltk.distributed import strip_local_rank_argument

    arguments = strip_local_rank_argument(sys.argv[1:])  # the `deepspeed` launcher appends --local_rank=N
    main(Path(arguments[0]), arguments[1:])
