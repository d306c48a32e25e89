"""The scaffolding every recipe shares: open a run, run its stages with resume, finish it.

A recipe supplies the loop of its own RL stage; everything around it (run
folder, model and data, the rollout workflow, checkpoints and where to resume,
the supervised warm-up stage, final evaluation, plot and summary) is here so
recipes never copy it.

Weights across stages. ``run.policy`` is the policy between stages: a plain
module. A stage builds its strategy on it with :func:`build_stage_strategy`,
which also points the rollout engine at the weights the stage trains (the
module itself, or a whole copy of the engine's own when the strategy shards
parameters, as ZeRO-3 does). When the stage ends, :func:`run_stages` takes the
trained model back from the strategy (``strategy.release_model()``, a new
plain module under ZeRO-3, which partitioned the old one in place) so the next
stage can build its own strategy, and the engine follows it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf

import rltk
from rltk.checkpoint import CheckpointManager
from rltk.config.components import signature_params
from rltk.config.env_checks import check_demonstrations
from rltk.config.errors import ConfigError
from rltk.data.sampler import RowSampler
from rltk.distributed import end_process_group, every_rank, process_group, process_rank, seed_everything
from rltk.loggers.base import stage_spans
from rltk.loggers.plot import plot_training_curves
from rltk.training.guard import DivergenceGuard, TrainingDiverged, vocab_size_of
from rltk.training.loop_state import LoopState
from rltk.training.resume import (
    is_stage_end, load_model_weights, resume_or_start_over, run_is_finished, start_point,
)
from rltk.training.setup import (
    MetricLog, args_of, build_loggers, build_reward, build_rows, build_strategy, build_tokenizer_and_policy,
    limit_torch_threads, prepare_run_dir, sampling_params, sft_pairs, stage_config,
    tool_schemas,
    write_summary,
)
from rltk.training.sft import sft_batch, sft_step
from rltk.training.traces import TraceWriter

PER_RANK_KEY = "per_rank"  # checkpoint state: one JSON-able dict per rank, in rank order (see rank_state)
REWARD_STATE_KEY = "reward_counters"  # in each rank's dict: its RewardComposer.state_dict()
WORKFLOW_STATE_KEY = "workflow"  # in each rank's dict: its workflow's state_dict()
LOG_ROWS_KEY = "log_rows_at_step"  # checkpoint state: metric rows logged at its step before it was saved


@dataclass
class Run:
    """Everything a stage needs, built once per run."""

    cfg: DictConfig
    run_dir: Path
    tokenizer: Any
    policy: Any
    train_rows: list[dict]
    eval_rows: list[dict]
    workflow: Any
    ckpt: CheckpointManager
    metric_log: MetricLog
    stages: list[DictConfig]  # the config of each stage, its overrides applied
    stage_steps: list[int]
    resume: dict | None  # the checkpoint this run continues from
    finished: bool = False  # the checkpoint ends the last stage: only the final evaluation is reported
    traces: TraceWriter | None = None  # logging.traces: samples of each RL step in traces.jsonl (main process)

    def trace(self, stage: "Stage", step: int, batch: dict, items) -> None:
        """Keep a sample of stage step ``step``'s trajectories (``logging.traces``; a no-op when off)."""
        if self.traces is not None:
            self.traces.write(stage, step, batch, items)


@dataclass
class Stage:
    """One stage as its runner sees it."""

    run: Run
    cfg: DictConfig  # this stage's config
    index: int
    first_step: int  # global step before this stage's first step
    resume: dict | None  # set when this stage continues from one of its own checkpoints
    strategy: Any = None  # the policy's strategy, released by run_stages when the stage ends
    guard: DivergenceGuard | None = None  # stops the run on divergence; the loop calls guard.observe each step


def open_run(cfg: DictConfig) -> Run:
    """Run folder, tokenizer and policy, data, rollout workflow, loggers and the resume point."""
    limit_torch_threads()  # no more threads than cores, before the first parallel op
    seed_everything(cfg.seed)
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
    run_dir = prepare_run_dir(cfg, write_config=not finished and process_rank() == 0)
    tokenizer, policy = build_tokenizer_and_policy(cfg)
    if process_rank() == 0 and not finished:
        tokenizer.save_pretrained(run_dir / "tokenizer")  # so `rltk export` yields a complete model folder
    seed_everything(cfg.seed + process_rank())  # same initial weights, different samples per rank
    train_rows, eval_rows = build_rows(cfg, tokenizer)

    # The rollout engine shares the policy module; the workflow samples, scores and evaluates.
    engine = rltk.get_component("rollout_engine", cfg.rollout.engine)(
        model=policy, tokenizer=tokenizer, **args_of(cfg, "rollout.engine"))
    workflow_cls = rltk.get_component("workflow", cfg.rollout.workflow)
    # A workflow that names `env` in its signature (multi_turn, agentic) gets the env section.
    env = {"env": OmegaConf.to_container(cfg.env, resolve=True)} if "env" in signature_params(workflow_cls)[0] else {}
    workflow = workflow_cls(
        engine=engine, tokenizer=tokenizer, reward=build_reward(cfg), sampling=sampling_params(cfg),
        **env, **args_of(cfg, "rollout.workflow"))
    if resume is not None:
        restore_rollout_state(workflow, resume)

    resume_step = resume["global_step"] if resume is not None else 0
    spans = stage_spans([(st.name, st.type, n) for st, n in zip(cfg.stages, stage_steps)])
    metric_log = MetricLog(build_loggers(cfg, run_dir, sum(stage_steps), resume_step=resume_step, stages=spans))
    if resume is not None and LOG_ROWS_KEY in resume:
        # Rows logged at the checkpoint's own step after it was saved (the next stage's opening
        # evaluation) are logged again by this run: keep only those written before the save.
        for logger in metric_log.loggers:
            if hasattr(logger, "truncate_after"):
                logger.truncate_after(resume_step, keep_at_step=resume[LOG_ROWS_KEY])
    lg = cfg.logging
    traces = TraceWriter(run_dir, tokenizer, per_step=lg.traces_per_step, every=lg.traces_every,
                         max_mb=lg.traces_max_mb, resume_step=resume_step) \
        if lg.traces and process_rank() == 0 and not finished else None
    if finished and process_rank() == 0:
        print(f"rltk: {run_dir} already finished (checkpoint {resume['path']}): nothing left to train, reporting "
              f"its final evaluation. For a new run use name=<new name>; to redo this one, checkpoint.resume=never")
    elif resume is not None and "started_from" not in resume:
        print(f"rltk: resuming from {resume['path']} (stage {resume['stage']}, step {resume['stage_step']})")
    return Run(cfg, run_dir, tokenizer, policy, train_rows, eval_rows, workflow, ckpt, metric_log, stages,
               stage_steps, resume, finished, traces)


def run_stages(run: Run, runners: dict[str, Callable[[Stage], None]]) -> None:
    """Run each configured stage with the runner of its type, skipping what a checkpoint already holds."""
    rltk.call_lifecycle_hook("rltk_on_train_start", config=run.cfg, run_dir=run.run_dir)
    resume, first_step = run.resume, 0
    for i, (scfg, stage) in enumerate(zip(run.stages, run.cfg.stages)):
        stage_resume = None
        if resume is not None:
            if resume["stage"] > i or (resume["stage"] == i and resume["stage_done"]):
                first_step += run.stage_steps[i]  # finished before the interruption
                continue
            if resume["stage"] == i:
                stage_resume = resume  # continue this stage mid-way
            else:
                load_model_weights(resume["path"], run.policy)  # start from where the last stage ended
                _engine_follows_policy(run)
            resume = None
        current = Stage(run, scfg, i, first_step, stage_resume)
        current.guard = DivergenceGuard(scfg, stage_name=stage.name, stage_type=stage.type, first_step=first_step,
                                        vocab_size=vocab_size_of(run.policy), checkpoints=run.ckpt)
        if stage_resume is not None:
            current.guard.load_state_dict(stage_resume.get("guard", {}))  # count on from where it stopped
        try:
            runners[stage.type](current)
            current.guard.end_stage(current.strategy)
        except TrainingDiverged:
            # What was logged up to the divergence is what the reader needs: flush it, and let every
            # rank (all stop at the same step) leave the process group together.
            run.metric_log.close()
            end_process_group()
            raise
        if current.strategy is not None:
            # The next stage (and the final evaluation) starts from a plain module with the trained
            # weights: a ZeRO-3 engine leaves the module it trained partitioned.
            run.policy = current.strategy.release_model()
            _engine_follows_policy(run)
        first_step += run.stage_steps[i]
    if resume is not None:  # the checkpoint was the run's last: nothing left to train
        load_model_weights(resume["path"], run.policy)
        _engine_follows_policy(run)


def require_rows_per_rank(strategy, key: str, rows: int) -> None:
    """Refuse a per-step row count that leaves some process nothing: ranks split each step's rows."""
    if rows < strategy.world_size:
        raise ConfigError(f"{key}={rows} leaves some of the {strategy.world_size} processes without a row each step "
                          f"(every process takes its share); set {key} to at least {strategy.world_size}")


def build_stage_strategy(stage: Stage, *, lr: float, total_steps: int, warmup_steps: int, lr_schedule: str):
    """The training strategy of ``stage`` on ``run.policy``, with the rollout engine following its weights.

    Recorded as ``stage.strategy``, so :func:`run_stages` takes the trained
    model back when the stage ends. Collective under a strategy that shards
    parameters (see :func:`connect_rollout_engine`).
    """
    run = stage.run
    strategy = build_strategy(stage.cfg, run.policy, lr=lr, total_steps=total_steps, warmup_steps=warmup_steps,
                              lr_schedule=lr_schedule)
    stage.strategy = strategy
    connect_rollout_engine(run.workflow.engine, strategy)
    return strategy


def connect_rollout_engine(engine, strategy) -> None:
    """Make ``engine`` sample from the weights ``strategy`` trains. Collective if it shards parameters.

    An engine that can sample from a module (``hf``) shares the trainer's
    module, so an optimizer step needs no copy. A strategy that shards
    parameters (ZeRO-3) makes every forward of that module a collective: ranks
    would have to generate in lockstep and an evaluation on one rank would
    hang, so the engine gets a whole copy of its own instead, refreshed by
    ``engine.update_weights(strategy.unwrap())`` after each optimizer step.
    Engines with weights of their own (``vllm``) load the full weights.
    """
    if hasattr(engine, "use_model"):
        engine.use_model(strategy.full_model_copy() if strategy.shards_parameters else strategy.unwrap())
    else:
        engine.update_weights(strategy.full_state_dict())


def _engine_follows_policy(run: Run) -> None:
    """Point the rollout engine at ``run.policy`` (a plain module between stages)."""
    engine = run.workflow.engine
    if hasattr(engine, "use_model"):
        engine.use_model(run.policy)
    else:
        engine.update_weights(run.policy)


def finish_run(run: Run) -> dict:
    """Final held-out evaluation, the plot (warm-up loss, reward, held-out accuracy), and summary.json."""
    final = evaluate(run.workflow, run.eval_rows, run.stages[-1])
    # The reward's worker processes, if it started any. A run stopped early (an error, Ctrl-C) has
    # them stopped at interpreter exit instead, or at once when Ctrl-C lands while they score.
    close_reward = getattr(run.workflow.reward, "close", None)
    if callable(close_reward):
        close_reward()
    close_workflow = getattr(run.workflow, "close", None)  # its own resources (agentic: the endpoint's threads)
    if callable(close_workflow):
        close_workflow()
    close_engine = getattr(run.workflow.engine, "close", None)  # vllm: its worker and the process group it made
    if callable(close_engine):
        close_engine()
    summary = {"final": final, "steps": sum(run.stage_steps)}
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


def evaluate(workflow, rows: list[dict], cfg: DictConfig) -> dict[str, float]:
    """Held-out metrics of the current policy: greedy (``eval/*``) and one sample per
    prompt at the training temperature (``eval/sampled_accuracy``, what RL sharpens first).

    With several processes each evaluates its share of the rows (``rows[rank::world]``)
    and the results are combined, weighted by responses: every rank returns the numbers
    of the whole held-out set, ``eval/num_responses`` included.
    """
    rows = rows[: cfg.trainer.eval_size or len(rows)]
    world, rank = process_group()
    share = rows[rank::world]
    greedy = workflow.evaluate(share, sampling_params(cfg, greedy=True)) if share else {}
    with seeded_sampling(cfg.trainer.get("eval_seed"), rank):
        sampled = workflow.evaluate(share, dataclasses.replace(sampling_params(cfg), n=1)) if share else {}
    greedy, sampled = _combine_over_ranks(greedy, world), _combine_over_ranks(sampled, world)
    result = {f"eval/{k}": float(v) for k, v in greedy.items()}
    result["eval/sampled_accuracy"] = float(sampled["accuracy"])
    return result


@contextlib.contextmanager
def seeded_sampling(seed: int | None, rank: int = 0):
    """With a seed: torch's random streams (CPU, and every GPU) start from ``seed + rank`` inside, and are
    back where they were after, so a sampled evaluation of the same weights repeats its draws and leaves
    the training's draws as they would have been without it (``trainer.eval_seed``). ``None``: no change."""
    if seed is None:
        yield
        return
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed + rank)
        yield


def greedy_accuracy(workflow, rows: list[dict], cfg: DictConfig) -> float:
    """Greedy exact-answer accuracy on ``rows``, each process taking its share, combined over processes."""
    return greedy_probe(workflow, rows, cfg)["accuracy"]


def greedy_probe(workflow, rows: list[dict], cfg: DictConfig) -> dict[str, float]:
    """The workflow's greedy evaluation of ``rows`` (``accuracy``, ``truncated_fraction`` ...), each process
    taking its share, combined over processes."""
    world, rank = process_group()
    share = rows[rank::world]
    greedy = workflow.evaluate(share, sampling_params(cfg, greedy=True)) if share else {}
    return {k: float(v) for k, v in _combine_over_ranks(greedy, world).items()}


def _combine_over_ranks(metrics: dict[str, float], world: int) -> dict[str, float]:
    """Every rank's evaluation means as one: weighted by ``num_responses``, which is summed."""
    if world == 1:
        return metrics
    import torch.distributed as dist

    every_rank: list = [None] * world
    dist.all_gather_object(every_rank, metrics)
    every_rank = [m for m in every_rank if m]  # a rank with no held-out row contributes nothing
    total = sum(m["num_responses"] for m in every_rank)
    combined = {k: sum(m[k] * m["num_responses"] for m in every_rank) / total for k in every_rank[0]}
    combined["num_responses"] = total
    return combined


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
    it drops the rows logged there after the save (see :func:`open_run`).
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
    every_rank = state.get(PER_RANK_KEY) or []
    rank = process_rank()
    return every_rank[rank] if rank < len(every_rank) else {}


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


def run_sft_stage(stage: Stage) -> None:
    """Supervised warm-up: cross-entropy on solved examples, so the RL stage starts with some accuracy.

    With ``sft.stop_at_accuracy`` the stage ends at the first probe (every
    ``sft.probe_every`` steps) whose greedy accuracy on ``sft.probe_size``
    training prompts reaches it; ``sft.steps`` is then a cap. Global step
    numbers still reserve the whole cap for this stage, so the steps of later
    stages do not depend on when the warm-up stopped.
    """
    run, cfg, s = stage.run, stage.cfg, stage.cfg.sft
    strategy = build_strategy(cfg, run.policy, lr=s.lr, total_steps=s.steps, warmup_steps=s.warmup_steps,
                              lr_schedule=s.lr_schedule)
    stage.strategy = strategy
    require_rows_per_rank(strategy, "sft.batch_size", s.batch_size)
    probing = s.stop_at_accuracy is not None
    if probing:  # the probe samples from the weights being trained (a whole copy under ZeRO-3)
        connect_rollout_engine(run.workflow.engine, strategy)
    # Otherwise nothing samples during this stage, so the rollout engine is not pointed at the
    # strategy's weights (under ZeRO-3 that would cost a whole copy for nothing).
    probe_rows = run.train_rows[: s.probe_size]
    pairs = sft_pairs(run.train_rows, run.tokenizer, s.completion_key, tools=tool_schemas(cfg))
    check_demonstrations(cfg, run.train_rows, pairs)  # before the first step: tools and turn caps fit the rollout
    sampler = RowSampler(pairs, s.batch_size, seed=cfg.seed + stage.index, shuffle=cfg.data.shuffle)
    loop = LoopState(sampler)
    loop.resume(stage, strategy)

    for step in range(loop.step + 1, s.steps + 1):
        # every rank draws the same global batch and trains on its share of the rows
        batch = sft_batch(sampler.next_batch()[strategy.rank :: strategy.world_size], run.tokenizer.pad_token_id)
        metrics = {f"sft/{k}": v for k, v in sft_step(strategy, batch, micro_batch_size=cfg.trainer.micro_batch_size,
                                                      impl=cfg.model.logprob_impl,
                                                      chunk_size=cfg.model.logprob_chunk_size).items()}
        reached = False
        if probing and step % s.probe_every == 0:
            run.workflow.engine.update_weights(strategy.unwrap())  # colocated engines share the module: a no-op
            probe = greedy_probe(run.workflow, probe_rows, cfg)
            metrics["sft/train_accuracy"] = probe["accuracy"]
            # a probe at accuracy 0 with every episode cut says "raise the length cap", not "train longer"
            metrics["sft/probe_truncated_fraction"] = probe.get("truncated_fraction", 0.0)
            reached = metrics["sft/train_accuracy"] >= s.stop_at_accuracy
        run.metric_log.log(metrics, stage.first_step + step)
        stage.guard.observe(metrics, step, strategy)  # stop here if the warm-up has diverged
        last = step if reached else s.steps
        loop.step = step
        if should_checkpoint(cfg, step, last):
            save_checkpoint(stage, strategy, loop, last_step=last)
        if reached:
            if process_rank() == 0:
                print(f"rltk: warm-up reached sft.stop_at_accuracy={s.stop_at_accuracy} "
                      f"(train accuracy {metrics['sft/train_accuracy']:.3f}) at step {step} of {s.steps}")
            break
