"""The GRPO loop and its relatives (Dr. GRPO, DAPO, RLOO, REINFORCE++, GSPO, CISPO, ReMax): one RL stage.

Shao et al. 2024 (arXiv:2402.03300) for the group-relative advantage; every other piece (estimator,
policy loss, KL estimator, sample strategy) is the config's. The algorithm box is ``recipes/grpo.py``'s
docstring; the stage is registered as ``grpo`` (:mod:`rltk.components.builtin_stages`).
"""

from __future__ import annotations

import time

from rltk.algorithms.kl import apply_kl_penalty
from rltk.training.rollouts.rollout_source import open_rollout_source
from rltk.training.stages.loop_state import kl_to_reference, open_rl_stage, rl_steps
from rltk.training.stages.run import Stage, build_rl_strategy
from rltk.training.stages.step_end import end_step, evaluate_at_start
from rltk.training.step.batch_metrics import rollout_metrics
from rltk.training.step.forward import old_logprobs_pass
from rltk.training.step.moe_metrics import moe_step_metrics
from rltk.training.step.ranks import global_masked_mean, rows_in
from rltk.training.updates.rl import policy_update


def run_grpo_stage(stage: Stage):
    run, cfg = stage.run, stage.cfg
    a, t = cfg.algorithm, cfg.trainer
    # The schedule counts optimizer steps; the rollout engine follows the strategy's weights (ZeRO-3: from a
    # whole copy of its own).
    strategy = build_rl_strategy(stage)
    workflow = run.workflow

    # Components, each chosen by name in the config (estimator, losses, sample strategy), the step plan (which
    # pass fills which field: with one epoch over one mini-batch the update takes the old log-probs from its
    # own forward), how every log-prob pass runs; sampler, buffer (+ expert data), KL controller, mini-batch
    # order, frozen reference, restored from the stage's checkpoint when it resumes.
    ctx = open_rl_stage(stage, strategy, default="grpo")
    loop, parts = ctx.loop, ctx.parts
    reference, fwd = loop.reference, parts.forward
    evaluate_at_start(ctx)  # held-out accuracy before the stage trains
    # Sampled here (trainer.mode=sync), or by producer processes with weights published every
    # trainer.sync_every steps, at most trainer.max_staleness versions behind (one_step_off, async).
    with open_rollout_source(ctx) as rollouts:
        # rollout: each step's experiences (sampled now, or a producer's batch) and what to train on, the sample
        # strategy's pick from the buffer (a step with nothing to train on is skipped on every rank)
        for step, tick, rollout, batch in rl_steps(ctx, rollouts):
            # old and reference log-probs of the sampled tokens (+ sum_pi_squared where the plan has it);
            # an on-policy update (one epoch, one mini-batch) takes the old ones from its own forward instead
            if not parts.on_policy:
                batch["old_logprobs"], sum_pi_squared = old_logprobs_pass(
                    strategy.unwrap(), batch, fwd, use_rollout_logprobs=a.use_rollout_logprobs, strategy=strategy,
                    with_sum_pi_squared=parts.step_plan.sum_pi_squared)
                if sum_pi_squared is not None:
                    batch["sum_pi_squared"] = sum_pi_squared
            # an MoE policy's routing: trainer vs rollout top-k, expert balance, log-prob gap with/without replay
            moe_metrics = moe_step_metrics(strategy.unwrap(), batch, fwd, strategy=strategy)
            kl = None
            if reference is not None:
                batch["ref_logprobs"] = reference.logprobs(batch, fwd)
                if a.kl_in == "reward":  # fold the penalty into the per-token rewards before advantages
                    kl = kl_to_reference(parts.loss, batch["old_logprobs"], batch["ref_logprobs"])
                    batch["token_rewards"] = apply_kl_penalty(batch["token_rewards"], kl, loop.kl_ctl.value,
                                                              batch["response_mask"])

            # advantages from the fields the estimator names
            batch["advantages"], batch["returns"] = parts.estimator(batch, strategy)
            run.trace(stage, step, batch, loop.batch_items)  # a sample of the step's trajectories (logging.traces)

            # update: ppo_epochs x mini-batches, one optimizer step each (on-policy, the old log-probs are
            # its own forward's, and it hands them back)
            update_metrics, batch["old_logprobs"] = policy_update(strategy, batch, parts.loss, fwd,
                                                                  kl_coef=loop.kl_ctl.value,
                                                                  mini_batches=t.mini_batches,
                                                                  ppo_epochs=t.ppo_epochs, generator=loop.generator)
            workflow.engine.update_weights(strategy.unwrap())  # colocated engines share the module: a no-op
            rollouts.after_update(step)  # async: every trainer.sync_every steps, the producers' next weights
            kl_metrics = {}
            if reference is not None:  # KL(pi_old || pi_ref) of the sampled tokens, the update's starting point
                if kl is None:
                    kl = kl_to_reference(parts.loss, batch["old_logprobs"], batch["ref_logprobs"])
                kl_metrics["kl"] = global_masked_mean(kl, batch["response_mask"], strategy)
                loop.kl_ctl.update(kl_metrics["kl"], rows_in(batch, strategy))

            # log, evaluate, guard, checkpoint
            elapsed = time.perf_counter() - tick
            metrics = {**rollout_metrics(batch, workflow, parts.sample_strategy, elapsed, strategy),
                       **rollout.metrics, "kl_coef": loop.kl_ctl.value, **kl_metrics, **moe_metrics, **update_metrics}
            end_step(ctx, step, metrics, rollouts)
    return strategy  # the trained policy, for the next stage
