"""The scaffolding every recipe shares: open a run, run its stages with resume, finish it.

A recipe supplies the loop of its own RL stage; everything around it (run
folder, model and data, the rollout workflow, checkpoints and where to resume,
the supervised warm-up stage, final evaluation, plot and summary) is here so
recipes never copy it.

Weights across stages. ``run.policy`` is the policy between stages: a plain
module. A stage builds its strategy on it with :func:`build_stage_strategy` (an RL stage with
:func:`build_rl_strategy`), which also points the rollout engine at the weights the stage trains
(:mod:`rltk.training.rollouts.engine_weights`), and its runner returns that strategy.
When the stage ends, :func:`run_stages` takes the trained model back from it
(``strategy.release_model()``, a new plain module under ZeRO-3, which
partitioned the old one in place) so the next stage can build its own
strategy, and the engine follows it.

The stages' other pieces have modules of their own: held-out evaluation
(:mod:`rltk.training.scaffold.evaluation`), what a checkpoint holds
(:mod:`rltk.training.stages.stage_checkpoint`), the supervised warm-up stage
(:mod:`rltk.training.stages.sft_stage`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Callable

from omegaconf import DictConfig
from torch import nn

import rltk
from rltk.checkpoint import CheckpointManager, saved_rank_of
from rltk.distributed import end_process_group, limit_torch_threads, process_rank, seed_everything
from rltk.errors import ConfigError
from rltk.loggers.base import StageSpan, stage_ended, stage_spans
from rltk.loggers.plot import plot_training_curves
from rltk.registration.stage_spec import StageSpec
from rltk.training.rollouts.engine_weights import connect_rollout_engine, engine_follows
from rltk.training.scaffold.evaluation import evaluate
from rltk.training.scaffold.guard import DivergenceGuard, TrainingDiverged, vocab_size_of
from rltk.training.scaffold.resume import (
    is_stage_end, load_model_weights, load_rng_state, resume_or_start_over, run_is_finished, stage_ends,
    start_point,
)
from rltk.training.scaffold.rows import build_rows
from rltk.training.scaffold.run_outputs import MetricLog, build_loggers, prepare_run_dir, write_summary
from rltk.training.scaffold.setup import (
    build_strategy, build_tokenizer_and_policy, build_workflow, data_rank_of_run, layout_of_run, stage_config,
    trainer_workflow_config, save_tokenizer_folder,
)
from rltk.training.stages.stage_checkpoint import LOG_ROWS_KEY, StageCheckpoint, restore_rollout_state
from rltk.training.scaffold.traces import TraceWriter
from rltk.training.updates.update_loop import updates_per_step
from rltk.workflows.base import Workflow


@dataclass
class Run:
    """Everything a stage needs, built once per run."""

    cfg: DictConfig
    run_dir: Path
    tokenizer: Any  # a transformers tokenizer
    policy: nn.Module  # the policy between stages: a plain module
    train_rows: list[dict]
    eval_rows: list[dict]
    workflow: Workflow
    ckpt: CheckpointManager
    metric_log: MetricLog
    stages: list[DictConfig]  # the config of each stage, its overrides applied
    stage_steps: list[int]
    resume: dict | None  # the checkpoint this run continues from
    finished: bool = False  # the checkpoint ends the last stage: only the final evaluation is reported
    traces: TraceWriter | None = None  # logging.traces: samples of each RL step in traces.jsonl (main process)
    # the global step each finished stage ended at: the next stage's steps are numbered on from the last
    stage_ends: list[int] = field(default_factory=list)
    spans: list[StageSpan] = field(default_factory=list)  # the stages as the loggers see them

    @property
    def last_step(self) -> int:
        """The global step the last finished stage ended at (0 before any)."""
        return self.stage_ends[-1] if self.stage_ends else 0

    def end_stage(self, index: int, last_step: int) -> None:
        """Stage ``index`` ended at global step ``last_step``: the next stage numbers its steps on from there,
        and loggers get the spans again when it stopped before its cap."""
        self.stage_ends.append(last_step)
        if self.spans and self.spans[index].last_step != last_step:
            self.spans = stage_ended(self.spans, index, last_step)
            self.metric_log.set_stages(self.spans)

    def trace(self, stage: "Stage", step: int, batch: dict, items) -> None:
        """Keep a sample of stage step ``step``'s trajectories (``logging.traces``; a no-op when off)."""
        if self.traces is not None:
            self.traces.write(stage, step, batch, items)


@dataclass
class Stage:
    """One stage as its runner sees it. A runner (``Callable[[Stage], strategy]``) trains it and returns the
    policy's strategy, whose model :func:`run_stages` takes back when the stage ends."""

    run: Run
    cfg: DictConfig  # this stage's config
    index: int
    first_step: int  # global step before this stage's first step: where the stage before it ended
    resume: dict | None  # set when this stage continues from one of its own checkpoints
    guard: DivergenceGuard | None = None  # stops the run on divergence; the loop calls guard.observe each step
    # the stage step a runner stopped at before its configured length (the warm-up reaching its target
    # accuracy); None when it ran them all. The next stage's steps follow it.
    stopped_at: int | None = None
    type: str = "rl"  # the stage's type (``stages[i].type``)
    # the registered stage that runs it (rltk.StageSpec: what its loop provides, which its step plan reads);
    # None for a runner that is a plain function
    spec: StageSpec | None = None
    checkpoint: StageCheckpoint = field(init=False, repr=False)  # save() and restore() of this stage

    def __post_init__(self):
        self.checkpoint = StageCheckpoint(self)


def open_run(cfg: DictConfig) -> Run:
    """Run folder, tokenizer and policy, data, rollout workflow, loggers and the resume point."""
    limit_torch_threads()  # no more threads than cores, before the first parallel op
    seed_everything(cfg.seed)
    data_rank = data_rank_of_run(cfg)  # parallel sizes that do not fit the processes stop here, before the folder
    # Whether this continues the run in the folder is settled before anything is written there:
    # an incompatible config stops here, with the folder untouched.
    # each stage's last checkpoint stays whatever keep_last: a later run may start from it (checkpoint.start_from)
    ckpt = CheckpointManager(Path(cfg.output_dir) / "checkpoints", keep_last=cfg.checkpoint.keep_last,
                             keep=is_stage_end)
    resume = resume_or_start_over(cfg, ckpt, main_process=process_rank() == 0)
    stages = [stage_config(cfg, i) for i in range(len(cfg.stages))]
    stage_steps = [s.sft.steps if st.type == "sft" else s.trainer.total_steps for s, st in zip(stages, cfg.stages)]
    if resume is None and cfg.checkpoint.start_from:  # a new run, after another run's finished stage
        resume = start_point(cfg, stage_steps)
    finished = run_is_finished(resume, cfg)
    # A finished run's config.yaml keeps describing how it was trained: nothing more is trained now.
    if cfg.get("launcher", "local") == "ray":
        # the cluster reached, the requests checked against its nodes and the reward services placed, before a
        # model is built
        from rltk.training.scaffold.ray_cluster import join_cluster

        join_cluster(cfg, main_process=process_rank() == 0, finished=finished)
    run_dir = prepare_run_dir(cfg, write_config=not finished and process_rank() == 0)
    tokenizer, policy = build_tokenizer_and_policy(cfg)
    if process_rank() == 0 and not finished:
        save_tokenizer_folder(cfg, tokenizer, run_dir / "tokenizer")  # so `rltk export` yields a complete model folder
    seed_everything(cfg.seed + data_rank)  # same initial weights, different samples per data rank
    train_rows, eval_rows = build_rows(cfg, tokenizer)

    # The rollout engine shares the policy module; the workflow samples, scores and evaluates.
    # (an asynchronous run on vllm_server: the servers are the producer's, the trainer evaluates with hf)
    workflow = build_workflow(trainer_workflow_config(cfg), policy, tokenizer)
    if resume is not None:
        restore_rollout_state(workflow, resume, layout_of_run(cfg))

    resume_step = resume["global_step"] if resume is not None else 0
    # a warm-up that may stop on reaching sft.stop_at_accuracy (at a probe before its last step): its sft.steps
    # are a cap, not its length
    spans = stage_spans([(st.name, st.type, n, st.type == "sft" and s.sft.stop_at_accuracy is not None
                          and s.sft.probe_every < n) for s, st, n in zip(stages, cfg.stages, stage_steps)])
    ends = stage_ends(resume, stage_steps)  # the stages the checkpoint had finished, where they really ended
    for i, end in enumerate(ends):
        spans = stage_ended(spans, i, end)
    metric_log = MetricLog(build_loggers(cfg, run_dir, sum(stage_steps), resume_step=resume_step, stages=spans))
    if resume is not None and LOG_ROWS_KEY in resume:
        # Rows logged at the checkpoint's own step after it was saved (the next stage's opening
        # evaluation) are logged again by this run: keep only those written before the save.
        for logger in metric_log.loggers:
            logger.truncate_after(resume_step, keep_at_step=resume[LOG_ROWS_KEY])
    lg = cfg.logging
    traces = TraceWriter(run_dir, tokenizer, per_step=lg.traces_per_step, every=lg.traces_every,
                         max_mb=lg.traces_max_mb, resume_step=resume_step,
                         row_images={str(row["id"]): row["images"] for row in train_rows if row.get("images")}) \
        if lg.traces and process_rank() == 0 and not finished else None
    if finished and process_rank() == 0:
        print(f"rltk: {run_dir} already finished (checkpoint {resume['path']}): nothing left to train, reporting "
              f"its final evaluation. For a new run use name=<new name>; to redo this one, checkpoint.resume=never")
    elif resume is not None and "started_from" not in resume:
        print(f"rltk: resuming from {resume['path']} (stage {resume['stage']}, step {resume['stage_step']})")
    return Run(cfg, run_dir, tokenizer, policy, train_rows, eval_rows, workflow, ckpt, metric_log, stages,
               stage_steps, resume, finished, traces, stage_ends=ends, spans=spans)


def run_stages(run: Run, runners: Mapping[str, Callable[[Stage], Any]]) -> None:
    """Run each configured stage with the runner of its type, skipping what a checkpoint already holds.

    ``runners`` maps a stage type to its loop: the registered stages (:class:`rltk.StageSpec`, whose loop is
    imported as the stage starts) and the recipe's own ``rl`` (:func:`rltk.recipes.recipe_stages`). Each
    stage starts from the weights the one before ended with.
    """
    unknown = [f"stages[{i}] ('{st.name}', type {st.type})" for i, st in enumerate(run.cfg.stages)
               if st.type not in runners]
    if unknown:
        raise ConfigError(f"this recipe runs stages of type {', '.join(sorted(runners))}; it cannot run "
                          f"{', '.join(unknown)} (rl is the RL loop of `rltk run grpo` or `rltk run ppo`: name it "
                          f"grpo or ppo in another recipe's stages)")
    rltk.call_lifecycle_hook("rltk_on_train_start", config=run.cfg, run_dir=run.run_dir)
    resume = run.resume
    for i, (scfg, stage) in enumerate(zip(run.stages, run.cfg.stages)):
        stage_resume = None
        if resume is not None:
            if resume["stage"] > i or (resume["stage"] == i and resume["stage_done"]):
                continue  # finished before the interruption: run.stage_ends holds where it ended
            if resume["stage"] == i:
                stage_resume = resume  # continue this stage mid-way
            else:
                load_model_weights(resume["path"], run.policy)  # start from where the last stage ended
                engine_follows(run.workflow.engine, run.policy)
                if "started_from" not in resume:
                    # and draw what the uninterrupted run drew next: a stage before (a DPO stage's sampled
                    # evaluation) may have used the global RNG after the run's start
                    load_rng_state(resume["path"], saved_rank_of(layout_of_run(run.cfg), process_rank(),
                                                                 Path(resume["path"])))
            resume = None
        first_step = run.last_step  # a stage's steps follow the last step the stage before it ran
        guard = DivergenceGuard(scfg, stage_name=stage.name, stage_type=stage.type, first_step=first_step,
                                vocab_size=vocab_size_of(run.policy), checkpoints=run.ckpt)
        runner = runners[stage.type]
        # its checkpoint restores the guard too
        current = Stage(run, scfg, i, first_step, stage_resume, guard, type=stage.type,
                        spec=runner if isinstance(runner, StageSpec) else None)
        try:
            strategy = runner(current)
            guard.end_stage(strategy)
        except TrainingDiverged:
            # What was logged up to the divergence is what the reader needs: flush it, and let every
            # rank (all stop at the same step) leave the process group together.
            run.metric_log.close()
            end_process_group()
            raise
        if strategy is not None:  # (a runner written for an older rltk returns None: its module is run.policy)
            # The next stage (and the final evaluation) starts from a plain module with the trained
            # weights: a ZeRO-3 engine leaves the module it trained partitioned.
            run.policy = strategy.release_model()
            engine_follows(run.workflow.engine, run.policy)
        run.end_stage(i, first_step + (run.stage_steps[i] if current.stopped_at is None else current.stopped_at))
    if resume is not None:  # the checkpoint was the run's last: nothing left to train
        load_model_weights(resume["path"], run.policy)
        engine_follows(run.workflow.engine, run.policy)


def require_rows_per_rank(strategy, key: str, rows: int) -> None:
    """Refuse a per-step row count that leaves some process nothing: ranks split each step's rows."""
    if rows < strategy.data_world_size:
        raise ConfigError(f"{key}={rows} leaves some of the {strategy.data_world_size} data-parallel ranks without "
                          f"a row each step (every one takes its share); set {key} to at least "
                          f"{strategy.data_world_size}")


def build_stage_strategy(stage: Stage, *, lr: float, total_steps: int, warmup_steps: int, lr_schedule: str):
    """The training strategy of ``stage`` on ``run.policy``, with the rollout engine following its weights
    (the stage's runner returns it, so :func:`run_stages` takes the trained model back when the stage ends).
    Collective under a strategy that shards parameters (see :func:`connect_rollout_engine`).
    """
    run = stage.run
    strategy = build_strategy(stage.cfg, run.policy, lr=lr, total_steps=total_steps, warmup_steps=warmup_steps,
                              lr_schedule=lr_schedule)
    connect_rollout_engine(run.workflow.engine, strategy)
    return strategy


def build_rl_strategy(stage: Stage, *, train_steps: int | None = None):
    """The policy's strategy of an RL stage (:func:`build_stage_strategy`): its LR schedule counts optimizer
    steps, :func:`~rltk.training.updates.update_loop.updates_per_step` per RL step, over ``train_steps`` RL
    steps (``trainer.total_steps`` unless the policy waits for part of the stage) with ``trainer.warmup_steps``
    of warm-up; and ``trainer.prompts_per_step`` gives every process rows."""
    t = stage.cfg.trainer
    per_step, steps = updates_per_step(stage.cfg), t.total_steps if train_steps is None else train_steps
    strategy = build_stage_strategy(stage, lr=t.lr, total_steps=steps * per_step,
                                    warmup_steps=t.warmup_steps * per_step, lr_schedule=t.lr_schedule)
    require_rows_per_rank(strategy, "trainer.prompts_per_step", t.prompts_per_step)
    return strategy


def finish_run(run: Run) -> dict:
    """Final held-out evaluation, the plot (warm-up loss, reward, held-out accuracy), and summary.json."""
    # No stages (`rltk run sft model.path=M 'stages=[]'`): the held-out evaluation of the model as given.
    final = evaluate(run.workflow, run.eval_rows, run.stages[-1] if run.stages else run.cfg)
    # The reward's worker processes, if it started any. A run stopped early (an error, Ctrl-C) has
    # them stopped at interpreter exit instead, or at once when Ctrl-C lands while they score.
    close_reward = getattr(run.workflow.reward, "close", None)
    if callable(close_reward):
        close_reward()
    run.workflow.close()  # its own resources (agentic: the endpoint's threads)
    run.workflow.engine.close()  # vllm: its worker and the process group it made
    if run.cfg.get("launcher", "local") == "ray":
        from rltk.training.scaffold.ray_cluster import release_reward_services

        release_reward_services()  # each says how many samples it scored
    summary = {"final": final, "steps": run.last_step}
    if process_rank() == 0:
        print("rltk: final held-out " + ", ".join(f"{k}={v:.3f}" for k, v in final.items()))
    # A finished run's files stay those of its training, unless it stopped before writing them.
    if process_rank() == 0 and (not run.finished or not (run.run_dir / "summary.json").exists()):
        if run.cfg.logging.plot and (run.run_dir / "metrics.jsonl").exists():
            plot_training_curves(run.run_dir / "metrics.jsonl", run.run_dir / "curves.png")
        write_summary(run.run_dir, summary)
    # After the plot and summary: loggers that keep artifacts (mlflow, swanlab) upload them as they close.
    run.metric_log.close()
    rltk.call_lifecycle_hook("rltk_on_train_end", run_dir=run.run_dir, metrics=summary)
    end_process_group()
    return summary
