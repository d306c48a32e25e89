"""Algorithm presets (kind ``algorithm``): named bundles of ``algorithm.*`` defaults.

``algorithm.name=rloo`` switches every default below at once; anything set in
YAML or on the command line still wins. A plugin adds a preset the same way.
"""

from __future__ import annotations

import rltk

GRPO = {
    "description": "GRPO (Shao et al. 2024): group-normalised outcome advantages, PPO clip, k3 KL as a loss term.",
    "advantage_fn": "grpo",
    "advantage_fn_args": {"norm_by_std": True},
    "policy_loss": "ppo_clip",
    "policy_loss_args": {"clip_eps_low": 0.2, "clip_eps_high": 0.2},
    "loss_agg": "token-mean",
    "kl_penalty_fn": "k3",
    "kl_in": "loss",
}

DR_GRPO = {
    **GRPO,
    "description": "Dr. GRPO (Liu et al. 2025): no std normalisation, constant-length loss normaliser.",
    "advantage_fn_args": {"norm_by_std": False},
    "loss_agg": "seq-mean-token-sum-norm",
}

DAPO = {
    **GRPO,
    "description": "DAPO (Yu et al. 2025): clip-higher (0.2 / 0.28), token-level loss, no KL, dynamic sampling.",
    "policy_loss_args": {"clip_eps_low": 0.2, "clip_eps_high": 0.28},
    "kl_coef": 0.0,
    # Only groups whose scores differ are trained on; more prompts are sampled until the batch holds
    # trainer.prompts_per_step of them (Sec. 3.2 of the paper).
    "dynamic_sampling": True,
}

RLOO = {
    **GRPO,
    "description": "RLOO (Ahmadian et al. 2024): leave-one-out baseline, KL folded into the reward.",
    "advantage_fn": "rloo",
    "advantage_fn_args": {},
    "kl_penalty_fn": "k1",
    "kl_in": "reward",
}

REINFORCE_PP = {
    **GRPO,
    "description": "REINFORCE++ (Hu 2025): batch-whitened discounted returns, k2 KL in the reward.",
    "advantage_fn": "reinforce_plus_plus",
    "advantage_fn_args": {},
    "kl_penalty_fn": "k2",
    "kl_in": "reward",
}

REINFORCE_PP_BASELINE = {
    **REINFORCE_PP,
    "description": "REINFORCE++-baseline: group-mean baseline, then batch whitening.",
    "advantage_fn": "reinforce_plus_plus_baseline",
}

GSPO = {
    **GRPO,
    "description": "GSPO (Zheng et al. 2025): sequence-level importance ratio and clipping.",
    "policy_loss": "gspo",
    "policy_loss_args": {},
    "loss_agg": "seq-mean-token-mean",
}

CISPO = {
    **GRPO,
    "description": "CISPO (MiniMax-M1, 2025): clipped, detached importance weights on every token.",
    "policy_loss": "cispo",
    "policy_loss_args": {},
}

GPG = {
    **GRPO,
    "description": "GPG (Chu et al. 2025): group baseline rescaled by B/(B-M), plain policy gradient, no KL.",
    "advantage_fn": "gpg",
    "advantage_fn_args": {},
    "policy_loss": "gpg",
    "policy_loss_args": {},
    "kl_coef": 0.0,
}

SAPO = {
    **GRPO,
    "description": "SAPO (2025): group-normalised advantages, soft sigmoid gate instead of a hard clip, sequence-mean loss.",
    "policy_loss": "sapo",
    "policy_loss_args": {},
    "loss_agg": "seq-mean-token-mean",
}

GMPO = {
    **GRPO,
    "description": "GMPO (Zhao et al. 2025): geometric mean of token ratios, log-space clip (e^-0.4, e^0.4), sequence-mean loss.",
    "policy_loss": "geo_mean",
    "policy_loss_args": {},
    "loss_agg": "seq-mean-token-mean",
}

REMAX = {
    **GRPO,
    "description": "ReMax (Li et al. 2023): the greedy response's reward as baseline, k1 KL in the reward.",
    "advantage_fn": "remax",
    "advantage_fn_args": {},
    # The recipes generate one greedy response per prompt for the baseline because remax names
    # baseline_scores in its signature.
    "kl_penalty_fn": "k1",
    "kl_in": "reward",
}


OPMD = {
    **GRPO,
    "description": "OPMD (Trinity-RFT, Pan et al. 2025): R minus the group mean, -A logp / (1 + tau), no clip, k2 KL as a loss term.",
    "advantage_fn": "opmd",
    "advantage_fn_args": {"baseline": "mean", "tau": 1.0},
    "policy_loss": "opmd",
    "policy_loss_args": {"tau": 1.0},
    "loss_agg": "token-mean",
    # Trinity-RFT's opmd algorithm type: kl_loss_fn k2, kl_penalty_fn none
    "kl_penalty_fn": "k2",
    "kl_in": "loss",
}

PPO = {
    "description": "PPO with a critic (Schulman et al. 2017; RLHF form of Ouyang et al. 2022): GAE, clip, k1 KL in the reward.",
    "advantage_fn": "gae",
    "advantage_fn_args": {"gamma": 1.0, "lam": 0.95},
    "policy_loss": "ppo_clip",
    "policy_loss_args": {"clip_eps_low": 0.2, "clip_eps_high": 0.2},
    "loss_agg": "token-mean",
    "kl_penalty_fn": "k1",
    "kl_in": "reward",
    # The per-token penalty of InstructGPT-style PPO, small enough that a tiny model
    # still moves; kl_controller=adaptive (with kl_target) makes it track a target KL.
    "kl_coef": 0.01,
    "kl_controller": "fixed",
}


@rltk.hookimpl
def rltk_algorithms():
    return {
        "grpo": GRPO,
        "dr_grpo": DR_GRPO,
        "dapo": DAPO,
        "rloo": RLOO,
        "reinforce_plus_plus": REINFORCE_PP,
        "reinforce_plus_plus_baseline": REINFORCE_PP_BASELINE,
        "gspo": GSPO,
        "cispo": CISPO,
        "gpg": GPG,
        "sapo": SAPO,
        "gmpo": GMPO,
        "remax": REMAX,
        "opmd": OPMD,
        "ppo": PPO,
    }
