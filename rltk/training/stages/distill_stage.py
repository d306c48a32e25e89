"""The on-policy distillation loop: the student samples, a frozen teacher scores every sampled token.

GKD with lambda = 1 (Agarwal et al. 2024, arXiv:2306.13649); Thinking Machines' "On-Policy Distillation"
(2025). The algorithm box is ``recipes/distill.py``'s docstring; the stage is registered as ``distill``
(:mod:`rltk.components.builtin_stages`).
"""

from __future__ import annotations

import dataclasses
import time

from rltk.training.scaffold.rows import refuse_image_rows
from rltk.training.rollouts.rollout_source import open_rollout_source
from rltk.training.stages.loop_state import open_rl_stage, rl_steps
from rltk.training.stages.run import Stage, build_rl_strategy
from rltk.training.stages.step_end import end_step, evaluate_at_start
from rltk.training.step.batch_metrics import rollout_metrics
from rltk.training.step.forward import old_logprobs_pass
from rltk.training.step.ranks import global_masked_mean
from rltk.training.updates.distill import load_teacher
from rltk.training.updates.rl import policy_update


def run_distill_stage(stage: Stage):
    run, cfg = stage.run, stage.cfg
    refuse_image_rows(run.train_rows, cfg, "the distill stage (its teacher's forward)")
    a, t = cfg.algorithm, cfg.trainer
    strategy = build_rl_strategy(stage)  # the schedule counts optimizer steps
    workflow = run.workflow

    # The teacher: loaded once, refused (exit 2) when its tokenizer is not the student's
    teacher = load_teacher(cfg.distill.teacher_path, run.tokenizer, strategy, dtype=cfg.distill.teacher_dtype)
    # estimator (on_policy_distill), policy loss, sampling, step plan, forward; sampler, buffer, mini-batch
    # order, restored when resumed
    ctx = open_rl_stage(stage, strategy, default="distill")
    loop, parts = ctx.loop, ctx.parts
    fwd = parts.forward
    evaluate_at_start(ctx)  # held-out accuracy before the stage trains

    # Sampled here (trainer.mode=sync), or by producer processes with weights at most
    # trainer.max_staleness versions behind (one_step_off, async); the teacher stays with the trainer.
    with open_rollout_source(ctx) as rollouts:
        # rollout: each step's experiences (sampled now, or a producer's batch) and what to train on, the sample
        # strategy's pick from the buffer (a step with nothing to train on is skipped on every rank)
        for step, tick, rollout, batch in rl_steps(ctx, rollouts):

            # log-probs of the sampled tokens under the student that sampled them and under the teacher
            batch["old_logprobs"], _ = old_logprobs_pass(strategy.unwrap(), batch, fwd,
                                                         use_rollout_logprobs=a.use_rollout_logprobs,
                                                         strategy=strategy)
            # the teacher routes by its own router: the rollout's routing is the student's
            batch["teacher_logprobs"] = teacher.logprobs(batch, dataclasses.replace(fwd, routing_replay=False))

            # advantages: minus the per-token reverse KL (+ task_coef x the reward's group advantage)
            batch["advantages"], batch["returns"] = parts.estimator(batch, strategy)
            run.trace(stage, step, batch, loop.batch_items)

            # update
            update_metrics, batch["old_logprobs"] = policy_update(strategy, batch, parts.loss, fwd,
                                                                  kl_coef=0.0, mini_batches=t.mini_batches,
                                                                  ppo_epochs=t.ppo_epochs, generator=loop.generator)
            workflow.engine.update_weights(strategy.unwrap())  # colocated engines share the module: a no-op
            rollouts.after_update(step)  # async: every trainer.sync_every steps, the producers' next weights

            # log (the reverse KL the student started this step at, its sampled-token estimate; the teacher's
            # log-prob of the student's tokens; the task reward), evaluate, guard, checkpoint
            mask = batch["response_mask"]
            metrics = {**rollout_metrics(batch, workflow, parts.sample_strategy, time.perf_counter() - tick,
                                         strategy),
                       **rollout.metrics,
                       "distill/reverse_kl": global_masked_mean(batch["old_logprobs"] - batch["teacher_logprobs"],
                                                                mask, strategy),
                       "distill/teacher_logprob": global_masked_mean(batch["teacher_logprobs"], mask, strategy),
                       "distill/student_logprob": global_masked_mean(batch["old_logprobs"], mask, strategy),
                       **update_metrics}
            end_step(ctx, step, metrics, rollouts)
    return strategy  # the trained policy, for the next stage
