"""On-policy distillation: the student samples, a frozen teacher scores every sampled token.

    rltk run distill distill.teacher_path=runs/sft-tiny/checkpoints/step_001500   # embedded tiny student
    rltk run distill distill.teacher_path=/models/teacher model.path=/models/student data.path=prompts.jsonl
    rltk run distill distill.teacher_path=... algorithm.advantage_fn_args.task_coef=0.5   # + the reward's GRPO advantage

The loop, as in the algorithm box of GKD with lambda = 1 (Agarwal et al. 2024, arXiv:2306.13649) and of
Thinking Machines' "On-Policy Distillation" (2025):

    pi_T        <- the teacher (distill.teacher_path), frozen; it must share the student's tokenizer
    for each stage (e.g. a supervised warm-up of the student, then distillation):
        for step in 1..N:
            rows        <- next prompts from the dataset
            y ~ pi_S    <- workflow(rows): n samples per prompt from the student, scored by the reward fns
            log pi_S_old(y_t), log pi_T(y_t)   of every sampled token
            A_t         <- -(log pi_S_old(y_t) - log pi_T(y_t))  [+ task_coef * GRPO advantage of the reward]
            update      <- policy_loss(A) (one on-policy step: the ratio is 1, the gradient is
                           -A_t grad log pi_S(y_t), the reverse KL's)
            log reverse KL per token, teacher log-prob, task reward; evaluate on held-out prompts
            guard, checkpoint

No reward is needed to learn: the teacher's log-probs are the dense per-token signal (the reward fns still
score the samples, for the task-reward metric and for task_coef). This file is a script, not a
module: copy it to change the loop itself.
"""

from __future__ import annotations

import dataclasses
import time

from rltk.recipe_utils import parse_recipe_args, stage_runners
from rltk.training.step.batch_metrics import rollout_metrics
from rltk.training.updates.distill import load_teacher, teacher_folders
from rltk.training.step.forward import old_logprobs_pass
from rltk.training.stages.loop_state import RLParts, rl_provides, rl_steps, start_rl_stage
from rltk.training.step.ranks import global_masked_mean
from rltk.training.updates.rl import policy_update
from rltk.training.rollouts.rollout_source import open_rollout_source
from rltk.training.stages.run import Stage, build_rl_strategy, finish_run, open_run, run_stages
from rltk.training.stages.sft_stage import run_sft_stage
from rltk.training.stages.step_end import end_step, evaluate_at_start

# What this loop serves its components (checked by `rltk run` / `rltk validate`): the teacher's log-probs
# besides every RL step's fields (loop_state.RL_STEP_FIELDS). No KL reference, no greedy baseline, no
# expert data.
PROVIDES = rl_provides("teacher_logprobs")


def run_distill_stage(stage: Stage):
    run, cfg = stage.run, stage.cfg
    a, t = cfg.algorithm, cfg.trainer
    strategy = build_rl_strategy(stage)  # the schedule counts optimizer steps
    workflow = run.workflow

    # The teacher: loaded once, refused (exit 2) when its tokenizer is not the student's
    teacher = load_teacher(cfg.distill.teacher_path, run.tokenizer, strategy, dtype=cfg.distill.teacher_dtype)
    parts = RLParts.from_config(cfg, strategy)  # estimator (on_policy_distill), policy loss, sampling, forward
    loop = start_rl_stage(stage, strategy)  # sampler, buffer, mini-batch order; restored when resumed
    fwd = parts.forward
    evaluate_at_start(stage, loop)  # held-out accuracy before the stage trains

    # Sampled here (trainer.mode=sync), or by producer processes with weights at most
    # trainer.max_staleness versions behind (one_step_off, async); the teacher stays with the trainer.
    with open_rollout_source(stage, strategy, loop, parts) as rollouts:
        # rollout: each step's experiences (sampled now, or a producer's batch) and what to train on, the sample
        # strategy's pick from the buffer (a step with nothing to train on is skipped on every rank)
        for step, tick, rollout, batch in rl_steps(stage, loop, parts, strategy, rollouts):

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
            end_step(stage, loop, step, metrics, strategy, rollouts)
    return strategy  # the trained policy, for the next stage


# The stage types this script runs; `distill` also in any other recipe's `stages` (see grpo.py).
STAGES = {"sft": run_sft_stage, "distill": run_distill_stage}


def main():
    cfg = parse_recipe_args()
    # a missing or unreadable teacher stops the run before its folder is made (the tokenizer check
    # needs the student's tokenizer: load_teacher makes it when the stage starts)
    if any(st.type == "distill" for st in cfg.stages):
        teacher_folders(cfg.distill.teacher_path)
    run = open_run(cfg)  # run folder, student model, data, workflow, loggers, resume point
    run_stages(run, stage_runners(STAGES))  # each stage starts from the weights the one before ended with
    finish_run(run)  # held-out evaluation, curves.png, summary.json


if __name__ == "__main__":
    main()
