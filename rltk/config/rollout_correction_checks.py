"""Checks of ``algorithm.rollout_correction`` (the rollout/trainer mismatch correction)."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from rltk.algorithms.mismatch import check_rollout_correction, correction_active
from rltk.config.errors import ConfigError

_KEY = "algorithm.rollout_correction"


def check_rollout_correction_config(cfg: DictConfig) -> None:
    """Levels, thresholds and the mode combination; and that the correction has something to correct.

    With ``algorithm.use_rollout_logprobs=true`` the old log-probs *are* the
    rollout log-probs, every ratio is 1 and a correction would silently do
    nothing, so that combination is refused.
    """
    settings = OmegaConf.to_container(OmegaConf.select(cfg, _KEY), resolve=True)
    settings.pop("log_metrics", None)
    try:
        check_rollout_correction(settings, where=_KEY)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if correction_active(settings) and cfg.algorithm.use_rollout_logprobs:
        on = ", ".join(f"{_KEY}.{k}={settings[k]}" for k in ("tis", "mis", "rejection") if settings[k] is not None)
        raise ConfigError(
            f"{on} corrects between the trainer's old log-probs and the engine's, but "
            f"algorithm.use_rollout_logprobs=true makes them the same (every ratio would be 1). "
            f"Set algorithm.use_rollout_logprobs=false so the trainer recomputes the old log-probs, "
            f"or turn the correction off"
        )
