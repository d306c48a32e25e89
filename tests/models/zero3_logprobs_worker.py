"""Worker for test_logprobs_sharded.py: fused log-probs of a DeepSpeed ZeRO-3 model vs the unsharded model.

``python zero3_logprobs_worker.py`` (one process, no launcher) or
``python -m torch.distributed.run --standalone --nproc_per_node 2 zero3_logprobs_worker.py``.

Each rank scores its own batch with :func:`response_logprobs` on the ZeRO-3
engine (the LM head is partitioned outside its forward:
``stage3_param_persistence_threshold=0``), backpropagates through DeepSpeed
and reads the full gradients; the reference is an unsharded copy of the same
model scoring every rank's batch with :func:`response_logprobs_naive`, its loss
averaged over ranks as DeepSpeed averages gradients. Two optimizer steps, so
the second compares against weights the engine itself updated. Prints one
``RESULT`` line per rank and exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys

import torch
import transformers

VOCAB = 97
IMPLS = ("torch", "naive")  # the op's tiled backend and its reference backend, both through the gathered head


def build(tie: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=VOCAB, initializer_range=0.2, tie_word_embeddings=tie,
    )
    return transformers.Qwen2ForCausalLM(config)


def batch(rank: int):
    ids = torch.randint(3, VOCAB, (3, 11), generator=torch.Generator().manual_seed(rank))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded prompt
    mask[2, -2:] = 0  # a right-padded response
    return ids, mask, 5


def main() -> int:
    import deepspeed

    from rltk.models.logprobs import response_logprobs, response_logprobs_naive
    from rltk.distributed import ensure_single_process_environment

    ensure_single_process_environment()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    worst_value = worst_grad = 0.0
    for tie in (True, False):
        for impl in IMPLS:
            reference, model = build(tie), build(tie)
            config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": world, "gradient_clipping": 0.0,
                      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                              config=config, dist_init_required=False)
            head = engine.module.lm_head
            assert head.weight.numel() == 0, "the head must be partitioned for this test to mean anything"
            for _ in range(2):
                ids, mask, width = batch(rank)
                logprobs, entropy = response_logprobs(engine, ids, mask, width, impl=impl, with_entropy=True)
                assert "forward" not in head.__dict__, "the head's forward must be restored"
                ref_lp, ref_ent = response_logprobs_naive(reference, ids, mask, width, with_entropy=True)
                worst_value = max(worst_value, (logprobs - ref_lp).abs().max().item(),
                                  (entropy - ref_ent).abs().max().item())
                engine.backward(logprobs.sum() + 0.5 * entropy.sum())

                reference.zero_grad()
                total = 0
                for r in range(world):
                    lp, ent = response_logprobs_naive(reference, *batch(r), with_entropy=True)
                    total = total + lp.sum() + 0.5 * ent.sum()
                (total / world).backward()
                for param, ref_param in zip(engine.module.parameters(), reference.parameters()):
                    grad = deepspeed.utils.safe_get_full_grad(param)
                    error = (grad - ref_param.grad).abs().max() / ref_param.grad.abs().max().clamp_min(1e-12)
                    worst_grad = max(worst_grad, error.item())
                engine.step()
                with torch.no_grad():  # the reference follows the engine's update
                    for param, ref_param in zip(engine.module.parameters(), reference.parameters()):
                        with deepspeed.zero.GatheredParameters([param]):
                            ref_param.copy_(param)

            # Without gradients, on the module inside the engine (what old/reference log-probs use).
            with torch.no_grad():
                ids, mask, width = batch(rank)
                logprobs, _ = response_logprobs(engine.module, ids, mask, width, impl=impl)
                ref_lp, _ = response_logprobs_naive(reference, ids, mask, width)
            worst_value = max(worst_value, (logprobs - ref_lp).abs().max().item())
            engine.destroy()
    print(f"RESULT rank={rank} world={world} worst_value_error={worst_value:.3e} "
          f"worst_rel_grad_error={worst_grad:.3e}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0 if worst_value < 1e-5 and worst_grad < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
