"""The reward-model loop: a Bradley-Terry model learns to prefer the chosen response of each pair.

InstructGPT's reward-model step (Ouyang et al. 2022, arXiv:2203.02155, eq. 1): ``loss = -mean log
sigmoid(r(x, y_c) - r(x, y_r))`` (``reward_model.loss``, by default ``bradley_terry``). It trains after a
run's stages (the SFT model is its starting point) a model that is not the policy, so it is registered as
``reward_model`` (:mod:`rltk.components.builtin_stages`) but not chainable: ``rltk run reward_model`` runs it.
The algorithm box is ``recipes/reward_model.py``'s docstring.
"""

from __future__ import annotations

import torch

import rltk
from rltk.data.sampler import RowSampler
from rltk.distributed import end_process_group, process_rank
from rltk.errors import ConfigError
from rltk.training.scaffold.rows import refuse_image_rows
from rltk.training.scaffold.run_outputs import write_summary
from rltk.training.scaffold.setup import args_of, build_strategy
from rltk.training.stages.run import Run, Stage
from rltk.training.updates.reward_model import (
    build_reward_model, pair_rewards, pairwise_accuracy, preference_pairs, save_reward_model, tokenize_pairs,
)


def refuse_unsupported(cfg) -> None:
    """Exit 2 on what this recipe cannot train: RL stages before the reward model, a LoRA reward model."""
    problems = [f"'stages[{i}]' ('{st.name}') has type {st.type}: only sft stages can come before the reward "
                f"model (RL needs `rltk run grpo`)" for i, st in enumerate(cfg.stages) if st.type != "sft"]
    if cfg.model.lora.r or cfg.model.lora.path:  # the new score head must train whole, not as an adapter
        problems.append("'model.lora': the reward model trains whole (its score head is new); set model.lora.r=0")
    if problems:
        raise ConfigError("; ".join(problems))


def run_reward_model_stage(stage: Stage):
    """Train a reward model from the policy as the stage starts (``rltk run reward_model``)."""
    refuse_image_rows(stage.run.train_rows, stage.cfg, "the reward_model stage (its preference pairs)")
    train_reward_model(stage.run)


def train_reward_model(run: Run) -> None:
    """Train and save ``<output_dir>/reward_model`` from ``run.policy`` after the run's stages; write summary.json."""
    cfg = run.cfg
    r = cfg.reward_model
    first_step = run.last_step  # where the stages before it ended
    model = build_reward_model(cfg, run.policy)  # same architecture and backbone, a score head for the LM head
    tokenizer = run.tokenizer
    train = tokenize_pairs(preference_pairs(run.train_rows, cfg, split="train"), tokenizer, r.max_length)
    held_out = tokenize_pairs(preference_pairs(run.eval_rows, cfg, split="heldout"), tokenizer, r.max_length)
    loss_fn = rltk.get_component("reward_model_loss", r.loss)
    loss_args = args_of(cfg, "reward_model.loss")

    strategy = build_strategy(cfg, model, lr=r.lr, total_steps=r.steps, warmup_steps=r.warmup_steps,
                              lr_schedule=r.lr_schedule)
    sampler = RowSampler(train, r.batch_size, seed=cfg.seed, shuffle=cfg.data.shuffle)
    mb = cfg.trainer.micro_batch_size

    def evaluate() -> dict[str, float]:
        return pairwise_accuracy(strategy.unwrap(), held_out, tokenizer.pad_token_id, strategy.device, mb)

    run.metric_log.log_evaluation(evaluate(), first_step)
    for step in range(1, r.steps + 1):
        # every rank draws the same pairs and trains on its share; the loss is a mean over all of them
        pairs = sampler.next_batch()[strategy.data_rank :: strategy.data_world_size]
        total = strategy.all_reduce_sum(torch.tensor([float(len(pairs))], dtype=torch.float64)).item()
        metrics: dict[str, float] = {}
        starts = range(0, len(pairs), mb)
        for i, start in enumerate(starts):
            chunk = pairs[start:start + mb]
            with strategy.accumulate(i == len(starts) - 1):
                with strategy.autocast():
                    chosen, rejected = pair_rewards(strategy.model, chunk, tokenizer.pad_token_id, strategy.device)
                    loss, parts = loss_fn(chosen_rewards=chosen, rejected_rewards=rejected, **loss_args)
                    loss = loss * len(chunk) / total  # the micro-batch's share of the global mean
                strategy.backward(loss)
            metrics["rm/loss"] = metrics.get("rm/loss", 0.0) + loss.item()
            for k, v in parts.items():
                metrics[k] = metrics.get(k, 0.0) + v * len(chunk) / total
        metrics.update({k: float(v) for k, v in strategy.step().items()})
        if r.eval_every and (step % r.eval_every == 0 or step == r.steps):
            metrics.update(evaluate())
        run.metric_log.log(metrics, first_step + step)

    final = evaluate()
    folder = run.run_dir / "reward_model"
    if process_rank() == 0:
        save_reward_model(strategy.unwrap(), tokenizer, folder)
        print("rltk: final held-out " + ", ".join(f"{k}={v:.3f}" for k, v in final.items()))
        print(f"rltk: reward model saved to {folder} (reward.reward_fn_args.reward_model.path)")
        write_summary(run.run_dir, {"final": final, "steps": first_step + r.steps, "reward_model": str(folder)})
    run.metric_log.close()
    end_process_group()
