"""Two-process worker for test_distributed_rl_step.py, and the RL steps it shares with the one-process reference.

``python -m torch.distributed.run --standalone --nproc_per_node 2 rl_step_worker.py OUT_DIR PHASE...``
runs the recipes' RL step (old log-probs, advantages, PPO-clip update) for
``STEPS`` steps on fixed rollouts, once per phase (``ddp``, ``fsdp``,
``zero3``), and writes each rank's results to ``OUT_DIR/<phase>_rank<r>.pt``.
A phase may add ``+budget`` (``max_tokens_per_micro_batch=TOKEN_BUDGET``) and
``+pack`` (``pack_sequences``): e.g. ``zero3+budget+pack``.

The rollouts are split the way the recipes split them, and deliberately
unevenly: rank 0 samples groups 0-2, rank 1 group 3 alone, with shorter
responses (so its batch is narrower and has fewer micro-batches), and each
rank numbers its groups from 0, as the workflows do. The estimators whiten
over the batch, so any statistic taken per rank instead of over the global
batch shows up in the advantages.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "strategies"))
import distributed_worker as shared  # noqa: E402  (the tiny Qwen2 every strategy test uses)

GROUPS, PER_GROUP, PROMPT_LEN = 4, 3, 4
RANK_GROUPS = {0: [0, 1, 2], 1: [3]}
# one estimator per step: group baseline + token-weighted whitening, discounted returns + whitening, GRPO,
# the optimal token baseline (sum_pi_squared from the old-log-prob pass, gathered over ranks) and gdpo
# (reward_components, a column per named reward, whitened over the batch)
ESTIMATORS = ["reinforce_plus_plus_baseline", "reinforce_plus_plus", "grpo", "optimal_token_baseline", "gdpo"]
REWARD_NAMES = ["value", "short"]  # the reward_details every experience carries, for gdpo
STEPS = len(ESTIMATORS)
PPO_EPOCHS = 2
MICRO_BATCH = 2
# rows hold 5-11 tokens: two or three share a micro-batch, so rank 0 (9 rows) needs more than rank 1 (3 rows)
# and the ranks' micro-batch counts are balanced to the larger
TOKEN_BUDGET = 24
# eps=1e-6, not AdamW's 1e-8: the test compares weights to atol 1e-6, and one process and two sum the
# same gradients in another order (differences ~1e-11). Adam's first update is lr*g/(|g|+eps), so for an
# element whose gradient is at or below eps (here q_proj.weight[11, 13] of layer 0 at step 0: 2e-9,
# against a median 5e-5) that rounding noise moves the weight by lr*1e-11/eps: 1.5e-6 under ZeRO-3 with
# AVX2 kernels, under the tolerance with ATEN_CPU_CAPABILITY=default. With eps=1e-6 it is ~1e-8 while Adam
# still normalises every ordinary gradient, so the weights compare what the ranks computed, not rounding.
SETUP = dict(lr=1e-3, total_steps=STEPS * PPO_EPOCHS, weight_decay=0.01, warmup_steps=0, lr_schedule="constant",
             grad_clip=1.0, eps=1e-6)
ZERO3_CONFIG = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def rollouts(step: int):
    """The experiences of step ``step`` as (group, Experience), group ids still global."""
    from rltk.batch import Experience

    generator = torch.Generator().manual_seed(100 + step)
    out = []
    for group in range(GROUPS):
        prompt = torch.randint(1, shared.VOCAB, (PROMPT_LEN,), generator=generator).tolist()
        longest = 3 if group == 3 else 7
        for _ in range(PER_GROUP):
            length = int(torch.randint(1, longest + 1, (1,), generator=generator))
            response = torch.randint(1, shared.VOCAB, (length,), generator=generator).tolist()
            mask = [1] * length
            if length >= 4:
                mask[1] = 0  # a tool token inside the response: not the policy's
            score = float(torch.rand((), generator=generator))
            details = {"value": score, "short": float(length <= 3), "value/extra": 2.0}  # no column for extras
            out.append((group, Experience(prompt, response, score, group_id=group, response_mask=mask,
                                          reward_details=details)))
    return out


def local_experiences(step: int, rank: int, world_size: int):
    """This rank's experiences, groups renumbered from 0 as a rank's workflow numbers them."""
    groups = list(range(GROUPS)) if world_size == 1 else RANK_GROUPS[rank]
    local = []
    for group, experience in rollouts(step):
        if group in groups:
            experience.group_id = groups.index(group)
            local.append(experience)
    return local


def micro_options(phase: str) -> dict:
    """The micro-batching a phase name asks for: ``+budget`` and ``+pack`` after the engine."""
    options = set(phase.split("+")[1:])
    return {**({"max_tokens_per_micro_batch": TOKEN_BUDGET} if "budget" in options else {}),
            **({"pack_sequences": True} if "pack" in options else {})}


def run_steps(strategy, micro: dict | None = None) -> dict:
    """The RL steps; returns the advantages of this rank's rows, the update metrics and the final weights.

    ``micro``: token-budget / packing options for every forward (:func:`micro_options`).
    """
    import rltk
    from rltk.batch import collate
    from rltk.training.step.forward import ForwardSettings, old_logprobs_pass
    from rltk.training.step.estimator import Estimator, compute_advantages
    from rltk.training.step.loss_components import LossComponents
    from rltk.training.updates.rl import policy_update

    loss = LossComponents(policy_loss=rltk.get_component("policy_loss", "ppo_clip"),
                          loss_agg=rltk.get_component("loss_agg", "token-mean"), entropy_coef=0.01)
    generator = torch.Generator().manual_seed(0)
    advantages, metrics = [], []
    for step, name in enumerate(ESTIMATORS):
        adv_fn = rltk.get_component("advantage_fn", name)
        batch = collate(local_experiences(step, strategy.rank, strategy.world_size), pad_token_id=0,
                        reward_names=REWARD_NAMES if name == "gdpo" else None)
        settings = ForwardSettings(micro_batch_size=MICRO_BATCH, temperature=1.0, **(micro or {}))
        batch["old_logprobs"], sum_pi_squared = old_logprobs_pass(
            strategy.unwrap(), batch, settings, use_rollout_logprobs=False,
            with_sum_pi_squared=Estimator.of(adv_fn).names("sum_pi_squared"), strategy=strategy)
        if sum_pi_squared is not None:
            batch["sum_pi_squared"] = sum_pi_squared
        compute_advantages(adv_fn, batch, {}, strategy)
        advantages.append(batch["advantages"])
        metrics.append(policy_update(strategy, batch, loss, settings, kl_coef=0.0, mini_batches=1,
                                     ppo_epochs=PPO_EPOCHS, generator=generator).metrics)
    return {"advantages": advantages, "metrics": metrics, "weights": strategy.full_state_dict()}


def build_strategy(phase: str):
    phase = phase.split("+")[0]
    if phase == "zero3":
        from rltk.strategies.deepspeed_strategy import DeepSpeedStrategy

        return DeepSpeedStrategy(zero_stage=3, config=ZERO3_CONFIG)
    from rltk.strategies.accelerate_strategy import AccelerateStrategy

    return AccelerateStrategy(cpu=True, fsdp=phase == "fsdp")


def main(out_dir: Path, phases: list[str]) -> None:
    strategies = []
    for phase in phases:
        strategy = build_strategy(phase)
        strategy.setup(shared.tiny_qwen2(seed=0), **SETUP)
        assert strategy.world_size == 2, f"expected 2 processes, got {strategy.world_size}"
        torch.save(run_steps(strategy, micro_options(phase)), out_dir / f"{phase}_rank{strategy.rank}.pt")
        strategies.append(strategy)
    torch.distributed.barrier()
    for strategy in reversed(strategies):
        if hasattr(strategy, "close"):
            strategy.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
