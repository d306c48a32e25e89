"""GRPO and its relatives (Dr. GRPO, DAPO, RLOO, REINFORCE++, GSPO, CISPO, ReMax) on one loop.

    rltk run grpo                                  # embedded tiny default: SFT warm-up, then GRPO
    rltk run grpo algorithm.name=rloo              # another preset
    rltk run grpo algorithm.advantage_fn=group_rank model.path=/models/qwen data.path=train.jsonl

The loop, as in the paper's algorithm box:

    for each stage (e.g. a supervised warm-up, then RL):
        for step in 1..N:
            rows        <- next prompts from the dataset
            experiences <- workflow(rows): n samples per prompt, each scored by the reward fns
                           (+ a greedy one per prompt if the estimator needs baseline_scores;
                           dynamic sampling: keep groups whose scores differ, refill from more rows)
            batch       <- sample strategy picks what to train on (+ expert data); padded to tensors
            old / ref log-probs of the sampled tokens
            advantages  <- advantage_fn(batch fields it names)
            update      <- ppo_epochs x mini-batches of policy_loss (+ KL, - entropy)
            log, evaluate on held-out prompts
            guard       <- stop if the run diverged (entropy collapse, nothing trained, nan weights)
            checkpoint

With trainer.mode=one_step_off or async the experiences of a step come instead from a producer process
that samples with weights at most trainer.max_staleness steps old (rltk.training.rollouts.rollout_source); the
rest of the step is the same.

Every named piece comes from the registry, so any of them is one config entry away.
This file is a script, not a module: copy it to change the loop itself.
"""

from __future__ import annotations

import time

from rltk.algorithms.kl import apply_kl_penalty
from rltk.recipe_utils import parse_recipe_args, stage_runners
from rltk.training.step.batch_metrics import rollout_metrics
from rltk.training.stages.loop_state import RLParts, kl_to_reference, rl_provides, rl_steps, start_rl_stage
from rltk.training.step.forward import old_logprobs_pass
from rltk.training.step.moe_metrics import moe_step_metrics
from rltk.training.step.ranks import global_masked_mean, rows_in
from rltk.training.updates.rl import policy_update
from rltk.training.rollouts.rollout_source import open_rollout_source
from rltk.training.stages.run import Stage, build_rl_strategy, finish_run, open_run, run_stages
from rltk.training.stages.sft_stage import run_sft_stage
from rltk.training.stages.step_end import end_step, evaluate_at_start


# What this loop serves its components besides every RL step's fields (loop_state.RL_STEP_FIELDS): `rltk run`
# and `rltk validate` refuse a component the loop cannot feed (e.g. an advantage that needs a critic's values). baseline_scores come from one greedy response per prompt (ReMax), reward_components (gdpo) and
# sum_pi_squared (optimal_token_baseline) from the old-log-prob pass, each only when the estimator names them;
# expert experiences from buffer.expert.path (for buffer.sample_strategy=mix_expert).
PROVIDES = rl_provides("baseline_scores", "reward_components", "sum_pi_squared", "ref_logprobs", expert_data=True)


def run_rl_stage(stage: Stage):
    run, cfg = stage.run, stage.cfg
    a, t = cfg.algorithm, cfg.trainer
    # The schedule counts optimizer steps; the rollout engine follows the strategy's weights (ZeRO-3: from a
    # whole copy of its own).
    strategy = build_rl_strategy(stage)
    workflow = run.workflow

    # Components, each chosen by name in the config: estimator, losses, sample strategy, rollout plan,
    # and how every log-prob pass runs (one epoch over one mini-batch: the update takes the old
    # log-probs from its own forward, see old_logprobs_from_update).
    parts = RLParts.from_config(cfg, strategy)
    # Sampler, buffer (+ expert data), KL controller, mini-batch order, frozen reference; restored
    # from the stage's checkpoint when it resumes.
    loop = start_rl_stage(stage, strategy)
    reference, fwd = loop.reference, parts.forward
    evaluate_at_start(stage, loop)  # held-out accuracy before the stage trains
    # Sampled here (trainer.mode=sync), or by producer processes with weights published every
    # trainer.sync_every steps, at most trainer.max_staleness versions behind (one_step_off, async).
    with open_rollout_source(stage, strategy, loop, parts) as rollouts:
        # rollout: each step's experiences (sampled now, or a producer's batch) and what to train on, the sample
        # strategy's pick from the buffer (a step with nothing to train on is skipped on every rank)
        for step, tick, rollout, batch in rl_steps(stage, loop, parts, strategy, rollouts):
            # old and reference log-probs of the sampled tokens (+ sum_pi_squared if the estimator names it);
            # an on-policy update (one epoch, one mini-batch) takes the old ones from its own forward instead
            if not parts.on_policy:
                batch["old_logprobs"], sum_pi_squared = old_logprobs_pass(
                    strategy.unwrap(), batch, fwd, use_rollout_logprobs=a.use_rollout_logprobs, strategy=strategy,
                    with_sum_pi_squared=parts.estimator.names("sum_pi_squared"))
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
            end_step(stage, loop, step, metrics, strategy, rollouts)
    return strategy  # the trained policy, for the next stage


# The stage types this script runs: `rl` in its own runs, `grpo` in any recipe's `stages` (a config may chain
# sft, dpo, grpo, ppo: each type is the loop of the recipe of that name, see rltk.recipe_utils.stage_runners).
STAGES = {"sft": run_sft_stage, "rl": run_rl_stage, "grpo": run_rl_stage}


def main():
    cfg = parse_recipe_args()
    run = open_run(cfg)  # run folder, model, data, workflow, loggers, resume point
    run_stages(run, stage_runners(STAGES))  # each stage starts from the weights the one before ended with
    finish_run(run)  # held-out evaluation, curves.png, summary.json


if __name__ == "__main__":
    main()
