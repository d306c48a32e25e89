"""Two-process worker for the distributed test in test_rollout_correction.py.

``python -m torch.distributed.run --standalone --nproc_per_node 2 rollout_correction_worker.py OUT_DIR``
runs one corrected policy update (DDP on CPU, gloo) on the uneven split of rl_step_worker.py and writes
each rank's metrics and final weights to ``OUT_DIR/rank<r>.pt``; :func:`corrected_update` is also the
one-process reference.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location("rltk_tests_rl_step_worker",
                                               Path(__file__).with_name("rl_step_worker.py"))
steps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(steps)

# drops single tokens (MIS outside [0.5, 2]) and whole responses (geometric mean outside [0.8, 1.25])
SETTINGS = {"mis": "token", "mis_low": 0.5, "mis_high": 2.0, "rejection": "geometric",
            "rejection_low": 0.8, "rejection_high": 1.25}


def perturbation(token_ids: torch.Tensor) -> torch.Tensor:
    """log(pi_old / pi_rollout) as a function of the token id, so every split of the rows agrees."""
    return ((token_ids % 7) - 3).float() * 0.3  # -0.9 .. 0.9: ratios 0.41 .. 2.46


def corrected_update(strategy) -> dict:
    import rltk
    from rltk.batch import collate
    from rltk.training.step.forward import ForwardSettings, batched_logprobs
    from rltk.training.step.estimator import compute_advantages
    from rltk.training.step.loss_components import LossComponents
    from rltk.training.updates.rl import policy_update

    batch = collate(steps.local_experiences(0, strategy.rank, strategy.world_size), pad_token_id=0)
    T = batch["response_mask"].shape[1]
    batch["old_logprobs"], _ = batched_logprobs(strategy.unwrap(), batch, ForwardSettings(micro_batch_size=2),
                                                strategy=strategy)
    batch["rollout_logprobs"] = (batch["old_logprobs"] - perturbation(batch["input_ids"][:, -T:])) \
        * batch["response_mask"]
    batch["has_rollout_logprobs"] = torch.ones(len(batch["scores"]), dtype=torch.bool)
    compute_advantages(rltk.get_component("advantage_fn", "grpo"), batch, {}, strategy)
    loss = LossComponents(policy_loss=rltk.get_component("policy_loss", "ppo_clip"),
                          loss_agg=rltk.get_component("loss_agg", "seq-mean-token-mean"), rollout_correction=SETTINGS)
    metrics, _ = policy_update(strategy, batch, loss, ForwardSettings(micro_batch_size=2), kl_coef=0.0,
                               mini_batches=1, ppo_epochs=2, generator=torch.Generator().manual_seed(0))
    return {"metrics": metrics, "weights": strategy.full_state_dict()}


def main(out_dir: Path) -> None:
    from rltk.strategies.accelerate_strategy import AccelerateStrategy

    strategy = AccelerateStrategy(cpu=True)
    strategy.setup(steps.shared.tiny_qwen2(seed=0), **steps.SETUP)
    assert strategy.world_size == 2, f"expected 2 processes, got {strategy.world_size}"
    torch.save(corrected_update(strategy), out_dir / f"rank{strategy.rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
