"""Checks of ``model.lora``: its values, and whether it fits the model the run would build.

Two layers, both run by ``rltk validate`` and at the start of ``rltk run``:

* :func:`check_lora_values`: the section on its own (rank, alpha, dropout,
  the shape of ``target_modules``, that ``path`` is an adapter folder).
* :func:`check_lora_fits_model`: the targets and the adapter folder against
  the model's own modules. The model is built without weights (``meta``
  device) from ``model.path``'s config.json, or the embedded tiny model is
  built outright (it is tiny), so checking a 70B config costs no memory.

The matching rules (``unmatched_targets``, ``adapter_mismatches``, ...) live in
:mod:`rltk.models.lora`, which applies the same ones to the real model.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rltk.errors import ConfigError

# rltk.models.lora imports torch: each check imports it when it runs, so that importing rltk.config does not
# (`rltk dashboard` answers its page before anything has loaded torch).


def check_lora_values(cfg: DictConfig) -> None:
    """``model.lora`` on its own: rank, alpha, dropout, targets, adapter folder. Raises ConfigError."""
    from rltk.models.lora import adapter_config, lora_enabled, target_list

    lora = cfg.model.lora
    r = lora.r
    if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
        raise ConfigError(
            f"bad value {r!r} for 'model.lora.r': the adapter rank must be a positive integer (e.g. 8, 16, 64), "
            f"or 0/null for no LoRA"
        )
    if not lora_enabled(lora):
        return
    alpha = lora.alpha
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ConfigError(f"bad value {alpha!r} for 'model.lora.alpha': must be a number > 0 (the adapter output "
                          f"is scaled by alpha / r; alpha = 2 r is common)")
    dropout = lora.dropout
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ConfigError(f"bad value {dropout!r} for 'model.lora.dropout': must be a number in [0, 1)")
    target_list(lora.target_modules)
    if lora.path:
        adapter_config(lora.path)


def check_no_stage_lora(index: int, name: str, overrides: Any) -> None:
    """Refuse ``model.lora`` in a stage's overrides: the model and its adapter are built once per run.

    Every stage trains the same adapter (a warm-up hands its adapter to the RL
    stage), and resuming rebuilds the base from the run's config; a stage with
    LoRA of its own would need its starting weights kept beside the checkpoints.
    """
    keys = OmegaConf.to_container(overrides, resolve=False) if isinstance(overrides, DictConfig) else dict(overrides)
    for key, value in keys.items():
        touches = key == "model.lora" or key.startswith("model.lora.") or (
            key == "model" and isinstance(value, dict) and "lora" in value)
        if touches:
            raise ConfigError(
                f"stages[{index}].overrides (stage '{name}') sets '{key}': model.lora applies to the whole run (every "
                f"stage trains the same adapter). Set model.lora.* at the top level; to warm up with full weights and "
                f"then train an adapter, run the warm-up alone, `rltk export` it, and start the LoRA run from it with "
                f"model.path=<exported folder>"
            )


# ---------------------------------------------------------------- matching against a model


def model_skeleton(cfg: DictConfig):
    """The model the run would build, without weights where that matters: ``meta`` tensors from
    ``model.path``'s config.json, or the (tiny) embedded model itself."""
    if cfg.model.path:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            config = AutoConfig.from_pretrained(str(Path(cfg.model.path).expanduser()), local_files_only=True)
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config)
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"bad value '{cfg.model.path}' for 'model.path': cannot read its config.json as a "
                              f"causal LM to check model.lora against it: {exc}") from exc
    from rltk.models.tiny import build_tiny_from_config

    return build_tiny_from_config(cfg.model.tiny, cfg.seed)[1]


def model_description(cfg: DictConfig) -> str:
    """How a message names the run's base model."""
    return f"model.path='{cfg.model.path}'" if cfg.model.path else "the embedded tiny model (model.path null)"


def check_lora_fits_model(cfg: DictConfig) -> None:
    """``model.lora.target_modules`` and ``model.lora.path`` against the modules of the run's model."""
    from rltk.models.lora import check_adapter_fits, check_targets, linear_modules, lora_enabled, target_list

    lora = cfg.model.lora
    if not lora_enabled(lora):
        return
    try:
        linear = linear_modules(model_skeleton(cfg))
    except ValueError as exc:  # the tiny model's own shape rules (e.g. hidden_size vs num_heads)
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"model.tiny: {exc}") from exc
    if lora.path:
        check_adapter_fits(lora.path, linear, model_description(cfg))
    else:
        check_targets(target_list(lora.target_modules), linear)
