"""Worker for test_deepspeed_zero3_weights.py: whole weights out of a ZeRO-3 strategy, and a stage hand-off.

``python zero3_weights_worker.py`` (one process, no launcher) or
``python -m torch.distributed.run --standalone --nproc_per_node 2 zero3_weights_worker.py``.

A tied tiny Qwen2 trains under ZeRO-3 in bf16 (parameters partitioned,
fp32 master weights in the optimizer). Then, on every rank:

* ``full_model_copy()`` is a plain module in the training dtype with the
  gathered weights, tied weights tied, buffers present, sharing nothing with
  the training weights;
* a rollout engine samples from that copy on rank 0 alone (a partitioned
  module would hang there), and ``update_weights(strategy.unwrap())`` after
  another step gathers the new weights into it (a collective on all ranks);
* ``release_model()`` hands back a plain fp32 module holding exactly the
  master weights; the strategy refuses further use; a second ZeRO-3 strategy
  builds on the released module and trains from exactly those weights.

Checks fail with an AssertionError (non-zero exit); each rank prints one
``RESULT`` line when everything held.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import distributed_worker as shared  # noqa: E402
import ds_worker  # noqa: E402

ZERO3 = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: keys differ"
    for key in a:
        assert a[key].dtype == b[key].dtype, f"{what}: {key} is {a[key].dtype}, expected {b[key].dtype}"
        assert torch.equal(a[key].cpu(), b[key].cpu()), f"{what}: {key} differs"


def plain_state(module: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def main() -> int:
    from rltk.rollout.base import SamplingParams
    from rltk.rollout.hf import HFRolloutEngine
    from rltk.strategies.deepspeed_strategy import DeepSpeedStrategy

    batches = shared.global_batches()
    strategy = DeepSpeedStrategy(zero_stage=3, mixed_precision="bf16", config=ZERO3)
    strategy.setup(ds_worker.tiny_tied_qwen2(seed=0), **shared.SETUP)
    assert strategy.shards_parameters
    assert all(p.numel() == 0 for p in strategy.unwrap().parameters()), "parameters must be partitioned"
    shared.train_steps(strategy, batches[:2], micro_batches=2)

    copy = strategy.full_model_copy()
    assert not any(hasattr(p, "ds_id") for p in copy.parameters()), "the copy must be a plain module"
    assert all(p.dtype == torch.bfloat16 for p in copy.parameters()), "the copy is in the training dtype"
    assert copy.lm_head.weight is copy.model.embed_tokens.weight, "tied weights must stay tied"
    assert dict(copy.named_buffers()).keys() == dict(strategy.unwrap().named_buffers()).keys()
    assert_same(plain_state(copy), strategy.full_state_dict(), "full_model_copy")

    engine = HFRolloutEngine(copy, tokenizer=None)
    if strategy.rank == 0:  # one rank alone: no collective may hide in generate
        completions = engine.generate([[3, 4, 5]], SamplingParams(greedy=True, max_new_tokens=4, stop_token_ids=[]))
        assert len(completions[0][0].token_ids) == 4
    strategy.barrier()

    before = plain_state(copy)
    shared.train_steps(strategy, batches[2:3], micro_batches=2)
    assert_same(plain_state(copy), before, "the copy after a training step (it must share no storage)")
    engine.update_weights(strategy.unwrap())  # gathers the partitioned module: every rank calls it
    after = strategy.full_state_dict()
    assert_same(plain_state(engine.model), after, "the engine's copy after update_weights")
    assert any(not torch.equal(after[k], before[k]) for k in after), "the step must have changed the weights"

    master = strategy.full_master_state_dict()
    released = strategy.release_model()
    assert not any(hasattr(p, "ds_id") for p in released.parameters())
    assert all(p.dtype == torch.float32 for p in released.parameters()), "released in its original dtype"
    assert released.lm_head.weight is released.model.embed_tokens.weight
    assert_same(plain_state(released), master, "release_model (the fp32 master weights)")
    try:
        strategy.unwrap()
    except RuntimeError as exc:
        assert "release_model" in str(exc), exc
    else:
        raise AssertionError("a released strategy must refuse to be used")

    # The next stage: a new ZeRO-3 strategy on the released module starts from exactly its weights.
    second = DeepSpeedStrategy(zero_stage=3, config=ZERO3)
    second.setup(released, **shared.SETUP)
    assert_same(second.full_state_dict(), master, "the next stage's starting weights")
    losses, _ = shared.train_steps(second, batches[3:4], micro_batches=2)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    print(f"RESULT rank={second.rank} world={second.world_size} ok", flush=True)
    second.close()
    strategy.close()  # constructed first: it owns the process group
    return 0


if __name__ == "__main__":
    code = main()
    # as rltk's own command does under a launch (rltk.commands.cli.console_main): once the results are printed and
    # the group ended, a gloo thread's destructor at interpreter exit can still abort a loaded machine's rank
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
