"""One StageContext replaces the (stage, loop, parts, strategy) a loop's helpers took apart (issue 55, item 3); the
old call forms keep working for a release, each with a DeprecationWarning naming the new one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rltk.config import load_config
from rltk.training.rollouts.rollout_source import SyncRollouts, open_rollout_source
from rltk.training.stages.loop_state import LoopState, StageContext, rl_steps
from rltk.training.stages.step_end import end_step, evaluate_at_start


class Recorder:
    """Records the calls the end of a step makes on the run's log, the guard and the checkpoint."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def a_stage(**trainer):
    overrides = ["trainer.eval_every=0", "checkpoint.every=2", "trainer.total_steps=4",
                 *(f"trainer.{k}={v}" for k, v in trainer.items())]
    log, guard, checkpoint = Recorder(), Recorder(), Recorder()
    run = SimpleNamespace(metric_log=log, workflow=SimpleNamespace(name="workflow"))
    return SimpleNamespace(run=run, cfg=load_config([], overrides), first_step=10, guard=guard, checkpoint=checkpoint)


class CountingRollouts:
    def __init__(self):
        self.calls = []

    def cursor(self, step):
        self.calls.append(("cursor", step))
        return {"taken": step}

    def commit(self, step):
        self.calls.append(("commit", step))


def test_end_step_with_a_context_logs_guards_and_checkpoints_what_the_context_saves():
    stage = a_stage()
    loop, critic_pair = LoopState(sampler=None), object()
    rollouts = CountingRollouts()
    end_step(StageContext(stage, loop, "policy strategy", checkpointed=critic_pair), 2, {"loss": 1.0}, rollouts)
    assert stage.run.metric_log.calls == [("log", ({"loss": 1.0}, 12), {})]  # at the run's global step
    assert stage.guard.calls == [("observe", ({"loss": 1.0}, 2, critic_pair), {})]
    assert stage.checkpoint.calls == [("save", (critic_pair, loop), {"last_step": 4})]
    assert loop.step == 2 and loop.queue_cursor == {"taken": 2} and rollouts.calls == [("cursor", 2), ("commit", 2)]
    # without a critic the strategy is what is guarded and saved
    end_step(StageContext(stage, loop, "policy strategy"), 4, {"loss": 0.5})
    assert stage.checkpoint.calls[-1] == ("save", ("policy strategy", loop), {"last_step": 4})


def test_the_old_forms_warn_and_do_the_same():
    new, old = a_stage(), a_stage()
    loops = LoopState(sampler=None), LoopState(sampler=None)
    end_step(StageContext(new, loops[0], "strategy"), 2, {"x": 1.0})
    with pytest.warns(DeprecationWarning, match=r"end_step\(stage, loop, step, metrics, checkpointed, rollouts\) is "
                                                r"deprecated: call end_step\(ctx, step, metrics, rollouts\)"):
        end_step(old, loops[1], 2, {"x": 1.0}, "strategy")
    for recorder in ("guard", "checkpoint"):
        assert [c[0] for c in getattr(new, recorder).calls] == [c[0] for c in getattr(old, recorder).calls]
    assert new.run.metric_log.calls == old.run.metric_log.calls and loops[0].step == loops[1].step == 2
    with pytest.warns(DeprecationWarning, match=r"end_step\(stage, loop"):  # rollouts by keyword, as recipes wrote it
        end_step(old, loops[1], 4, {"x": 1.0}, "strategy", rollouts=CountingRollouts())

    resumed = LoopState(sampler=None, step=3)  # not at the stage's start: no opening evaluation in either form
    evaluate_at_start(StageContext(new, resumed, "strategy"))
    with pytest.warns(DeprecationWarning, match=r"evaluate_at_start\(stage, loop\)"):
        evaluate_at_start(old, resumed)
    assert new.run.metric_log.calls == old.run.metric_log.calls[:1]

    sampler, parts = object(), SimpleNamespace(plan="the rollout plan")
    source = open_rollout_source(StageContext(new, LoopState(sampler=sampler), "strategy", parts))
    with pytest.warns(DeprecationWarning, match=r"open_rollout_source\(stage, strategy, loop, parts\)"):
        old_source = open_rollout_source(old, "strategy", LoopState(sampler=sampler), parts)
    for s in (source, old_source):
        assert isinstance(s, SyncRollouts) and (s.sampler, s.plan, s.strategy) == (sampler, "the rollout plan", "strategy")

    done = LoopState(sampler=None, step=4)  # every step taken: nothing left to yield
    assert list(rl_steps(StageContext(new, done, "strategy", parts), None)) == []
    with pytest.warns(DeprecationWarning, match=r"rl_steps\(stage, loop, parts, strategy, rollouts\)"):
        assert list(rl_steps(old, done, parts, "strategy", None)) == []
