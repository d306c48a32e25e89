"""Checks for an estimator that reads each reward function's own score (``reward_components``, gdpo).

The recipes fill ``reward_components [B, K]`` from every experience's
``reward_details``, column ``k`` for the k-th name of ``reward.reward_fn``.
Two configs cannot work, and are caught here before anything loads instead of
at the first step: weights per column that do not match the reward functions,
and expert data given one fixed score (``buffer.expert.score``), which carries
no per-reward scores.
"""

from __future__ import annotations

from omegaconf import DictConfig, ListConfig, OmegaConf

from rltk.config.errors import ConfigError


def check_reward_components(cfg: DictConfig, needs: frozenset[str]) -> None:
    """Raise ConfigError for a config the ``reward_components`` columns cannot serve (see the module)."""
    if "reward_components" not in needs:
        return
    names = list(cfg.reward.reward_fn)
    estimator = cfg.algorithm.advantage_fn
    weights = OmegaConf.select(cfg, "algorithm.advantage_fn_args.reward_weights")
    if weights is not None:
        if isinstance(weights, ListConfig):
            weights = OmegaConf.to_container(weights, resolve=True)
        if not isinstance(weights, list) or len(weights) != len(names):
            raise ConfigError(
                f"bad value {weights!r} for 'algorithm.advantage_fn_args.reward_weights': "
                f"'algorithm.advantage_fn'='{estimator}' weighs each reward function of reward.reward_fn {names}, "
                f"so give a list of {len(names)} numbers in that order (or leave it unset for all 1.0)"
            )
    expert = cfg.buffer.expert
    if expert.path and expert.score is not None:
        raise ConfigError(
            f"'buffer.expert.score'={expert.score} gives every expert response one score and no score per reward "
            f"function, which 'algorithm.advantage_fn'='{estimator}' needs (batch field reward_components, one "
            f"column per function of reward.reward_fn {names}); unset buffer.expert.score so that the reward "
            f"functions score the expert responses"
        )
