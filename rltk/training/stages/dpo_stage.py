"""The DPO loop and its variants (IPO, SLiC hinge, cDPO), offline from preference pairs or online from samples.

Rafailov et al. 2023 (arXiv:2305.18290). The algorithm box is ``recipes/dpo.py``'s docstring; the stage
is registered as ``dpo`` (:mod:`rltk.components.builtin_stages`).
"""

from __future__ import annotations

import time

import torch

from rltk.data.preferences import synthetic_preferences
from rltk.data.sampler import RowSampler
from rltk.components.builtin_stages import check_dpo_stage
from rltk.training.rollouts.collect import RolloutPlan, collect_experiences
from rltk.training.scaffold.rows import refuse_image_rows, tool_schemas
from rltk.training.stages.loop_state import LoopState, StageContext
from rltk.training.stages.run import Stage, build_stage_strategy, require_rows_per_rank
from rltk.training.stages.step_end import end_step, evaluate_at_start
from rltk.training.step.forward import ForwardSettings
from rltk.training.step.ranks import any_rank
from rltk.training.step.reference import FrozenReference
from rltk.training.updates.preference import (
    PreferenceLoss, online_pairs, pair_batch, pair_settings, preference_examples, preference_step,
    reference_sequence_logps,
)

# pairs per chunk of the one-off reference pass (precompute_reference)
REFERENCE_CHUNK = 256


def run_dpo_stage(stage: Stage):
    run, cfg = stage.run, stage.cfg
    refuse_image_rows(run.train_rows, cfg, "the dpo stage (its preference pairs)")
    d, t = cfg.dpo, cfg.trainer
    check_dpo_stage(cfg)  # validation ran it too; a script's own run_stages may not have validated
    strategy = build_stage_strategy(stage, lr=t.lr, total_steps=t.total_steps, warmup_steps=t.warmup_steps,
                                    lr_schedule=t.lr_schedule)
    require_rows_per_rank(strategy, "trainer.prompts_per_step", t.prompts_per_step)
    loss = PreferenceLoss.from_config(cfg)
    fwd = pair_settings(ForwardSettings.from_config(cfg, strategy))  # pairs whole in each forward, temperature 1

    # Offline: the dataset's pairs (or the synthetic task's), tokenized once; every rank draws the same
    # global batch of pairs and trains on its share. Online: prompts, answered by the policy each step.
    if d.online:
        sampler = RowSampler(run.train_rows, t.prompts_per_step, seed=cfg.seed + stage.index, shuffle=cfg.data.shuffle)
        plan = RolloutPlan()
    else:
        rows = run.train_rows if cfg.data.path else synthetic_preferences(
            run.train_rows, cfg.seed, chosen_key=d.chosen_key, rejected_key=d.rejected_key)
        pairs = preference_examples(rows, run.tokenizer, chosen_key=d.chosen_key, rejected_key=d.rejected_key,
                                    tools=tool_schemas(cfg))
        sampler = RowSampler(list(range(len(pairs))), t.prompts_per_step, seed=cfg.seed + stage.index,
                             shuffle=cfg.data.shuffle)

    # The reference: the policy as this stage starts, frozen (its weights kept beside the checkpoints, so
    # a resumed stage compares against the same one); with LoRA the same module with its adapters off.
    loop = LoopState(sampler, reference=FrozenReference.for_stage(strategy, kl_coef=1.0))
    stage.checkpoint.restore(strategy, loop)
    if stage.resume is not None:
        run.workflow.engine.update_weights(strategy.unwrap())  # an engine with a copy of its own takes them
    stage.checkpoint.keep_reference(loop.reference)
    reference, precomputed = loop.reference, None
    if d.precompute_reference:  # one pass over the data now, then no reference forward (or copy) per step
        precomputed = torch.cat([
            reference_sequence_logps(reference, pair_batch(pairs[i: i + REFERENCE_CHUNK], run.tokenizer.pad_token_id),
                                     fwd)
            for i in range(0, len(pairs), REFERENCE_CHUNK)]).view(-1, 2)  # [P, 2]: chosen, rejected
        reference = loop.reference = None  # the copy's memory goes (its weights stay beside the checkpoints)
    ctx = StageContext(stage, loop, strategy)
    evaluate_at_start(ctx)  # held-out accuracy before the stage trains

    for step in range(loop.step + 1, t.total_steps + 1):
        tick = time.perf_counter()
        # pairs: the dataset's next ones, or the best and worst of the policy's own samples
        collect_metrics = {}
        if d.online:
            experiences, collect_metrics = collect_experiences(run.workflow, sampler, plan, strategy)
            step_pairs, ref = online_pairs(experiences), None
            # the training reward: the mean score of this step's samples over every rank
            scored = strategy.all_reduce_sum(torch.tensor([sum(e.score for e in experiences), len(experiences)],
                                                          dtype=torch.float64)).tolist()
            collect_metrics["reward"] = scored[0] / max(scored[1], 1.0)
            if any_rank(strategy, not step_pairs):  # every group all-equal on some rank: all ranks skip
                run.metric_log.log({"skipped_empty_batch": 1.0, **collect_metrics}, stage.first_step + step)
                continue
        else:
            index = sampler.next_batch()[strategy.data_rank :: strategy.data_world_size]
            step_pairs = [pairs[i] for i in index]
            ref = precomputed[torch.tensor(index)].reshape(-1) if precomputed is not None else None
        batch = pair_batch(step_pairs, run.tokenizer.pad_token_id)

        # reference log-probs of both responses of every pair
        if ref is None:
            ref = reference_sequence_logps(reference, batch, fwd)

        # update: one optimizer step of the preference loss
        metrics = preference_step(strategy, batch, ref, loss, fwd, nll_coef=d.nll_coef)
        run.workflow.engine.update_weights(strategy.unwrap())  # colocated engines share the module: a no-op

        # log, evaluate, guard, checkpoint
        metrics.update({**collect_metrics, "time/step_s": time.perf_counter() - tick})
        end_step(ctx, step, metrics)
    return strategy  # the trained policy, for the next stage
