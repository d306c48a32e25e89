"""The PPO loop with a learned critic: GAE advantages, clipped policy and value losses, KL in the reward.

Schulman et al. 2017 (arXiv:1707.06347), as RLHF runs it (Ziegler et al. 2019, arXiv:1909.08593; Ouyang
et al. 2022, arXiv:2203.02155). The algorithm box is ``recipes/ppo.py``'s docstring; the stage is
registered as ``ppo`` (:mod:`rltk.components.builtin_stages`).
"""

from __future__ import annotations

import time

from rltk.algorithms.kl import apply_kl_penalty
from rltk.training.scaffold.rows import refuse_image_rows
from rltk.training.rollouts.rollout_source import open_rollout_source
from rltk.training.stages.loop_state import StageContext, kl_to_reference, open_rl_stage, rl_steps
from rltk.training.stages.run import Stage, build_rl_strategy
from rltk.training.stages.step_end import end_step, evaluate_at_start
from rltk.training.step.batch_metrics import rollout_metrics
from rltk.training.step.forward import old_logprobs_pass
from rltk.training.step.moe_metrics import moe_step_metrics
from rltk.training.step.ranks import global_masked_mean, rows_in
from rltk.training.updates.ppo import PolicyAndCritic, batched_values, build_critic, build_critic_strategy, critic_update
from rltk.training.updates.rl import policy_update


def run_ppo_stage(stage: Stage):
    run, cfg = stage.run, stage.cfg
    refuse_image_rows(run.train_rows, cfg, "the ppo stage (its critic, a value model, sees the text only)")
    t, c = cfg.trainer, cfg.critic
    # The schedule counts optimizer steps, of the RL steps after the critic's warm-up (the policy waits
    # through it); the rollout engine follows the strategy's weights (ZeRO-3: from a whole copy of its own).
    strategy = build_rl_strategy(stage, train_steps=t.total_steps - c.warmup_steps)
    workflow = run.workflow
    # The critic starts from the policy as this stage begins (after any warm-up), copied from a
    # plain copy of it (ZeRO-3 has partitioned the policy); a resumed run overwrites its weights
    # from the checkpoint below.
    critic_strategy = build_critic_strategy(cfg, build_critic(cfg, strategy.reference_model(frozen=False)),
                                            total_steps=t.total_steps)
    strategies = PolicyAndCritic(strategy, critic_strategy)  # one checkpoint holds both

    # Components, each chosen by name in the config (estimator (GAE), losses, sample strategy), the step plan,
    # how every log-prob pass runs; sampler, buffer (+ expert data), KL controller, mini-batch order, frozen
    # reference, restored (policy and critic) from the stage's checkpoint when it resumes.
    ctx = open_rl_stage(stage, strategy, default="ppo", checkpointed=strategies)
    parts = ctx.parts
    evaluate_at_start(ctx)  # held-out accuracy before the stage trains

    # Sampled here (trainer.mode=sync), or by producer processes with weights at most
    # trainer.max_staleness versions behind (one_step_off, async); the critic stays with the trainer.
    with open_rollout_source(ctx) as rollouts:
        # rollout: each step's experiences (sampled now, or a producer's batch) and what to train on, the sample
        # strategy's pick from the buffer (a step with nothing to train on is skipped on every rank)
        for step, tick, rollout, batch in rl_steps(ctx, rollouts):
            metrics = ppo_step(ctx, batch, step)
            rollouts.after_update(step)  # async: every trainer.sync_every steps, the producers' next weights

            # log, evaluate, guard, checkpoint (policy, critic and the loop's position in one atomic folder)
            metrics = {**rollout_metrics(batch, workflow, parts.sample_strategy, time.perf_counter() - tick,
                                         strategy),
                       **rollout.metrics, **metrics}
            end_step(ctx, step, metrics, rollouts)
    return strategy  # the trained policy, for the next stage


def ppo_step(ctx: StageContext, batch: dict, step: int) -> dict:
    """One PPO step on a sampled ``batch``: old, reference and critic passes, GAE, then the critic's
    update and, once the critic has warmed up, the policy's. Returns the step's metrics. ``ctx.checkpointed``
    holds the policy and its critic (:class:`PolicyAndCritic`)."""
    stage, parts, loop = ctx.stage, ctx.parts, ctx.loop
    cfg = stage.cfg
    a, t, c = cfg.algorithm, cfg.trainer, cfg.critic
    strategy, critic_strategy = ctx.checkpointed.policy, ctx.checkpointed.critic
    reference, fwd = loop.reference, parts.forward

    # old and reference log-probs of the sampled tokens (+ sum_pi_squared where the plan has it), and the
    # critic's values
    batch["old_logprobs"], sum_pi_squared = old_logprobs_pass(
        strategy.unwrap(), batch, fwd, use_rollout_logprobs=a.use_rollout_logprobs, strategy=strategy,
        with_sum_pi_squared=parts.step_plan.sum_pi_squared)
    if sum_pi_squared is not None:
        batch["sum_pi_squared"] = sum_pi_squared
    batch["values"] = batched_values(critic_strategy.unwrap(), batch, fwd, strategy=critic_strategy)
    mask = batch["response_mask"]
    # an MoE policy's routing: trainer vs rollout top-k, expert balance, log-prob gap with/without replay
    kl_metrics = moe_step_metrics(strategy.unwrap(), batch, fwd, strategy=strategy)
    if reference is not None:
        batch["ref_logprobs"] = reference.logprobs(batch, fwd)
        kl = kl_to_reference(parts.loss, batch["old_logprobs"], batch["ref_logprobs"])
        kl_metrics["kl"] = global_masked_mean(kl, mask, strategy)
        if a.kl_in == "reward":  # PPO's form: a per-token penalty, before advantages
            batch["token_rewards"] = apply_kl_penalty(batch["token_rewards"], kl, loop.kl_ctl.value, mask)

    # advantages: GAE over the (penalised) rewards with the critic's values as baseline
    batch["advantages"], batch["returns"] = parts.estimator(batch, strategy)
    stage.run.trace(stage, step, batch, loop.batch_items)  # a sample of the step's trajectories (logging.traces)

    # update: the critic every step; the policy once the critic has warmed up
    update_metrics = critic_update(critic_strategy, batch, fwd, loss_agg=parts.loss.loss_agg,
                                   loss_agg_args=parts.loss.loss_agg_args, clip_range=c.value_clip,
                                   mini_batches=t.mini_batches, ppo_epochs=t.ppo_epochs,
                                   generator=loop.generator).metrics
    policy_updated = step > c.warmup_steps
    if policy_updated:
        update_metrics.update(policy_update(strategy, batch, parts.loss, fwd, kl_coef=loop.kl_ctl.value,
                                            mini_batches=t.mini_batches, ppo_epochs=t.ppo_epochs,
                                            generator=loop.generator).metrics)
        stage.run.workflow.engine.update_weights(strategy.unwrap())  # colocated engines share the module: a no-op
        if reference is not None:
            loop.kl_ctl.update(kl_metrics["kl"], rows_in(batch, strategy))
    return {"kl_coef": loop.kl_ctl.value, "policy_updated": float(policy_updated),
            "returns_mean": global_masked_mean(batch["returns"], mask, strategy), **kl_metrics, **update_metrics}
