"""PPO with a learned critic: GAE advantages, clipped policy and value losses, KL in the reward.

    rltk run ppo                                   # embedded tiny default: SFT warm-up, then PPO
    rltk run ppo algorithm.kl_controller=adaptive algorithm.kl_target=0.05
    rltk run ppo critic.lr=5e-5 critic.warmup_steps=20 model.path=/models/qwen data.path=train.jsonl

The loop, as in the algorithm box of RLHF-style PPO (Ziegler et al. 2019,
arXiv:1909.08593; Ouyang et al. 2022, arXiv:2203.02155; Schulman et al. 2017,
arXiv:1707.06347):

    for each stage (e.g. a supervised warm-up, then PPO):
        critic <- the policy's backbone + a value head (or critic.model_path)
        for step in 1..N:
            rows        <- next prompts from the dataset
            experiences <- workflow(rows): n samples per prompt, each scored by the reward fns
            batch       <- sample strategy picks what to train on; padded to tensors
            old / ref log-probs of the sampled tokens, values V(s_t) of the critic
            rewards     <- outcome reward on the last token - kl_coef * KL(pi_old || pi_ref) per token
            advantages  <- GAE(rewards, values); returns = advantages + values
            update      <- critic: ppo_epochs x mini-batches of the clipped value loss (every step)
                           policy: the same over the clipped policy loss (after critic.warmup_steps)
            kl_coef     <- fixed, or adapted towards algorithm.kl_target
            log, evaluate on held-out prompts
            guard       <- stop if the run diverged (entropy collapse, nothing trained, nan weights)
            checkpoint (policy and critic in one folder)

With trainer.mode=one_step_off or async the experiences of a step come from a producer process that
samples with weights at most trainer.max_staleness steps old (rltk.training.rollouts.rollout_source); the critic
and the rest of the step stay with the trainer.

Policy and critic have separate strategies and optimizers. Every named piece
comes from the registry, so any of them is one config entry away. This file is
a script, not a module: copy it to change the loop itself.
"""

from __future__ import annotations

from rltk.recipes import finish_run, open_run, parse_recipe_args, recipe_stages, run_stages

# Every registered stage by name, and `rl`: the ppo loop (rltk/training/stages/ppo_stage.py; see grpo.py).
STAGES = recipe_stages("ppo")


def main():
    cfg = parse_recipe_args(STAGES)
    run = open_run(cfg)  # run folder, model, data, workflow, loggers, resume point
    run_stages(run, STAGES)  # each stage starts from the weights the one before ended with
    finish_run(run)  # held-out evaluation, curves.png, summary.json


if __name__ == "__main__":
    main()
