"""What every recipe's stage does around its steps: the opening evaluation, and the end of each step
(evaluate, log, guard, checkpoint)."""

from __future__ import annotations

from rltk.notices import warn_old_call
from rltk.training.scaffold.evaluation import evaluate
from rltk.training.stages.loop_state import StageContext
from rltk.training.stages.stage_checkpoint import should_checkpoint


def evaluate_at_start(ctx: StageContext, *old) -> None:
    """Log the held-out evaluation of the weights the stage starts from (not when it resumes mid-way).

    ``ctx`` is the stage's :class:`~rltk.training.stages.loop_state.StageContext` (the old form
    ``evaluate_at_start(stage, loop)`` works for one release)."""
    if not isinstance(ctx, StageContext):
        warn_old_call("evaluate_at_start(stage, loop)", "evaluate_at_start(ctx)")
        stage, (loop,) = ctx, old
    else:
        stage, loop = ctx.stage, ctx.loop
    if loop.step == 0:
        stage.run.metric_log.log_evaluation(evaluate(stage.run.workflow, stage.run.eval_rows, stage.cfg),
                                            stage.first_step)


def end_step(ctx: StageContext, *args, **kwargs) -> None:
    """``end_step(ctx, step, metrics, rollouts=None)``: finish stage step ``step`` with its ``metrics``;
    ``ctx`` is the stage's :class:`~rltk.training.stages.loop_state.StageContext`.

    evaluate   held-out accuracy every ``trainer.eval_every`` steps and at the stage's last step
    log        ``metrics`` at the run's global step
    guard      stop with a clear message if the run has diverged (entropy collapse, nothing trained,
               nan weights); ``ctx.saved`` is what it checks and what the checkpoint holds (the
               strategy, or e.g. a policy and its critic)
    checkpoint every ``checkpoint.every`` steps and at the stage's last step, the loop's position
               included (and the rollout source's cursor, which a resume checks); then
               ``rollouts.commit(step)`` (an asynchronous source's experiences up to ``step`` are
               consumed, exactly once)

    The old form ``end_step(stage, loop, step, metrics, checkpointed, rollouts=None)`` works for one release.
    """
    if not isinstance(ctx, StageContext):
        warn_old_call("end_step(stage, loop, step, metrics, checkpointed, rollouts)",
                      "end_step(ctx, step, metrics, rollouts)")
        _end_step(ctx, *args, **kwargs)
    else:
        _end_step_of(ctx, *args, **kwargs)


def _end_step_of(ctx: StageContext, step: int, metrics: dict, rollouts=None) -> None:
    _end_step(ctx.stage, ctx.loop, step, metrics, ctx.saved, rollouts)


def _end_step(stage, loop, step: int, metrics: dict, checkpointed, rollouts=None) -> None:
    run, cfg = stage.run, stage.cfg
    t = cfg.trainer
    if t.eval_every and (step % t.eval_every == 0 or step == t.total_steps):
        metrics.update(evaluate(run.workflow, run.eval_rows, cfg))
    run.metric_log.log(metrics, stage.first_step + step)
    stage.guard.observe(metrics, step, checkpointed)
    loop.step = step
    if should_checkpoint(cfg, step, t.total_steps):
        if rollouts is not None:
            loop.queue_cursor = rollouts.cursor(step)
        stage.checkpoint.save(checkpointed, loop, last_step=t.total_steps)
        if rollouts is not None:
            rollouts.commit(step)
