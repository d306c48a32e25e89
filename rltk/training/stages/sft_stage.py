"""The supervised stage: cross-entropy on solved examples (the step is :mod:`rltk.training.updates.sft`).

Both the warm-up before RL (``type: sft`` in a GRPO/PPO run's ``stages``) and
``rltk run sft`` (recipes/sft.py, a run of this one stage) run it.
"""

from __future__ import annotations

from rltk.config.env_checks import check_demonstrations
from rltk.data.sampler import RowSampler
from rltk.distributed import process_rank
from rltk.training.rollouts.engine_weights import connect_rollout_engine
from rltk.training.scaffold.evaluation import evaluate, probe
from rltk.training.stages.loop_state import LoopState
from rltk.training.stages.run import Stage, require_rows_per_rank
from rltk.training.scaffold.rows import sft_pairs, tool_schemas
from rltk.training.scaffold.setup import build_processor, build_strategy, samples_every_step
from rltk.training.updates.sft import sft_batch, sft_step
from rltk.training.stages.stage_checkpoint import should_checkpoint


def run_sft_stage(stage: Stage):
    """Supervised warm-up: cross-entropy on solved examples, so the RL stage starts with some accuracy.

    With ``sft.stop_at_accuracy`` the stage ends at the first probe (every
    ``sft.probe_every`` steps) whose accuracy on ``sft.probe_size`` training
    prompts (greedy, or sampled with ``sft.probe=sampled``) reaches it; ``sft.steps`` is then a cap. The
    next stage's global steps follow the step it stopped at (``stage.stopped_at``), so the run's step axis
    has no gap where the rest of the cap would have been.
    """
    run, cfg, s = stage.run, stage.cfg, stage.cfg.sft
    strategy = build_strategy(cfg, run.policy, lr=s.lr, total_steps=s.steps, warmup_steps=s.warmup_steps,
                              lr_schedule=s.lr_schedule)
    require_rows_per_rank(strategy, "sft.batch_size", s.batch_size)
    probing = s.stop_at_accuracy is not None
    if probing:  # the probe samples from the weights being trained (a whole copy under ZeRO-3)
        connect_rollout_engine(run.workflow.engine, strategy)
    # Otherwise nothing samples during this stage, so the rollout engine is not pointed at the
    # strategy's weights (under ZeRO-3 that would cost a whole copy for nothing).
    probe_rows = run.train_rows[: s.probe_size]
    # a VLM's rows with images go through its processor, as the rollout's prompts do
    processor = build_processor(cfg, run.tokenizer) if any(row.get("images") for row in run.train_rows) else None
    pairs = sft_pairs(run.train_rows, run.tokenizer, s.completion_key, tools=tool_schemas(cfg), processor=processor)
    # before the first step of a run with RL: tools and turn caps fit the rollout
    if any(samples_every_step(st.type) for st in run.cfg.stages):
        check_demonstrations(cfg, run.train_rows, pairs)  # (`rltk run sft` samples only to evaluate)
    sampler = RowSampler(pairs, s.batch_size, seed=cfg.seed + stage.index, shuffle=cfg.data.shuffle)
    loop = LoopState(sampler)
    stage.checkpoint.restore(strategy, loop)
    evaluating = bool(s.eval_every)  # held-out accuracy during the stage (`rltk run sft`); off in a warm-up
    if evaluating:  # generation reads the weights being trained (a whole copy under ZeRO-3)
        if not probing:
            connect_rollout_engine(run.workflow.engine, strategy)
        if loop.step == 0:
            run.metric_log.log_evaluation(evaluate(run.workflow, run.eval_rows, cfg), stage.first_step)

    for step in range(loop.step + 1, s.steps + 1):
        # every rank draws the same global batch and trains on its share of the rows
        batch = sft_batch(sampler.next_batch()[strategy.data_rank :: strategy.data_world_size], run.tokenizer.pad_token_id)
        metrics = {f"sft/{k}": v for k, v in sft_step(
            strategy, batch, micro_batch_size=cfg.trainer.micro_batch_size, impl=cfg.model.logprob_impl,
            chunk_size=cfg.model.logprob_chunk_size, max_tokens_per_micro_batch=cfg.trainer.max_tokens_per_micro_batch,
            pack_sequences=cfg.trainer.pack_sequences).items()}
        reached = False
        if evaluating and (step % s.eval_every == 0 or step == s.steps):
            run.workflow.engine.update_weights(strategy.unwrap())
            metrics.update(evaluate(run.workflow, run.eval_rows, cfg))
        if probing and step % s.probe_every == 0:
            run.workflow.engine.update_weights(strategy.unwrap())  # colocated engines share the module: a no-op
            probed = probe(run.workflow, probe_rows, cfg, sampled=s.probe == "sampled")
            metrics["sft/train_accuracy"] = probed["accuracy"]
            # a probe at accuracy 0 with every episode cut says "raise the length cap", not "train longer"
            metrics["sft/probe_truncated_fraction"] = probed.get("truncated_fraction", 0.0)
            reached = metrics["sft/train_accuracy"] >= s.stop_at_accuracy
        run.metric_log.log(metrics, stage.first_step + step)
        stage.guard.observe(metrics, step, strategy)  # stop here if the warm-up has diverged
        last = step if reached else s.steps
        loop.step = step
        if should_checkpoint(cfg, step, last):
            stage.checkpoint.save(strategy, loop, last_step=last)
        if reached:
            stage.stopped_at = step
            if process_rank() == 0:
                print(f"rltk: warm-up reached sft.stop_at_accuracy={s.stop_at_accuracy} "
                      f"(train accuracy {metrics['sft/train_accuracy']:.3f}) at step {step} of {s.steps}")
            break
    return strategy
