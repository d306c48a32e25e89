"""On-policy distillation: the student samples, a frozen teacher scores every sampled token.

    rltk run distill distill.teacher_path=runs/sft-tiny/checkpoints/step_001500   # embedded tiny student
    rltk run distill distill.teacher_path=/models/teacher model.path=/models/student data.path=prompts.jsonl
    rltk run distill distill.teacher_path=... algorithm.advantage_fn_args.task_coef=0.5   # + the reward's GRPO advantage

The loop, as in the algorithm box of GKD with lambda = 1 (Agarwal et al. 2024, arXiv:2306.13649) and of
Thinking Machines' "On-Policy Distillation" (2025):

    pi_T        <- the teacher (distill.teacher_path), frozen; it must share the student's tokenizer
    for each stage (e.g. a supervised warm-up of the student, then distillation):
        for step in 1..N:
            rows        <- next prompts from the dataset
            y ~ pi_S    <- workflow(rows): n samples per prompt from the student, scored by the reward fns
            log pi_S_old(y_t), log pi_T(y_t)   of every sampled token
            A_t         <- -(log pi_S_old(y_t) - log pi_T(y_t))  [+ task_coef * GRPO advantage of the reward]
            update      <- policy_loss(A) (one on-policy step: the ratio is 1, the gradient is
                           -A_t grad log pi_S(y_t), the reverse KL's)
            log reverse KL per token, teacher log-prob, task reward; evaluate on held-out prompts
            guard, checkpoint

No reward is needed to learn: the teacher's log-probs are the dense per-token signal (the reward fns still
score the samples, for the task-reward metric and for task_coef). This file is a script, not a
module: copy it to change the run (the loop is rltk/training/stages/distill_stage.py).
"""

from __future__ import annotations

from rltk.recipes import finish_run, open_run, parse_recipe_args, recipe_stages, run_stages, teacher_folders

# Every registered stage by name, and `rl`: the distill loop (rltk/training/stages/distill_stage.py; see grpo.py).
STAGES = recipe_stages("distill")


def main():
    cfg = parse_recipe_args(STAGES)
    # a missing or unreadable teacher stops the run before its folder is made (the tokenizer check
    # needs the student's tokenizer: load_teacher makes it when the stage starts)
    if any(st.type in ("distill", "rl") for st in cfg.stages):
        teacher_folders(cfg.distill.teacher_path)
    run = open_run(cfg)  # run folder, student model, data, workflow, loggers, resume point
    run_stages(run, STAGES)  # each stage starts from the weights the one before ended with
    finish_run(run)  # held-out evaluation, curves.png, summary.json


if __name__ == "__main__":
    main()
