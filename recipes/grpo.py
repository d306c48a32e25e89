"""GRPO and its relatives (Dr. GRPO, DAPO, RLOO, REINFORCE++, GSPO, CISPO) on one loop.

    rltk run grpo                                  # embedded tiny default: SFT warm-up, then GRPO
    rltk run grpo algorithm.name=rloo              # another preset
    rltk run grpo algorithm.advantage_fn=group_rank model.path=/models/qwen data.path=train.jsonl

The loop, as in the paper's algorithm box:

    for each stage (e.g. a supervised warm-up, then RL):
        for step in 1..N:
            rows        <- next prompts from the dataset
            experiences <- workflow(rows): n samples per prompt, each scored by the reward fns
            batch       <- sample strategy picks what to train on; padded to tensors
            old / ref log-probs of the sampled tokens
            advantages  <- advantage_fn(batch fields it names)
            update      <- ppo_epochs x mini-batches of policy_loss (+ KL, - entropy)
            log, evaluate on held-out prompts, checkpoint

Every named piece comes from the registry, so any of them is one config entry away.
This file is a script, not a module: copy it to change the loop itself.
"""

from __future__ import annotations

import copy
import time

import torch

import rltk
from rltk.algorithms.aggregation import masked_mean
from rltk.algorithms.kl import AdaptiveKLController, FixedKLController, apply_kl_penalty
from rltk.batch import collate
from rltk.buffer.buffer import ExperienceBuffer
from rltk.checkpoint import CheckpointManager
from rltk.data.sampler import RowSampler
from rltk.loggers.plot import plot_metrics
from rltk.recipe_utils import parse_recipe_args
from rltk.training.resume import load_model_weights, load_weights, resume_point, save_weights_atomically
from rltk.training.rl import LossComponents, batched_logprobs, compute_advantages, policy_update
from rltk.training.setup import (
    MetricLog, args_of, build_loggers, process_rank, build_reward, build_rows, build_strategy,
    build_tokenizer_and_policy, prepare_run_dir, sampling_params, seed_everything, sft_pairs,
    stage_config, write_summary,
)
from rltk.training.sft import sft_batch, sft_step


def evaluate(workflow, rows, cfg) -> dict[str, float]:
    """Greedy held-out accuracy of the current policy."""
    limit = cfg.trainer.eval_size or len(rows)
    result = workflow.evaluate(rows[:limit], sampling_params(cfg, greedy=True))
    return {f"eval/{k}": float(v) for k, v in result.items()}


def run_sft_stage(cfg, stage_index, policy, tokenizer, train_rows, ckpt, metric_log, first_step, resume):
    """Supervised warm-up: cross-entropy on solved examples, so the RL stage starts with some accuracy."""
    s = cfg.sft
    strategy = build_strategy(cfg, policy, lr=s.lr, total_steps=s.steps, warmup_steps=s.warmup_steps,
                              lr_schedule=s.lr_schedule)
    sampler = RowSampler(sft_pairs(train_rows, tokenizer, s.completion_key), s.batch_size,
                         seed=cfg.seed + stage_index, shuffle=cfg.data.shuffle)
    start = 0
    if resume is not None:
        state = ckpt.load(resume["path"], strategy)
        sampler.load_state_dict(state["sampler"])
        start = state["stage_step"]

    for step in range(start + 1, s.steps + 1):
        batch = sft_batch(sampler.next_batch(), tokenizer.pad_token_id)
        metrics = sft_step(strategy, batch, micro_batch_size=cfg.trainer.micro_batch_size,
                           impl=cfg.model.logprob_impl, chunk_size=cfg.model.logprob_chunk_size)
        metric_log.log({f"sft/{k}": v for k, v in metrics.items()}, first_step + step)
        if should_checkpoint(cfg, step, s.steps):
            save(ckpt, strategy, first_step + step, stage_index, step, sampler, done=step == s.steps)


def run_rl_stage(cfg, stage_index, policy, tokenizer, train_rows, eval_rows, workflow, run_dir, ckpt, metric_log,
                 first_step, resume):
    a, t = cfg.algorithm, cfg.trainer
    strategy = build_strategy(cfg, policy, lr=t.lr, total_steps=t.total_steps, warmup_steps=t.warmup_steps,
                              lr_schedule=t.lr_schedule)
    policy = strategy.unwrap()

    # Components, each chosen by name in the config.
    sample_strategy = rltk.get_component("sample_strategy", cfg.buffer.sample_strategy)(
        **args_of(cfg, "buffer.sample_strategy"))
    advantage_fn = rltk.get_component("advantage_fn", a.advantage_fn)
    loss = LossComponents(
        policy_loss=rltk.get_component("policy_loss", a.policy_loss),
        policy_loss_args=args_of(cfg, "algorithm.policy_loss"),
        loss_agg=rltk.get_component("loss_agg", a.loss_agg),
        loss_agg_args=args_of(cfg, "algorithm.loss_agg"),
        kl_penalty=rltk.get_component("kl_penalty_fn", a.kl_penalty_fn),
        kl_penalty_args=args_of(cfg, "algorithm.kl_penalty_fn"),
        kl_in=a.kl_in,
        entropy_coef=a.entropy_coef,
    )
    kl_ctl = (AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon) if a.kl_controller == "adaptive"
              else FixedKLController(a.kl_coef))
    buffer = ExperienceBuffer()
    sampler = RowSampler(train_rows, t.prompts_per_step, seed=cfg.seed + stage_index, shuffle=cfg.data.shuffle)
    generator = torch.Generator().manual_seed(cfg.seed)

    # The reference policy is the policy as this stage starts (after any warm-up), frozen;
    # its weights are kept beside the checkpoints so a resumed run compares against the same one.
    reference = copy.deepcopy(policy).eval().requires_grad_(False) if a.kl_coef > 0 else None
    reference_file = run_dir / "stage_weights" / f"stage_{stage_index}_reference.safetensors"
    start = 0
    if resume is not None:
        state = ckpt.load(resume["path"], strategy)
        sampler.load_state_dict(state["sampler"])
        start = state["stage_step"]
        kl_ctl.value = state["kl_coef"]
        generator.manual_seed(cfg.seed + start)
        if reference is not None:
            load_weights(reference_file, reference)
    elif reference is not None:
        save_weights_atomically(reference.state_dict(), reference_file)
    if start == 0:
        metric_log.log(evaluate(workflow, eval_rows, cfg), first_step)

    for step in range(start + 1, t.total_steps + 1):
        tick = time.perf_counter()
        # rollout: n samples for each prompt, scored by the reward functions
        # every rank draws the same global batch of prompts and samples its own share of it
        experiences = workflow.run(sampler.next_batch()[strategy.rank :: strategy.world_size])
        buffer.put(experiences, step)
        experiences = sample_strategy.sample(buffer, step)
        if not experiences:  # e.g. every group filtered out as all-equal: nothing to learn from
            metric_log.log({"skipped_empty_batch": 1.0, **sample_strategy.metrics()}, first_step + step)
            continue
        batch = collate(experiences, tokenizer.pad_token_id)

        # old and reference log-probs of the sampled tokens
        common = dict(micro_batch_size=t.micro_batch_size, temperature=cfg.rollout.temperature,
                      impl=cfg.model.logprob_impl, chunk_size=cfg.model.logprob_chunk_size)
        if a.use_rollout_logprobs:
            batch["old_logprobs"] = batch["rollout_logprobs"]
        else:
            batch["old_logprobs"], _ = batched_logprobs(policy, batch, **common)
        kl_metrics = {}
        if reference is not None:
            batch["ref_logprobs"], _ = batched_logprobs(reference, batch, **common)
            kl = loss.kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], **loss.kl_penalty_args)
            mask = batch["response_mask"]
            kl_metrics["kl"] = masked_mean(kl, mask).item()
            if a.kl_in == "reward":  # fold the penalty into the per-token rewards before advantages
                batch["token_rewards"] = apply_kl_penalty(batch["token_rewards"], kl, kl_ctl.value, mask)

        # advantages from the fields the estimator names
        compute_advantages(advantage_fn, batch, args_of(cfg, "algorithm.advantage_fn"))

        # update: ppo_epochs x mini-batches, one optimizer step each
        update_metrics = policy_update(strategy, batch, loss, kl_coef=kl_ctl.value, mini_batches=t.mini_batches,
                                       ppo_epochs=t.ppo_epochs, generator=generator, **common)
        workflow.engine.update_weights(strategy.unwrap())  # colocated engines share the module: a no-op
        if reference is not None:
            kl_ctl.update(kl_metrics["kl"], len(experiences))

        # log
        elapsed = time.perf_counter() - tick
        metrics = {
            "reward": batch["scores"].mean().item(),
            "accuracy": (batch["scores"] >= 1).float().mean().item(),
            "response_length": batch["response_lengths"].float().mean().item(),
            "kl_coef": kl_ctl.value,
            "tokens_per_s": batch["attention_mask"].sum().item() / elapsed,
            "time/step_s": elapsed,
            **kl_metrics, **update_metrics, **workflow.metrics(),
            **{f"reward_fn/{k}": v for k, v in workflow.reward.stats().items()},
            **sample_strategy.metrics(),
        }
        if t.eval_every and (step % t.eval_every == 0 or step == t.total_steps):
            metrics.update(evaluate(workflow, eval_rows, cfg))
        metric_log.log(metrics, first_step + step)

        # checkpoint
        if should_checkpoint(cfg, step, t.total_steps):
            save(ckpt, strategy, first_step + step, stage_index, step, sampler, done=step == t.total_steps,
                 extra={"kl_coef": kl_ctl.value})


def should_checkpoint(cfg, step: int, last: int) -> bool:
    every = cfg.checkpoint.every
    return step == last or (every > 0 and step % every == 0)


def save(ckpt, strategy, global_step, stage_index, stage_step, sampler, *, done, extra=None):
    state = {"stage": stage_index, "stage_step": stage_step, "stage_done": done,
             "sampler": sampler.state_dict(), **(extra or {})}
    path = ckpt.save(global_step, strategy, state)
    rltk.get_plugin_manager().hook.rltk_on_checkpoint(step=global_step, path=path)
    return path


def main():
    cfg = parse_recipe_args()
    seed_everything(cfg.seed)
    run_dir = prepare_run_dir(cfg)
    tokenizer, policy = build_tokenizer_and_policy(cfg)
    seed_everything(cfg.seed + process_rank())  # same initial weights, different samples per rank
    tokenizer.save_pretrained(run_dir / "tokenizer")  # so `rltk export` yields a complete model folder
    train_rows, eval_rows = build_rows(cfg, tokenizer)
    stages = [stage_config(cfg, i) for i in range(len(cfg.stages))]
    stage_steps = [s.sft.steps if st.type == "sft" else s.trainer.total_steps for s, st in zip(stages, cfg.stages)]

    # The rollout engine shares the policy module; the workflow samples, scores and evaluates.
    engine = rltk.get_component("rollout_engine", cfg.rollout.engine)(
        model=policy, tokenizer=tokenizer, **args_of(cfg, "rollout.engine"))
    workflow = rltk.get_component("workflow", cfg.rollout.workflow)(
        engine=engine, tokenizer=tokenizer, reward=build_reward(cfg), sampling=sampling_params(cfg),
        **args_of(cfg, "rollout.workflow"))

    # resume: the latest complete checkpoint, if any (checkpoint.resume=never starts over)
    ckpt = CheckpointManager(run_dir / "checkpoints", keep_last=cfg.checkpoint.keep_last)
    resume = resume_point(ckpt, cfg.checkpoint.resume)
    resume_step = resume["global_step"] if resume is not None else 0
    metric_log = MetricLog(build_loggers(cfg, run_dir, sum(stage_steps), resume_step=resume_step))
    if resume is not None:
        print(f"rltk: resuming from {resume['path']} (stage {resume['stage']}, step {resume['stage_step']})")
    rltk.get_plugin_manager().hook.rltk_on_train_start(config=cfg, run_dir=run_dir)

    first_step = 0
    for i, (scfg, stage) in enumerate(zip(stages, cfg.stages)):
        stage_resume = None
        if resume is not None:
            if resume["stage"] > i or (resume["stage"] == i and resume["stage_done"]):
                first_step += stage_steps[i]  # finished before the interruption
                continue
            if resume["stage"] == i:
                stage_resume = resume  # continue this stage mid-way
            else:
                load_model_weights(resume["path"], policy)  # start from where the last stage ended
            resume = None
        if stage.type == "sft":
            run_sft_stage(scfg, i, policy, tokenizer, train_rows, ckpt, metric_log, first_step, stage_resume)
        else:
            run_rl_stage(scfg, i, policy, tokenizer, train_rows, eval_rows, workflow, run_dir, ckpt, metric_log,
                         first_step, stage_resume)
        first_step += stage_steps[i]
    if resume is not None:  # the checkpoint was the run's last: nothing left to train
        load_model_weights(resume["path"], policy)

    # final evaluation, plot and summary
    final = evaluate(workflow, eval_rows, stages[-1])
    metric_log.close()
    if process_rank() != 0:
        return
    print("rltk: final held-out " + ", ".join(f"{k}={v:.3f}" for k, v in final.items()))
    if cfg.logging.plot and (run_dir / "metrics.jsonl").exists():
        plot_metrics(run_dir / "metrics.jsonl", run_dir / "curves.png", keys=("reward", "eval/accuracy"))
    summary = {"final": final, "steps": first_step}
    write_summary(run_dir, summary)
    rltk.get_plugin_manager().hook.rltk_on_train_end(run_dir=run_dir, metrics=summary)


if __name__ == "__main__":
    main()
