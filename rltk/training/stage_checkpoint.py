"""A stage's checkpoints: when to write one, what goes in beside the weights, and how a rank gets its own back.

Beside the strategy's state (weights, optimizer, RNG), a checkpoint holds the
loop's :meth:`~rltk.training.loop_state.LoopState.state_dict` (the same on every
rank), the divergence guard's counters, one entry per rank (its buffer, its
workflow's state, its reward counters) and how many metric rows were logged at
its step.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

import rltk
from rltk.distributed import every_rank, process_rank

if TYPE_CHECKING:
    from rltk.training.loop_state import LoopState
    from rltk.training.run import Stage

PER_RANK_KEY = "per_rank"  # checkpoint state: one JSON-able dict per rank, in rank order (see rank_state)
REWARD_STATE_KEY = "reward_counters"  # in each rank's dict: its RewardComposer.state_dict()
WORKFLOW_STATE_KEY = "workflow"  # in each rank's dict: its workflow's state_dict()
LOG_ROWS_KEY = "log_rows_at_step"  # checkpoint state: metric rows logged at its step before it was saved


def should_checkpoint(cfg: DictConfig, step: int, last: int) -> bool:
    """Whether stage step ``step`` (of ``last``) is checkpointed: every ``checkpoint.every`` steps and a
    stage's last step, or never when ``checkpoint.every`` is 0.

    0 means no checkpoint at all, the final one included: nothing after a stage reads its checkpoint
    (the next stage and the final evaluation take the trained module from the strategy), so a run
    that will not be resumed need not write the weights and optimizer state.
    """
    every = cfg.checkpoint.every
    return every > 0 and (step == last or step % every == 0)


def save_checkpoint(stage: Stage, strategy, loop: LoopState, *, last_step: int) -> Path:
    """Checkpoint the stage's strategy (or strategies) and its loop state at ``loop.step``, then call the hook.

    The divergence guard first checks the weights are finite (no checkpoint ever holds nan) and
    its counters go into the checkpoint, so a resumed run counts on.

    The loop's :meth:`~rltk.training.loop_state.LoopState.state_dict` is the
    same on every rank (the main rank's is saved); its ``rank_state_dict``
    (e.g. the experience buffer) differs per rank: every rank's is saved,
    beside its workflow's state and cumulative reward counters (see
    :func:`restore_rollout_state`), and :func:`rank_state` of the loaded state
    gives a rank its own back. The loop's generators go into the rank's RNG
    file by name (:meth:`LoopState.resume` restores them). The checkpoint also
    counts the metric rows already logged at its step, so a run resumed from
    it drops the rows logged there after the save (see :func:`rltk.training.run.open_run`).
    Collective: every rank calls it.
    """
    stage_step = loop.step
    state = {"stage": stage.index, "stage_done": stage_step == last_step, **loop.state_dict()}
    if stage.guard is not None:
        stage.guard.check_weights(strategy, stage_step)
        state["guard"] = stage.guard.state_dict()
    mine = loop.rank_state_dict()
    workflow = stage.run.workflow
    if hasattr(workflow, "state_dict"):
        mine[WORKFLOW_STATE_KEY] = workflow.state_dict()
    if hasattr(workflow.reward, "state_dict"):
        mine[REWARD_STATE_KEY] = workflow.reward.state_dict()
    state[PER_RANK_KEY] = every_rank(mine)
    global_step = stage.first_step + stage_step
    state[LOG_ROWS_KEY] = sum(1 for row in stage.run.metric_log.history if row["step"] == global_step)
    path = stage.run.ckpt.save(global_step, strategy, state, generators=loop.generators)
    rltk.call_lifecycle_hook("rltk_on_checkpoint", step=global_step, path=path)
    return path


def rank_state(state: dict) -> dict:
    """This rank's ``rank_extra`` (and reward counters) from a checkpoint's state, see :func:`save_checkpoint`.

    Empty when the checkpoint holds none for this rank: written by an older
    rltk, or by fewer processes than run now.
    """
    ranks = state.get(PER_RANK_KEY) or []
    rank = process_rank()
    return ranks[rank] if rank < len(ranks) else {}


def restore_rollout_state(workflow, resume: dict) -> None:
    """Let ``workflow`` and its reward continue from a checkpoint's state, each rank from its own entry.

    The workflow's state keeps group ids unique across the resume (a sample
    strategy may train on experiences from before it). The reward's
    counters, logged as ``reward_fn/calls``, ``failures/*`` and
    ``timeouts/*``, are cumulative over the run, evaluations included;
    restored, a resumed run logs the numbers the uninterrupted one would. A
    checkpoint without them (older rltk, or components without
    ``state_dict``) leaves them where they start.
    """
    saved = rank_state(resume)
    for component, key in ((workflow, WORKFLOW_STATE_KEY), (workflow.reward, REWARD_STATE_KEY)):
        if key in saved and hasattr(component, "load_state_dict"):
            component.load_state_dict(saved[key])
