"""Where an RL step's experiences come from: one interface, sampled here (sync) or by producers (async).

A recipe's loop reads the same whatever ``trainer.mode`` is::

    with open_rollout_source(ctx) as rollouts:              # closed however the stage ends
        for step, tick, rollout, batch in rl_steps(ctx, rollouts):  # take, pick
            ... train ...
            rollouts.after_update(step)                  # async: publish the weights every sync_every steps
            end_step(ctx, step, metrics, rollouts)       # rollouts.cursor, checkpoint, rollouts.commit

:class:`SyncRollouts` samples with the trainer's own engine on every rank
(``trainer.mode=sync``); :class:`rltk.training.rollouts.asynchronous.async_rollout.AsyncRollouts`
takes batches a producer process sampled with older weights (``one_step_off``,
``async``; the async wing, :mod:`rltk.training.rollouts.asynchronous`, imported only then). Another
source (one fed over the network, say) implements :class:`RolloutSource` and plugs in the same way.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from rltk.notices import warn_old_call
from rltk.training.rollouts.collect import Rollout, collect_experiences, produced_metrics

if TYPE_CHECKING:
    from rltk.training.rollouts.asynchronous.async_rollout import AsyncRollouts


class RolloutSource(Protocol):
    """What an RL loop asks of where its experiences come from."""

    def take(self, step: int) -> Rollout:
        """Training step ``step``'s experiences for this rank."""

    def after_update(self, step: int) -> None:
        """Called after step ``step``'s update, trained or skipped (versions count steps)."""

    def cursor(self, step: int) -> dict | None:
        """Called right before the checkpoint of step ``step`` is saved: what steps ``1..step`` took from
        the source, kept in the checkpoint (``LoopState.queue_cursor``) and checked by the source a resume
        opens (None: nothing to check)."""

    def commit(self, step: int) -> None:
        """Called right after the checkpoint of step ``step`` is saved."""

    def close(self) -> None:
        """Called once when the stage ends, however it ends."""

    def __enter__(self) -> RolloutSource:
        """A source is used with ``with``: :meth:`close` runs however the stage ends."""

    def __exit__(self, *exc_info) -> None:
        """:meth:`close`."""


class _Closes:
    """``with source:`` closes it however the stage ends."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class SyncRollouts(_Closes):
    """Sampling on every rank with the trainer's own engine and current weights (``trainer.mode=sync``):
    every rank draws the same global batch of prompts and samples its share (under dynamic sampling
    more batches, until enough groups have differing scores)."""

    def __init__(self, workflow, sampler, plan, strategy):
        self.workflow, self.sampler, self.plan, self.strategy = workflow, sampler, plan, strategy

    def take(self, step: int) -> Rollout:
        tick = time.perf_counter()
        experiences, metrics = collect_experiences(self.workflow, self.sampler, self.plan, self.strategy)
        metrics["time/rollout_s"] = time.perf_counter() - tick
        return Rollout(experiences, metrics)

    def after_update(self, step: int) -> None:
        """Nothing to send: the engine samples with the module the strategy trains."""

    def cursor(self, step: int) -> dict | None:
        """Nothing to check on resume: the prompt sampler's position is in the loop state already."""
        return None

    def commit(self, step: int) -> None:
        """Nothing to settle: nothing was sampled ahead."""

    def close(self) -> None:
        """Nothing to stop."""


class ProducedRollouts(_Closes):
    """:class:`AsyncRollouts` as a :class:`RolloutSource`: a step's experiences are the producers' oldest
    batch within the staleness bound (``staleness/*`` says how old; ``time/rollout_s`` is the wait)."""

    def __init__(self, rollouts: AsyncRollouts):
        self.rollouts = rollouts

    def take(self, step: int) -> Rollout:
        tick = time.perf_counter()
        lease = self.rollouts.take(step)
        metrics = {**produced_metrics(lease.experiences), **lease.metrics}
        metrics["time/rollout_s"] = time.perf_counter() - tick
        # the producers' policy versions, which staleness (the traces' too) counts from
        return Rollout(lease.experiences, metrics, lease.sampled_versions)

    def after_update(self, step: int) -> None:
        self.rollouts.after_update(step)  # every trainer.sync_every steps, the producers' next weights

    def cursor(self, step: int) -> dict | None:
        return self.rollouts.cursor(step)  # a resume refuses a queue that does not hold it

    def commit(self, step: int) -> None:
        self.rollouts.commit(step)  # the queue's leases of steps <= step are consumed, exactly once

    def close(self) -> None:
        self.rollouts.close()


def open_rollout_source(ctx, *old) -> RolloutSource:
    """The stage's source by ``trainer.mode``: :class:`SyncRollouts`, or producers started now
    (``one_step_off``/``async``: they sample with weights at most ``trainer.max_staleness`` steps old):
    processes beside the trainer, or with ``launcher=ray`` Ray actors on the cluster's nodes
    (:class:`rltk.training.rollouts.asynchronous.ray_source.RayRollouts`). Collective with several ranks.

    ``ctx`` is the stage's :class:`rltk.training.stages.loop_state.StageContext` (the old form
    ``open_rollout_source(stage, strategy, loop, parts)`` works for one release)."""
    if old:
        warn_old_call("open_rollout_source(stage, strategy, loop, parts)", "open_rollout_source(ctx)")
        stage, (strategy, loop, parts) = ctx, old
    else:
        stage, strategy, loop, parts = ctx.stage, ctx.strategy, ctx.loop, ctx.parts
    if stage.cfg.trainer.mode == "sync":
        return SyncRollouts(stage.run.workflow, loop.sampler, parts.plan, strategy)
    # the async wing is imported only by a stage that runs it (rltk.training.rollouts.asynchronous)
    if stage.cfg.get("launcher", "local") == "ray":  # producers as Ray actors on other nodes; imports Ray
        from rltk.training.rollouts.asynchronous.ray_source import RayRollouts as source
    else:
        from rltk.training.rollouts.asynchronous.async_rollout import AsyncRollouts as source
    # a resumed stage goes on only from the queue its checkpoint trained from (loop.queue_cursor)
    return ProducedRollouts(source.start(stage, strategy, resumed_step=loop.step, cursor=loop.queue_cursor))
