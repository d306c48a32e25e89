"""Checks of the ``critic`` section, for recipes that train a critic."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from rltk.config.errors import ConfigError


def check_critic_config(cfg: DictConfig) -> None:
    """Check the ``critic`` section against the trainer's; raise ConfigError naming the key.

    Checked here rather than in the schema because the rules relate keys of
    two sections and only recipes with a critic read them (validation runs it
    when the advantage estimator needs ``values`` or the recipe has a critic).
    """
    c, t = cfg.critic, cfg.trainer
    if c.model_path:
        folder = Path(c.model_path).expanduser()
        if not folder.is_dir():
            raise ConfigError(
                f"bad value '{c.model_path}' for 'critic.model_path': "
                f"{'it is a file, not' if folder.exists() else 'no such folder; expected'} a critic folder or a "
                f"Hugging Face causal-LM folder (null copies the policy's backbone)"
            )
    if not c.lr > 0:
        raise ConfigError(f"bad value {c.lr!r} for 'critic.lr': must be > 0 (e.g. 1e-4)")
    if c.value_clip is not None and not c.value_clip > 0:
        raise ConfigError(
            f"bad value {c.value_clip!r} for 'critic.value_clip': must be > 0 (in reward units, e.g. 0.2) or null "
            "for an unclipped value loss"
        )
    if not 0 <= c.warmup_steps < t.total_steps:
        raise ConfigError(
            f"bad value {c.warmup_steps!r} for 'critic.warmup_steps': must be in [0, trainer.total_steps="
            f"{t.total_steps}) so that the policy is updated at least once"
        )
    policy_steps = t.total_steps - c.warmup_steps
    if t.warmup_steps > policy_steps:
        raise ConfigError(
            f"bad value {t.warmup_steps!r} for 'trainer.warmup_steps': the policy trains for trainer.total_steps - "
            f"critic.warmup_steps = {policy_steps} steps, so its LR warm-up must be in [0, {policy_steps}]"
        )
    if not 0 <= c.lr_warmup_steps <= t.total_steps:
        raise ConfigError(
            f"bad value {c.lr_warmup_steps!r} for 'critic.lr_warmup_steps': must be in [0, trainer.total_steps="
            f"{t.total_steps}]"
        )
    if not c.head_init_std >= 0:
        raise ConfigError(f"bad value {c.head_init_std!r} for 'critic.head_init_std': must be >= 0 (0 = zero init)")
