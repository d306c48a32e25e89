"""GRPO and its relatives (Dr. GRPO, DAPO, RLOO, REINFORCE++, GSPO, CISPO, ReMax) on one loop.

    rltk run grpo                                  # embedded tiny default: SFT warm-up, then GRPO
    rltk run grpo algorithm.name=rloo              # another preset
    rltk run grpo algorithm.advantage_fn=group_rank model.path=/models/qwen data.path=train.jsonl

The loop, as in the paper's algorithm box:

    for each stage (e.g. a supervised warm-up, then RL):
        for step in 1..N:
            rows        <- next prompts from the dataset
            experiences <- workflow(rows): n samples per prompt, each scored by the reward fns
                           (+ a greedy one per prompt if the estimator needs baseline_scores;
                           dynamic sampling: keep groups whose scores differ, refill from more rows)
            batch       <- sample strategy picks what to train on (+ expert data); padded to tensors
            old / ref log-probs of the sampled tokens
            advantages  <- advantage_fn(batch fields it names)
            update      <- ppo_epochs x mini-batches of policy_loss (+ KL, - entropy)
            log, evaluate on held-out prompts
            guard       <- stop if the run diverged (entropy collapse, nothing trained, nan weights)
            checkpoint

With trainer.mode=one_step_off or async the experiences of a step come instead from a producer process
that samples with weights at most trainer.max_staleness steps old (rltk.training.rollouts.rollout_source); the
rest of the step is the same.

Every named piece comes from the registry, so any of them is one config entry away.
This file is a script, not a module: copy it to change the run, and the loop's module to change the loop.
"""

from __future__ import annotations

from rltk.recipes import finish_run, open_run, parse_recipe_args, recipe_stages, run_stages

# The stages a config may chain: every registered one by name (sft, dpo, grpo, ppo, distill, a plugin's:
# `rltk list stage`), and `rl`, this recipe's own, the grpo loop (rltk/training/stages/grpo_stage.py). To change
# the loop, copy that module's function here and hand it over: recipe_stages("grpo", rl=StageSpec(my_loop, ...)).
STAGES = recipe_stages("grpo")


def main():
    cfg = parse_recipe_args(STAGES)
    run = open_run(cfg)  # run folder, model, data, workflow, loggers, resume point
    run_stages(run, STAGES)  # each stage starts from the weights the one before ended with
    finish_run(run)  # held-out evaluation, curves.png, summary.json


if __name__ == "__main__":
    main()
