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

This file is a script, not a module: copy it to change the run (the loop is
rltk/training/stages/reward_model_stage.py).
"""

from __future__ import annotations

from rltk.recipes import open_run, parse_recipe_args, recipe_stages, refuse_unsupported, run_stages, train_reward_model

# The stages before the reward model: sft ones (InstructGPT starts its reward model from the SFT model).
STAGES = recipe_stages("reward_model")


def main():
    cfg = parse_recipe_args(STAGES)
    refuse_unsupported(cfg)  # exit 2: RL stages before the reward model, a LoRA reward model
    run = open_run(cfg)  # run folder, tokenizer and policy (model.path or the tiny one), rows, loggers, resume point
    run_stages(run, STAGES)
    train_reward_model(run)  # the score-head model, held-out pairwise accuracy, <output_dir>/reward_model, summary


if __name__ == "__main__":
    main()
