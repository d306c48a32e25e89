"""Warnings for KL settings the user gave that take no effect because ``algorithm.kl_coef`` is 0."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

# The KL settings that only matter when a KL penalty is applied (algorithm.kl_coef > 0).
_KL_KEYS = ("kl_penalty_fn", "kl_in", "kl_controller", "kl_target")


def kl_warnings(cfg: DictConfig, user_nodes: list[tuple[str, DictConfig]], preset_name: str,
                preset: dict) -> list[str]:
    """Messages for KL settings the user gave that do nothing because ``algorithm.kl_coef`` is 0.

    ``user_nodes`` are ``(source, node)`` of what the user wrote, highest
    precedence first (command line, then files from last to first). With
    ``kl_coef`` 0 the recipes never build the reference model, so a KL
    estimator, its placement and its controller are silently unused; the same
    holds for a preset chosen by the user that puts the KL in the reward.
    Stages that set their own ``algorithm.kl_coef`` above 0 count as using it.
    """
    coefs = [cfg.algorithm.kl_coef] + [
        stage.overrides["algorithm.kl_coef"] for stage in cfg.stages
        if stage.overrides and "algorithm.kl_coef" in stage.overrides
    ]
    if any(c != 0 for c in coefs):
        return []

    def origin(key: str) -> str | None:
        for name, node in user_nodes:
            if OmegaConf.select(node, key) is not None:
                return name
        return None

    given = []
    for key in _KL_KEYS:
        where = origin(f"algorithm.{key}")
        if where is not None:
            given.append(f"algorithm.{key}={OmegaConf.select(cfg, f'algorithm.{key}')} ({where})")
    where = origin("algorithm.name")
    if where is not None and preset.get("kl_in") == "reward" and origin("algorithm.kl_in") is None:
        given.append(f"the {preset.get('kl_penalty_fn')} KL in the reward of algorithm.name={preset_name} ({where})")
    if not given:
        return []
    coef_from = origin("algorithm.kl_coef") or (f"preset '{preset_name}'" if "kl_coef" in preset else "the default")
    return [
        f"KL setting(s) without effect: {'; '.join(given)}. algorithm.kl_coef is 0 (from {coef_from}), so no KL "
        f"penalty is computed; set algorithm.kl_coef to a positive value (e.g. algorithm.kl_coef=0.01) to use it"
    ]
