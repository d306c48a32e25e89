"""A stage's checkpoints: when to write one (:func:`should_checkpoint`), and what goes in and comes back
out (:class:`StageCheckpoint`, save and restore side by side)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

import rltk
from rltk.distributed import every_rank, process_rank
from rltk.training.scaffold.resume import STAGE_ENDS_KEY
from rltk.training.scaffold.setup import layout_of_run

if TYPE_CHECKING:  # the loop state is built above this module; only its type is named here
    from rltk.strategies.layout import ParallelLayout
    from rltk.training.stages.loop_state import LoopState

RANKS_PER_DATA_SHARE_KEY = "ranks_per_data_share"  # how many consecutive ranks held the same rows at the save
PER_RANK_KEY = "per_rank"  # checkpoint state: one JSON-able dict per rank, in rank order (see rank_state)
REWARD_STATE_KEY = "reward_counters"  # in each rank's dict: its RewardComposer.state_dict()
WORKFLOW_STATE_KEY = "workflow"  # in each rank's dict: its workflow's state_dict()
LOG_ROWS_KEY = "log_rows_at_step"  # checkpoint state: metric rows logged at its step before it was saved
GUARD_KEY = "guard"  # checkpoint state: the divergence guard's counters


def should_checkpoint(cfg: DictConfig, step: int, last: int) -> bool:
    """Whether stage step ``step`` (of ``last``) is checkpointed: every ``checkpoint.every`` steps and a
    stage's last step, or never when ``checkpoint.every`` is 0.

    0 means no checkpoint at all, the final one included: nothing after a stage reads its checkpoint
    (the next stage and the final evaluation take the trained module from the strategy), so a run
    that will not be resumed need not write the weights and optimizer state.
    """
    every = cfg.checkpoint.every
    return every > 0 and (step == last or step % every == 0)


class StageCheckpoint:
    """A stage's checkpoint, written by :meth:`save` and read back by :meth:`restore`, side by side.

    What it holds beside the strategy's state (weights, optimizer, RNG): the loop's
    :meth:`~rltk.training.stages.loop_state.LoopState.state_dict` (the same on every rank; the main rank's is
    saved), the divergence guard's counters, the global step each finished stage ended at, one entry per
    rank (its buffer, its workflow's state, its reward counters: :func:`rank_state` gives a rank its own
    back) and how many metric rows were logged at its step. The loop's generators go into the rank's RNG
    file by name. The workflow's state and the reward counters are restored when the run opens
    (:func:`restore_rollout_state`), since a run may resume at the end of an earlier stage; the rest when
    the stage itself resumes (:meth:`restore`).
    """

    def __init__(self, stage):
        self.stage = stage  # the rltk.training.stages.run.Stage it belongs to (which holds it: no import back up)

    def save(self, checkpointed, loop: LoopState, *, last_step: int) -> Path:
        """Checkpoint ``checkpointed`` (the strategy, or e.g. a policy and its critic) and ``loop`` at
        ``loop.step`` of ``last_step``, then call the ``rltk_on_checkpoint`` hook. Collective: every rank
        calls it.

        The divergence guard first checks the weights are finite (no checkpoint ever holds nan). The
        count of metric rows already logged at its step lets a run resumed from it drop the rows
        logged there after the save (see :func:`rltk.training.stages.run.open_run`).
        """
        stage, stage_step = self.stage, loop.step
        state = {"stage": stage.index, "stage_done": stage_step == last_step, **loop.state_dict()}
        if stage.guard is not None:
            stage.guard.check_weights(checkpointed, stage_step)
            state[GUARD_KEY] = stage.guard.state_dict()
        mine = loop.rank_state_dict()
        workflow = stage.run.workflow
        mine[WORKFLOW_STATE_KEY] = workflow.state_dict()
        if hasattr(workflow.reward, "state_dict"):  # a reward is any callable; the composer keeps counters
            mine[REWARD_STATE_KEY] = workflow.reward.state_dict()
        state[PER_RANK_KEY] = every_rank(mine)
        layout = layout_of_run(stage.run.cfg)
        state[RANKS_PER_DATA_SHARE_KEY] = layout.world_size // layout.data_world_size
        global_step = stage.first_step + stage_step
        # where each finished stage ended: a resumed run numbers the stages after them on from there
        state[STAGE_ENDS_KEY] = stage.run.stage_ends[: stage.index] + ([global_step] if state["stage_done"] else [])
        state[LOG_ROWS_KEY] = sum(1 for row in stage.run.metric_log.history if row["step"] == global_step)
        path = stage.run.ckpt.save(global_step, checkpointed, state, generators=loop.generators)
        rltk.call_lifecycle_hook("rltk_on_checkpoint", step=global_step, path=path)
        return path

    def restore(self, checkpointed, loop: LoopState) -> bool:
        """Continue from the stage's checkpoint: ``checkpointed``'s state, the RNG, ``loop``'s state and this
        rank's buffer, and the guard's counters. Returns whether the checkpoint held this rank's buffer;
        a no-op returning False for a stage that starts afresh."""
        stage = self.stage
        if stage.resume is None:
            return False
        # the generators continue where they stopped: seeding them again would replay their draws
        state = stage.run.ckpt.load(stage.resume["path"], checkpointed, generators=loop.generators)
        buffer_restored = loop.load_state_dict(state, rank_state(state, layout_of_run(stage.run.cfg)))
        if stage.guard is not None:
            stage.guard.load_state_dict(state.get(GUARD_KEY, {}))  # count on from where it stopped
        return buffer_restored

    def keep_reference(self, reference) -> None:
        """The stage's frozen reference beside its checkpoints: saved as the stage starts afresh, loaded
        back when it resumes, so a resumed stage compares against the same one (None: no reference)."""
        if reference is None:
            return
        path = self.stage.run.run_dir / "stage_weights" / f"stage_{self.stage.index}_reference.safetensors"
        if self.stage.resume is not None:
            reference.load(path)
        else:
            reference.save(path)


def rank_state(state: dict, layout: "ParallelLayout") -> dict:
    """This rank's ``rank_extra`` (and reward counters) from a checkpoint's state, see :func:`save_checkpoint`.

    Empty when the checkpoint holds none for this rank: written by an older
    rltk, or by fewer processes than run now.
    """
    ranks = state.get(PER_RANK_KEY) or []
    rank = process_rank()
    # saved at another layout with as many data ranks: the entry of the saved rank holding this one's rows
    # (a sequence or tensor group's ranks keep the same state; rltk.checkpoint.saved_rank_of does the same)
    saved_group = int(state.get(RANKS_PER_DATA_SHARE_KEY, 1))
    if len(ranks) != layout.world_size and len(ranks) // saved_group == layout.data_world_size:
        rank = layout.data_rank(rank) * saved_group
    return ranks[rank] if rank < len(ranks) else {}


def restore_rollout_state(workflow, resume: dict, layout: "ParallelLayout") -> None:
    """Let ``workflow`` and its reward continue from a checkpoint's state, each rank from its own entry.

    The workflow's state keeps group ids unique across the resume (a sample
    strategy may train on experiences from before it). The reward's
    counters, logged as ``reward_fn/calls``, ``failures/*`` and
    ``timeouts/*``, are cumulative over the run, evaluations included;
    restored, a resumed run logs the numbers the uninterrupted one would. A
    checkpoint without them (older rltk, or components without
    ``state_dict``) leaves them where they start.
    """
    saved = rank_state(resume, layout)
    if WORKFLOW_STATE_KEY in saved:
        workflow.load_state_dict(saved[WORKFLOW_STATE_KEY])
    if REWARD_STATE_KEY in saved and hasattr(workflow.reward, "load_state_dict"):  # a reward is any callable
        workflow.reward.load_state_dict(saved[REWARD_STATE_KEY])
