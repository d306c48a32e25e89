"""What a stage carries from one step to the next, built by one call and saved and restored in one place.

A recipe's loop reads top to bottom like its algorithm box; what it needs to
remember between steps lives here, in :class:`LoopState`:

* the prompt sampler's position;
* the experience buffer (expert data, experiences a sample strategy keeps for later);
* the KL controller's coefficient;
* the generator that shuffles rows into mini-batches;
* the frozen reference policy (its weights beside the checkpoints);
* the stage step reached;
* in an asynchronous stage, the experience queue's cursor: what the steps took from it.

:func:`start_rl_stage` builds it for an RL stage, fresh or restored from the
stage's checkpoint (:class:`rltk.training.stages.stage_checkpoint.StageCheckpoint` saves and restores it). What
the components of a step are (estimator, losses, sample strategy, rollout plan,
forward settings, the step plan) is :class:`RLParts`, chosen once from the config. What every helper of
the loop takes (the stage, its loop state, its parts, the policy's strategy) is one :class:`StageContext`::

    ctx = open_rl_stage(stage, strategy, default="grpo")   # parts, loop state (restored on resume), context
    evaluate_at_start(ctx)
    with open_rollout_source(ctx) as rollouts:
        for step, tick, rollout, batch in rl_steps(ctx, rollouts):
            ...
            end_step(ctx, step, metrics, rollouts)

A loop without RL parts (supervised, DPO, a plugin's) builds ``StageContext(stage, loop, strategy)`` itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from rltk.batch import collate
from rltk.buffer.buffer import ExperienceBuffer
from rltk.config.recipe_capabilities import StepPlan
from rltk.data.sampler import RowSampler
from rltk.models.vision.features import ImageFeatureCache
from rltk.notices import warn_old_call
from rltk.training.rollouts.collect import Rollout, RolloutPlan, expert_experiences
from rltk.training.step.estimator import Estimator
from rltk.training.step.forward import ForwardSettings
from rltk.training.step.loss_components import LossComponents
from rltk.training.step.ranks import any_rank
from rltk.training.step.reference import FrozenReference
from rltk.training.scaffold.setup import args_of
# what a stage on rl_steps provides (kept here under their old names: rltk.recipes exports them too)
from rltk.registration.stage_spec import RL_STEP_FIELDS, rl_provides  # noqa: F401

#: The name of the mini-batch generator in a checkpoint's RNG files (see :meth:`LoopState.generators`).
MINIBATCH_GENERATOR = "minibatch_order"
#: In each rank's checkpoint entry: its buffer's state_dict.
BUFFER_KEY = "buffer"
#: In the checkpoint's state of an asynchronous stage: the experience queue's cursor (:attr:`LoopState.queue_cursor`).
QUEUE_CURSOR_KEY = "experience_queue"


@dataclass
class LoopState:
    """What a stage's loop carries across steps; everything but the reference's weights is checkpointed here.

    Attributes:
        sampler: the prompt (or example) sampler; every rank holds the same one.
        step: the last stage step done (0 before the first).
        buffer: experiences kept across steps (RL stages), per rank.
        kl_ctl: the KL controller; its ``value`` is the coefficient of the next step.
        generator: shuffles rows into mini-batches; each rank's own.
        reference: the frozen reference policy (None without a KL penalty).
        queue_cursor: an asynchronous stage's :meth:`rltk.training.rollouts.asynchronous.queue.ExperienceQueue.cursor` at ``step``,
            set before each checkpoint (main rank): what the checkpoint trained from the queue, which a
            resume checks the queue still holds (None in a synchronous stage).
    """

    sampler: RowSampler
    step: int = 0
    buffer: ExperienceBuffer | None = None
    kl_ctl: Any = None
    generator: torch.Generator | None = None
    reference: FrozenReference | None = None
    queue_cursor: dict | None = None
    # the buffer items (experience, step put, source, sampling version) of the current batch's rows, in row order: what the
    # rollout traces read (not checkpointed; rebuilt every step by sampled_batch)
    batch_items: list | None = None

    def state_dict(self) -> dict:
        """The JSON-able state every rank shares (the main rank's is saved)."""
        state: dict = {"stage_step": self.step, "sampler": self.sampler.state_dict()}
        if self.kl_ctl is not None:
            state["kl_coef"] = self.kl_ctl.value
        if self.queue_cursor is not None:
            state[QUEUE_CURSOR_KEY] = self.queue_cursor
        return state

    def rank_state_dict(self) -> dict:
        """The JSON-able state of this rank alone (its buffer)."""
        return {BUFFER_KEY: self.buffer.state_dict()} if self.buffer is not None else {}

    @property
    def generators(self) -> dict[str, torch.Generator]:
        """This rank's private generators by name: saved with the rank's RNG state, restored by name."""
        return {MINIBATCH_GENERATOR: self.generator} if self.generator is not None else {}

    def load_state_dict(self, state: dict, rank_state: dict | None = None) -> bool:
        """Continue from :meth:`state_dict` (and this rank's :meth:`rank_state_dict`) of a checkpoint;
        returns whether this rank's buffer came back.

        A rank entry without a buffer (an older rltk, or fewer processes then) leaves the buffer as built.
        """
        self.step = int(state["stage_step"])
        self.sampler.load_state_dict(state["sampler"])
        if self.kl_ctl is not None:
            self.kl_ctl.value = state["kl_coef"]
        self.queue_cursor = state.get(QUEUE_CURSOR_KEY)  # None from a synchronous stage, or an older rltk
        if self.buffer is not None and BUFFER_KEY in (rank_state or {}):
            self.buffer.load_state_dict(rank_state[BUFFER_KEY])
            return True
        return False


@dataclass
class RLParts:
    """The components of an RL step, each chosen by name in the config, and how its passes run.

    Attributes:
        estimator: ``algorithm.advantage_fn`` with its arguments; its signature read once.
        loss: policy loss, aggregation, KL estimator, entropy bonus.
        sample_strategy: what the buffer hands the trainer each step.
        plan: what the rollout gathers (the step plan's greedy baseline and reward columns; DAPO's dynamic sampling).
        forward: how every log-prob pass runs (:class:`rltk.training.step.forward.ForwardSettings`).
        step_plan: which pass fills which batch field (:class:`rltk.config.recipe_capabilities.StepPlan`):
            what the loop reads instead of asking the estimator's signature again.
    """

    estimator: Estimator
    loss: LossComponents
    sample_strategy: Any
    plan: RolloutPlan
    forward: ForwardSettings
    step_plan: StepPlan

    @property
    def on_policy(self) -> bool:
        """The update takes ``old_logprobs`` from its own forward (the step plan's
        ``old_logprobs_from_update``): the loop runs no old-log-prob pass before it."""
        return self.step_plan.old_logprobs_from_update

    @classmethod
    def from_config(cls, cfg, strategy, spec=None, stage_type: str = "rl") -> "RLParts":
        """The parts of a stage of type ``stage_type`` whose config is ``cfg`` and whose registered spec is ``spec``
        (:class:`rltk.StageSpec`, what its loop provides; None: nothing declared, see :meth:`StepPlan.build`)."""
        import rltk

        sample_strategy = rltk.get_component("sample_strategy", cfg.buffer.sample_strategy)(
            **args_of(cfg, "buffer.sample_strategy"))
        step_plan = StepPlan.build(cfg, getattr(spec, "provides", None), stage_type)
        return cls(estimator=Estimator.from_config(cfg), loss=LossComponents.from_config(cfg),
                   sample_strategy=sample_strategy, plan=RolloutPlan.from_config(cfg, step_plan),
                   forward=ForwardSettings.from_config(cfg, strategy), step_plan=step_plan)


def build_kl_controller(cfg):
    """``algorithm.kl_controller``: a fixed coefficient or the adaptive target-KL rule."""
    from rltk.algorithms.kl import AdaptiveKLController, FixedKLController

    a = cfg.algorithm
    if a.kl_controller == "adaptive":
        return AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon)
    return FixedKLController(a.kl_coef)


def start_rl_stage(stage, strategy, *, checkpointed=None) -> LoopState:
    """The loop state of an RL stage: built afresh, or continued from the stage's checkpoint.

    ``checkpointed`` is what the checkpoint restores (e.g. policy and critic together), ``strategy``
    by default. The reference policy is the policy as this stage starts (after any warm-up), frozen;
    its weights are kept beside the checkpoints so a resumed run compares against the same one. With
    LoRA it is the same module with its adapters switched off (the base model): no copy at all.
    Expert responses (``buffer.expert.path``) go into a fresh buffer; a resumed buffer has them already
    (scoring them again would count the reward calls twice).
    """
    run, cfg = stage.run, stage.cfg
    t = cfg.trainer
    loop = LoopState(
        sampler=RowSampler(run.train_rows, t.prompts_per_step, seed=cfg.seed + stage.index, shuffle=cfg.data.shuffle),
        buffer=ExperienceBuffer(), kl_ctl=build_kl_controller(cfg), generator=torch.Generator().manual_seed(cfg.seed),
        reference=FrozenReference.for_stage(strategy, cfg.algorithm.kl_coef),
    )
    buffer_restored = stage.checkpoint.restore(checkpointed if checkpointed is not None else strategy, loop)
    if stage.resume is not None:
        run.workflow.engine.update_weights(strategy.unwrap())  # an engine with a copy of its own takes them
    stage.checkpoint.keep_reference(loop.reference)
    if not buffer_restored:
        loop.buffer.put(expert_experiences(cfg, run.tokenizer, run.workflow.reward), 0,
                        source=cfg.buffer.expert.source)
    return loop


@dataclass
class StageContext:
    """What a stage's loop hands each of its helpers.

    Attributes:
        stage: the running :class:`rltk.training.stages.run.Stage` (``cfg``, ``run``, ``checkpoint``, ``guard``).
        loop: what the stage carries from step to step (:class:`rltk.training.stages.loop_state.LoopState`).
        strategy: the training strategy of the policy.
        parts: the RL step's components and step plan (:class:`RLParts`); None in a loop without them.
        checkpointed: what the divergence guard checks and the checkpoint holds when that is more than the
            policy's strategy (PPO: policy and critic together); None: ``strategy``.
    """

    stage: Any
    loop: LoopState
    strategy: Any
    parts: RLParts | None = None
    checkpointed: Any = None

    @property
    def cfg(self):
        """The stage's config."""
        return self.stage.cfg

    @property
    def run(self):
        """The run the stage belongs to."""
        return self.stage.run

    @property
    def saved(self):
        """What the guard checks and the stage's checkpoint saves: ``checkpointed``, else ``strategy``."""
        return self.checkpointed if self.checkpointed is not None else self.strategy


def open_rl_stage(stage, strategy, *, default: str, checkpointed=None) -> StageContext:
    """The context of an RL stage: its parts (with the step plan of the stage's registered spec, or of the
    builtin stage ``default`` when the stage was built without one) and its loop state, built afresh or
    restored from the stage's checkpoint (``checkpointed``: what it restores, ``strategy`` by default;
    :func:`rltk.training.stages.loop_state.start_rl_stage`)."""
    import rltk

    spec = stage.spec if getattr(stage, "spec", None) is not None else rltk.get_component("stage", default)
    parts = RLParts.from_config(stage.cfg, strategy, spec, getattr(stage, "type", None) or default)
    loop = start_rl_stage(stage, strategy, checkpointed=checkpointed)
    return StageContext(stage, loop, strategy, parts, checkpointed)


def sampled_batch(ctx, rollout: Rollout, step: int, *old) -> dict[str, torch.Tensor] | None:
    """The step's training batch: the sample strategy's pick from the buffer, padded to tensors.

    ``ctx`` is the stage's :class:`StageContext`; ``rollout`` is what the
    rollout source gave for the step: its experiences, their metrics, and the policy version that sampled
    each (None when this step's weights sampled them). None when any rank has nothing to train on (e.g.
    every group filtered out as all-equal): ranks stay in lockstep, so every rank skips the step, and the
    skip is logged. (The old form ``sampled_batch(stage, loop, parts, rollout, step, strategy)`` works for
    one release.)
    """
    if old:
        warn_old_call("sampled_batch(stage, loop, parts, rollout, step, strategy)", "sampled_batch(ctx, rollout, step)")
        stage, loop, parts, rollout, step, strategy = ctx, rollout, step, *old
    else:
        stage, loop, parts, strategy = ctx.stage, ctx.loop, ctx.parts, ctx.strategy
    run = stage.run
    experiences, collect_metrics = rollout.experiences, rollout.metrics
    loop.buffer.put(experiences, step, versions=rollout.versions)
    stored = {id(item.experience): item for item in loop.buffer.items()}
    # a strategy may hand back a changed copy (mix_expert regroups demonstrations with
    # dataclasses.replace); the copy keeps the original's info dict, which finds its buffer item
    stored_by_info = {id(item.experience.info): item for item in loop.buffer.items()}
    experiences = parts.sample_strategy.sample(loop.buffer, step) if experiences else []
    loop.batch_items = [stored.get(id(e)) or stored_by_info.get(id(e.info)) for e in experiences]
    if any_rank(strategy, not experiences):
        run.metric_log.log({"skipped_empty_batch": 1.0, **collect_metrics, **parts.sample_strategy.metrics()},
                           stage.first_step + step)
        return None
    # gdpo: each reward function's own score, columns in reward.reward_fn order
    return collate(experiences, run.tokenizer.pad_token_id,
                   reward_names=run.workflow.reward.names if parts.plan.reward_components else None)


def rl_steps(ctx, rollouts, *old):
    """The stage's remaining steps as ``(step, tick, rollout, batch)``: each step's experiences from
    ``rollouts`` (a :class:`~rltk.training.rollouts.rollout_source.RolloutSource`) and the batch the sample
    strategy picks from the buffer (:func:`sampled_batch`); ``ctx`` is the stage's
    :class:`StageContext`. ``tick`` is when the step began. A step with
    nothing to train on is skipped on every rank (logged), and ``rollouts.after_update`` still counts it:
    the policy version counts steps, trained or skipped. (The old form ``rl_steps(stage, loop, parts,
    strategy, rollouts)`` works for one release.)"""
    if old:
        warn_old_call("rl_steps(stage, loop, parts, strategy, rollouts)", "rl_steps(ctx, rollouts)")
        stage, loop, (parts, strategy, rollouts) = ctx, rollouts, old
        ctx = StageContext(stage, loop, strategy, parts)
    # A frozen vision tower runs once per image and step: the rollout's prefill and every pass of the step reuse
    # its features (rltk.models.vision.features); the cache is emptied when the step ends.
    # Not where parameters are sharded over ranks: each tower forward gathers them (a collective), and ranks
    # whose rows hold different images would skip different forwards.
    steps = range(ctx.loop.step + 1, ctx.cfg.trainer.total_steps + 1)
    if not steps:  # a stage resumed at its end: nothing to set up
        return
    features = ImageFeatureCache()
    sharded = getattr(ctx.strategy, "shards_parameters", False) and getattr(ctx.strategy, "data_world_size", 1) > 1
    reference = ctx.loop.reference.copy if ctx.loop.reference is not None else None
    # colocated hf: the policy module; a workflow need not hold an engine (a plugin one, the agentic endpoint)
    engine_model = getattr(getattr(ctx.stage.run.workflow, "engine", None), "model", None)
    cached = [] if sharded else [ctx.strategy.unwrap(), engine_model, reference]
    for step in steps:
        with features.serving(cached):
            tick = time.perf_counter()
            rollout = rollouts.take(step)  # time/rollout_s: sampling, or waiting for a producer's batch
            batch = sampled_batch(ctx, rollout, step)
            if batch is None:
                rollouts.after_update(step)
                continue
            yield step, tick, rollout, batch


def kl_to_reference(loss: LossComponents, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(pi_old || pi_ref) per sampled token, ``[B, T]``, by the configured estimator (``algorithm.kl_penalty_fn``)."""
    return loss.kl_penalty(old_logprobs, ref_logprobs, **loss.kl_penalty_args)
