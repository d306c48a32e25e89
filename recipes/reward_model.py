"""Reward-model training: a Bradley-Terry model learns to prefer the chosen response of each pair.

    rltk run reward_model                                  # embedded default: right vs wrong sums, tiny model
    rltk run reward_model data.path=prefs.jsonl data.answer_key=null \\
        reward_model.chosen_key=chosen reward_model.rejected_key=rejected model.path=/models/qwen

The loop, as in InstructGPT's reward-model step (Ouyang et al. 2022, eq. 1):

    policy <- model.path (or the tiny model), after the config's sft stages if any (the SFT model)
    model  <- the policy's architecture and backbone, with a one-output score head r(x, y)
    for step in 1..N:
        pairs  <- next (prompt x, chosen y_c, rejected y_r)
        r_c, r_r <- r(x, y_c), r(x, y_r)                      (the head at the last real token)
        loss   <- reward_model.loss(r_c, r_r): -mean log sigmoid(r_c - r_r) (bradley_terry)
        update; every reward_model.eval_every steps: held-out pairwise accuracy P(r_c > r_r)
    save the model and tokenizer: the folder the `reward_model` reward function loads

The output is <output_dir>/reward_model, a save_pretrained folder:

    reward: {reward_fn: [reward_model], reward_fn_args: {reward_model: {path: runs/rm-tiny/reward_model}}}

This file is a script, not a module: copy it to change the loop itself.
"""

from __future__ import annotations

import torch

import rltk
from rltk.data.sampler import RowSampler
from rltk.distributed import end_process_group, process_rank
from rltk.errors import ConfigError
from rltk.recipe_utils import parse_recipe_args
from rltk.training.updates.reward_model import (
    build_reward_model, pair_rewards, pairwise_accuracy, preference_pairs, save_reward_model, tokenize_pairs,
)
from rltk.training.stages.run import open_run, run_stages
from rltk.training.scaffold.run_outputs import write_summary
from rltk.training.scaffold.setup import args_of, build_strategy
from rltk.training.stages.sft_stage import run_sft_stage


def main():
    cfg = parse_recipe_args()
    r = cfg.reward_model
    refuse_unsupported(cfg)
    run = open_run(cfg)  # run folder, tokenizer and policy (model.path or the tiny one), rows, loggers, resume point
    # The stages before the reward model (type sft): InstructGPT starts its reward model from the SFT model.
    run_stages(run, {"sft": run_sft_stage})
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
        pairs = sampler.next_batch()[strategy.rank :: strategy.world_size]
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


def refuse_unsupported(cfg) -> None:
    """Exit 2 on what this recipe cannot train: RL stages before the reward model, a LoRA reward model."""
    problems = [f"'stages[{i}]' ('{st.name}') has type {st.type}: only sft stages can come before the reward "
                f"model (RL needs `rltk run grpo`)" for i, st in enumerate(cfg.stages) if st.type != "sft"]
    if cfg.model.lora.r or cfg.model.lora.path:  # the new score head must train whole, not as an adapter
        problems.append("'model.lora': the reward model trains whole (its score head is new); set model.lora.r=0")
    if problems:
        raise ConfigError("; ".join(problems))


if __name__ == "__main__":
    main()
