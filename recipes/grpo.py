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

Every named piece comes from the registry, so any of them is one config entry away.
This file is a script, not a module: copy it to change the loop itself.
"""

from __future__ import annotations

import time

import torch

import rltk
from rltk.algorithms.kl import apply_kl_penalty
from rltk.batch import collate
from rltk.buffer.buffer import ExperienceBuffer
from rltk.data.sampler import RowSampler
from rltk.models.logprobs import prompt_sharing_applies
from rltk.recipe_utils import parse_recipe_args
from rltk.training.collect import RolloutPlan, collect_experiences, expert_experiences
from rltk.training.reference import FrozenReference
from rltk.training.rl import (
    LossComponents, build_kl_controller, compute_advantages, fill_old_logprobs, old_logprobs_from_update,
    policy_update, rollout_metrics, any_rank, global_masked_mean,
)
from rltk.training.run import (
    Stage, build_stage_strategy, evaluate, finish_run, open_run, rank_state, require_rows_per_rank, run_sft_stage,
    run_stages, save_checkpoint, should_checkpoint,
)
from rltk.training.setup import args_of


# What this loop serves its components. `rltk run` and `rltk validate` read it without running the
# script, to refuse a component the loop cannot feed (e.g. an advantage that needs a critic's values).
# baseline_scores come from one greedy response per prompt when the estimator names them (ReMax);
# reward_components (gdpo) and sum_pi_squared (optimal_token_baseline) only when the estimator names them;
# expert experiences from buffer.expert.path (for buffer.sample_strategy=mix_expert).
PROVIDES = {
    "batch_fields": ["input_ids", "attention_mask", "response_mask", "rollout_logprobs", "has_rollout_logprobs",
                     "token_rewards", "scores", "group_ids", "response_lengths", "baseline_scores", "old_logprobs",
                     "sequence_rewards", "policy_lengths",
                     "ref_logprobs", "reward_components", "sum_pi_squared"],
    "buffer_sources": ["policy"],
    "expert_data": True,
}


def run_rl_stage(stage: Stage) -> None:
    run, cfg = stage.run, stage.cfg
    a, t = cfg.algorithm, cfg.trainer
    per_step = t.mini_batches * t.ppo_epochs  # optimizer steps per RL step: the schedule counts those
    # The rollout engine follows the strategy's weights (ZeRO-3: from a whole copy of its own).
    strategy = build_stage_strategy(stage, lr=t.lr, total_steps=t.total_steps * per_step,
                                    warmup_steps=t.warmup_steps * per_step, lr_schedule=t.lr_schedule)
    policy, workflow = strategy.unwrap(), run.workflow
    require_rows_per_rank(strategy, "trainer.prompts_per_step", t.prompts_per_step)

    # Components, each chosen by name in the config.
    sample_strategy = rltk.get_component("sample_strategy", cfg.buffer.sample_strategy)(
        **args_of(cfg, "buffer.sample_strategy"))
    advantage_fn = rltk.get_component("advantage_fn", a.advantage_fn)
    loss = LossComponents.from_config(cfg)  # policy loss, aggregation, KL estimator, entropy bonus
    kl_ctl = build_kl_controller(cfg)
    buffer = ExperienceBuffer()
    # a greedy response per prompt if the estimator needs baseline_scores; DAPO's dynamic sampling
    plan = RolloutPlan.from_config(cfg, advantage_fn)
    sampler = RowSampler(run.train_rows, t.prompts_per_step, seed=cfg.seed + stage.index, shuffle=cfg.data.shuffle)
    generator = torch.Generator().manual_seed(cfg.seed)
    # one epoch over one mini-batch: no separate old-log-prob pass (see old_logprobs_from_update)
    on_policy = old_logprobs_from_update(loss, advantage_fn, ppo_epochs=t.ppo_epochs, mini_batches=t.mini_batches,
                                         use_rollout_logprobs=a.use_rollout_logprobs, kl_coef=a.kl_coef)

    # The reference and old-policy passes run the way the training forward does (one prompt pass per
    # group only where strategy.model is a plain module): at equal weights their log-probs then match
    # bitwise and the KL gradient at the first step is exactly 0 on every strategy.
    share_prompts = prompt_sharing_applies(strategy.model)

    # The reference policy is the policy as this stage starts (after any warm-up), frozen;
    # its weights are kept beside the checkpoints so a resumed run compares against the same one.
    # With LoRA it is the same module with its adapters switched off (the base model): no copy at all.
    reference = FrozenReference.for_stage(strategy, a.kl_coef)
    reference_file = run.run_dir / "stage_weights" / f"stage_{stage.index}_reference.safetensors"
    start = 0
    if stage.resume is not None:
        # the shuffling generator continues where it stopped: seeding it again would replay its draws
        state = run.ckpt.load(stage.resume["path"], strategy, generators={"minibatch_order": generator})
        workflow.engine.update_weights(policy)  # an engine with a copy of its own takes the restored weights
        sampler.load_state_dict(state["sampler"])
        start = state["stage_step"]
        kl_ctl.value = state["kl_coef"]
        if "buffer" in rank_state(state):  # what the buffer held then: expert data, experiences kept for later
            buffer.load_state_dict(rank_state(state)["buffer"])
        if reference is not None:
            reference.load(reference_file)
    elif reference is not None:
        reference.save(reference_file)
    if stage.resume is None or "buffer" not in rank_state(state):
        # expert responses (buffer.expert.path), for a sample strategy that mixes them in; a resumed
        # buffer has them already (scoring them again would count the reward calls twice)
        buffer.put(expert_experiences(cfg, run.tokenizer, workflow.reward), 0, source=cfg.buffer.expert.source)
    if start == 0:
        run.metric_log.log(evaluate(workflow, run.eval_rows, cfg), stage.first_step)

    for step in range(start + 1, t.total_steps + 1):
        tick = time.perf_counter()
        # rollout: every rank draws the same global batch of prompts and samples its share of it
        # (under dynamic sampling more batches, until enough groups have differing scores)
        experiences, collect_metrics = collect_experiences(workflow, sampler, plan, strategy)
        buffer.put(experiences, step)
        experiences = sample_strategy.sample(buffer, step) if experiences else []
        # e.g. every group filtered out as all-equal: nothing to learn from. Ranks stay in lockstep,
        # so when any rank has nothing, every rank skips the step.
        if any_rank(strategy, not experiences):
            run.metric_log.log({"skipped_empty_batch": 1.0, **collect_metrics, **sample_strategy.metrics()},
                               stage.first_step + step)
            continue
        # gdpo: each reward function's own score, columns in reward.reward_fn order
        batch = collate(experiences, run.tokenizer.pad_token_id,
                        reward_names=workflow.reward.names if plan.reward_components else None)

        # old and reference log-probs of the sampled tokens (+ sum_pi_squared if the estimator names it);
        # an on-policy update (one epoch, one mini-batch) takes the old ones from its own forward instead
        common = dict(micro_batch_size=t.micro_batch_size, max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
                      pack_sequences=t.pack_sequences, temperature=cfg.rollout.temperature,
                      impl=cfg.model.logprob_impl, chunk_size=cfg.model.logprob_chunk_size,
                      share_prompts=share_prompts)
        if not on_policy:
            fill_old_logprobs(policy, batch, advantage_fn, use_rollout_logprobs=a.use_rollout_logprobs, **common,
                              strategy=strategy)
        if reference is not None:
            batch["ref_logprobs"] = reference.logprobs(batch, **common)
            if a.kl_in == "reward":  # fold the penalty into the per-token rewards before advantages
                kl = loss.kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], **loss.kl_penalty_args)
                batch["token_rewards"] = apply_kl_penalty(batch["token_rewards"], kl, kl_ctl.value,
                                                          batch["response_mask"])

        # advantages from the fields the estimator names
        compute_advantages(advantage_fn, batch, args_of(cfg, "algorithm.advantage_fn"), strategy)

        # update: ppo_epochs x mini-batches, one optimizer step each
        update_metrics = policy_update(strategy, batch, loss, kl_coef=kl_ctl.value, mini_batches=t.mini_batches,
                                       ppo_epochs=t.ppo_epochs, generator=generator, **common)
        workflow.engine.update_weights(strategy.unwrap())  # colocated engines share the module: a no-op
        kl_metrics = {}
        if reference is not None:  # KL(pi_old || pi_ref) of the sampled tokens, the update's starting point
            kl = loss.kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], **loss.kl_penalty_args)
            kl_metrics["kl"] = global_masked_mean(kl, batch["response_mask"], strategy)
            kl_ctl.update(kl_metrics["kl"], int(strategy.all_reduce_sum(torch.tensor([len(experiences)])).item()))

        # log
        elapsed = time.perf_counter() - tick
        metrics = {**rollout_metrics(batch, workflow, sample_strategy, elapsed, strategy), **collect_metrics,
                   "kl_coef": kl_ctl.value,
                   **kl_metrics, **update_metrics}
        if t.eval_every and (step % t.eval_every == 0 or step == t.total_steps):
            metrics.update(evaluate(workflow, run.eval_rows, cfg))
        run.metric_log.log(metrics, stage.first_step + step)

        # guard: stop with a clear message if the run has diverged (entropy collapse, nothing trained, nan weights)
        stage.guard.observe(metrics, step, strategy)

        # checkpoint
        if should_checkpoint(cfg, step, t.total_steps):
            save_checkpoint(stage, strategy, step, sampler, last_step=t.total_steps, extra={"kl_coef": kl_ctl.value},
                            rank_extra={"buffer": buffer.state_dict()}, generators={"minibatch_order": generator})


def main():
    cfg = parse_recipe_args()
    run = open_run(cfg)  # run folder, model, data, workflow, loggers, resume point
    run_stages(run, {"sft": run_sft_stage, "rl": run_rl_stage})
    finish_run(run)  # held-out evaluation, curves.png, summary.json


if __name__ == "__main__":
    main()
