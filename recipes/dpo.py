"""DPO and its variants (IPO, SLiC hinge, cDPO), offline from preference pairs or online from the policy's samples.

    rltk run dpo                                         # embedded tiny default: SFT warm-up, then DPO
    rltk run dpo dpo.loss=ipo dpo.beta=0.5               # another preference loss
    rltk run dpo data.path=prefs.jsonl dpo.chosen_key=chosen dpo.rejected_key=rejected
    rltk run dpo dpo.online=true                         # online DPO: pairs sampled from the current policy

The loop, as in the paper's algorithm box (Rafailov et al. 2023, arXiv:2305.18290):

    for each stage (e.g. a supervised warm-up, then DPO):
        pi_ref      <- the policy as the stage starts, frozen (LoRA: the adapters-off base)
        [precompute log pi_ref(y|x) of every pair once, and drop pi_ref]
        for step in 1..N:
            pairs       <- offline: the next (x, y_w, y_l) of the dataset
                           online: n samples per prompt from pi, scored by the reward fns;
                                   the best (y_w) and the worst (y_l) of each group whose scores differ
            ref log-probs of both responses (or the precomputed ones)
            update      <- one optimizer step of preference_loss(log pi(y_w) - log pi_ref(y_w),
                                                               log pi(y_l) - log pi_ref(y_l); beta)
                           [+ nll_coef * NLL(y_w): RPO]
            log (rewards/margins, rewards/accuracies ...), evaluate on held-out prompts
            guard, checkpoint

Without ``data.path`` the pairs come from the synthetic task: the correct answer chosen, a near miss
rejected (rltk.data.preferences). This file is a script, not a module: copy it to change the run, and the loop's module to change the loop.
"""

from __future__ import annotations

from rltk.recipes import finish_run, open_run, parse_recipe_args, recipe_stages, run_stages

# Every registered stage by name: `type: dpo` is the dpo loop (rltk/training/stages/dpo_stage.py; see grpo.py).
STAGES = recipe_stages("dpo")


def main():
    cfg = parse_recipe_args(STAGES)
    run = open_run(cfg)  # run folder, model, data, workflow, loggers, resume point
    run_stages(run, STAGES)  # each stage starts from the weights the one before ended with
    finish_run(run)  # held-out evaluation, curves.png, summary.json


if __name__ == "__main__":
    main()
