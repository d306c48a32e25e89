"""Rejection-sampling fine-tuning (RFT) as a stage: sample, keep what the reward accepts, SFT on it.

Yuan et al. 2023, "Scaling Relationship on Learning Mathematical Reasoning with Large Language Models"
(arXiv:2308.01825), Sec. 3.3; the same step is STaR's inner loop without rationalization (Zelikman et al.
2022, arXiv:2203.14465). Each step (round):

    rows     <- trainer.prompts_per_step prompts
    y_1..n   ~ pi(. | x)                       (rollout.n samples per prompt, scored by reward.reward_fn)
    D        <- the responses with score > 0                                (the reward accepts them)
    update   <- one optimizer step of - sum_{(x,y) in D} sum_t log pi(y_t | x, y_<t) / sum |y|   (trainer.lr)

A prompt none of whose samples is accepted teaches nothing this round; a round in which some process
keeps nothing is skipped on every process (logged as ``skipped_empty_batch``). Written only on
:mod:`rltk.recipes`, the face a recipe script uses: copy it to write a loop of your own.
"""

from __future__ import annotations

import time

import torch

from rltk.recipes import (
    LoopState, RolloutPlan, RowSampler, StageContext, any_rank, build_stage_strategy, collect_experiences, end_step,
    evaluate_at_start, require_rows_per_rank, sft_batch, sft_step,
)


def accepted(experiences) -> list:
    """The experiences the reward accepts (score > 0). A correct answer sampled k times is kept k times, so a
    prompt's accepted answers weigh as often as the policy found them (STaR keeps every one; RFT's
    deduplication would weigh a prompt solved once as much as one solved every time)."""
    return [e for e in experiences if e.score > 0]


def run_rft_stage(stage):
    """Rejection-sampling fine-tuning: each step samples, keeps the accepted responses, and trains on them."""
    run, cfg = stage.run, stage.cfg
    t = cfg.trainer
    # the rollout engine samples from the weights being trained (a whole copy under ZeRO-3)
    strategy = build_stage_strategy(stage, lr=t.lr, total_steps=t.total_steps, warmup_steps=t.warmup_steps,
                                    lr_schedule=t.lr_schedule)
    require_rows_per_rank(strategy, "trainer.prompts_per_step", t.prompts_per_step)
    sampler = RowSampler(run.train_rows, t.prompts_per_step, seed=cfg.seed + stage.index, shuffle=cfg.data.shuffle)
    loop = LoopState(sampler)
    stage.checkpoint.restore(strategy, loop)
    if stage.resume is not None:
        run.workflow.engine.update_weights(strategy.unwrap())  # an engine with a copy of its own takes them
    ctx = StageContext(stage, loop, strategy)  # what the loop's helpers take
    evaluate_at_start(ctx)  # held-out accuracy before the stage trains

    for step in range(loop.step + 1, t.total_steps + 1):
        tick = time.perf_counter()
        # sample: n responses per prompt, each scored by the reward functions
        experiences, metrics = collect_experiences(run.workflow, sampler, RolloutPlan(), strategy)
        # filter: what the reward accepts (counted over every process)
        kept = accepted(experiences)
        sampled, n_kept, score = strategy.all_reduce_sum(torch.tensor(
            [len(experiences), len(kept), sum(e.score for e in experiences)], dtype=torch.float64)).tolist()
        metrics.update({"reward": score / max(sampled, 1.0), "rft/kept_fraction": n_kept / max(sampled, 1.0)})
        if any_rank(strategy, not kept):  # ranks stay in lockstep: all skip the round
            run.metric_log.log({"skipped_empty_batch": 1.0, **metrics}, stage.first_step + step)
            continue
        # update: one optimizer step of cross-entropy on the kept responses (the policy's tokens only); logged
        # under sft/ as the supervised stage's, which the divergence guard reads
        batch = sft_batch([(e.prompt_ids, e.response_ids, e.response_mask) for e in kept], run.tokenizer.pad_token_id)
        metrics.update({f"sft/{k}": v for k, v in sft_step(
            strategy, batch, micro_batch_size=t.micro_batch_size, impl=cfg.model.logprob_impl,
            chunk_size=cfg.model.logprob_chunk_size, max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
            pack_sequences=t.pack_sequences).items()})
        run.workflow.engine.update_weights(strategy.unwrap())  # colocated engines share the module: a no-op

        # log, evaluate, guard, checkpoint
        metrics["time/step_s"] = time.perf_counter() - tick
        end_step(ctx, step, metrics)
    return strategy  # the trained policy, for the next stage
