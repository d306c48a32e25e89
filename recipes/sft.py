"""Supervised fine-tuning: token-level cross-entropy on demonstrations, as a run of its own.

    rltk run sft                                            # embedded tiny default: two-digit addition
    rltk run sft data.path=train.jsonl sft.completion_key=completion      # prompt / completion columns
    rltk run sft data.path=chats.jsonl data.messages_key=messages        # chat transcripts
    rltk run sft model.lora.r=8 trainer.pack_sequences=true strategy=fsdp2

The loop (the stage is the very one a GRPO or PPO run warms up with, rltk/training/stages/sft_stage.py):

    for step in 1..N:
        batch <- next demonstrations: (prompt, response, loss mask); the mask covers a completion
                 and its eos, or only the assistant turns of a chat transcript (never user or tool turns)
        loss  <- - sum m * log pi(y_t | x, y_<t) / sum m   (micro-batched, padded, token-budgeted or packed)
        update; every sft.eval_every steps: held-out accuracy (greedy and sampled)
        guard <- stop if the run diverged; checkpoint

Chain it before DPO or RL with `stages` (type: sft, then dpo, grpo or ppo), or start a GRPO run from its
last checkpoint (checkpoint.start_from). This file is a script, not a module: copy it to change the run.
"""

from __future__ import annotations

from rltk.recipes import finish_run, open_run, parse_recipe_args, recipe_stages, run_stages

# Every registered stage by name: a config's `stages` may chain dpo, grpo or ppo after the sft one (see grpo.py).
STAGES = recipe_stages("sft")


def main():
    cfg = parse_recipe_args(STAGES)
    run = open_run(cfg)  # run folder, model, data, workflow, loggers, resume point
    run_stages(run, STAGES)  # each stage starts from the weights the one before ended with
    finish_run(run)  # held-out evaluation, curves.png, summary.json


if __name__ == "__main__":
    main()
