"""The DeepSpeed config of :class:`~rltk.strategies.deepspeed_strategy.DeepSpeedStrategy`: derived from
rltk's settings, a user's raw config merged over it, and the result checked.

The mapping from rltk's settings to DeepSpeed keys is in the strategy module's docstring. A user
value ``"auto"`` keeps rltk's; keys that would contradict rltk (``optimizer``, ``scheduler``,
accumulation) are refused with the reason.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rltk.strategies.base import check_mixed_precision

ZERO_STAGES = (1, 2, 3)

# Keys rltk owns: a raw DeepSpeed config may not set them (other than to "auto" or rltk's own value).
_RLTK_OWNED_KEYS = {
    "optimizer": "rltk passes its own torch AdamW, built from setup(lr=..., betas=..., eps=..., weight_decay=...)",
    "scheduler": "rltk passes its own LambdaLR, built from setup(warmup_steps=..., lr_schedule=..., min_lr_ratio=...)",
}
_FIXED_KEYS = {
    "gradient_accumulation_steps": (1, "rltk accumulates micro-batches itself: every backward() before step() "
                                       "accumulates, step() ends the accumulation"),
    "managed_gradient_accumulation": (False, "rltk, not DeepSpeed's micro-step counter, decides when a step ends"),
}


def derive_deepspeed_config(*, zero_stage: int, offload_optimizer: bool, offload_params: bool,
                            mixed_precision: str, grad_clip: float | None, world_size: int,
                            pin_memory: bool = False) -> dict[str, Any]:
    """The DeepSpeed config rltk derives from its own settings (mapping in the module docstring).

    ``pin_memory`` pins offloaded CPU buffers for faster host-device copies;
    it only helps (and is only allowed) with a GPU.
    """
    zero: dict[str, Any] = {"stage": zero_stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": world_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": float(grad_clip) if grad_clip else 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": mixed_precision == "bf16"},
        # loss_scale 0 = dynamic loss scaling; an overflow skips the step and halves the scale.
        "fp16": {"enabled": mixed_precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "wall_clock_breakdown": False,
    }
    if offload_optimizer or offload_params:
        # Without this DeepSpeed replaces the torch AdamW by its CPU Adam (a 1-2 minute compile).
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def read_deepspeed_config(config: str | Path | Mapping | None) -> dict[str, Any]:
    """A raw DeepSpeed config as a plain dict: from a JSON file path, a mapping (or OmegaConf node), or ``{}``."""
    if config is None:
        return {}
    if isinstance(config, (str, Path)):
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"DeepSpeedStrategy: config='{path}' is not a file; pass the path of a "
                                    "DeepSpeed JSON config, a dict, or None.")
        try:
            loaded = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"DeepSpeedStrategy: config file '{path}' is not valid JSON: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ValueError(f"DeepSpeedStrategy: config file '{path}' must hold a JSON object, "
                             f"got {type(loaded).__name__}.")
        return loaded
    if hasattr(config, "_metadata") and hasattr(config, "_content"):  # an OmegaConf DictConfig
        from omegaconf import OmegaConf

        return OmegaConf.to_container(config, resolve=True)
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    raise TypeError(f"DeepSpeedStrategy: config={config!r} must be a path to a DeepSpeed JSON file, a dict, "
                    "or None.")


def merge_deepspeed_config(derived: dict[str, Any], user: dict[str, Any], path: str = "") -> dict[str, Any]:
    """``user`` merged over ``derived``, recursively; a user value ``"auto"`` keeps the derived one.

    Raises for a key rltk owns (``optimizer``, ``scheduler``, accumulation
    settings other than rltk's), and for ``"auto"`` where rltk has nothing to
    fill in, naming the key path.
    """
    merged = copy.deepcopy(derived)
    for key, value in user.items():
        where = f"{path}{key}"
        if not path and key in _RLTK_OWNED_KEYS:
            raise ValueError(f"DeepSpeed config key '{where}' is not allowed: {_RLTK_OWNED_KEYS[key]}. "
                             f"Remove '{where}' from the DeepSpeed config.")
        if not path and key in _FIXED_KEYS and value != "auto" and value != _FIXED_KEYS[key][0]:
            required, reason = _FIXED_KEYS[key]
            raise ValueError(f"DeepSpeed config key '{where}'={value!r} is not supported: {reason}. "
                             f"Remove it or set it to {json.dumps(required)}.")
        if value == "auto":
            if key not in derived:
                raise ValueError(f"DeepSpeed config key '{where}' is \"auto\" but rltk derives no value for it; "
                                 f"set it explicitly. rltk fills in: {', '.join(sorted(derived))}.")
            continue
        if isinstance(value, Mapping) and isinstance(derived.get(key), Mapping):
            merged[key] = merge_deepspeed_config(dict(derived[key]), dict(value), f"{where}.")
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def summarize_deepspeed_config(config: dict[str, Any]) -> dict[str, Any]:
    """The settings rltk reads back from a merged DeepSpeed config: ZeRO stage, offload, precision."""
    zero = config.get("zero_optimization") or {}

    def offloaded(section: str) -> bool:
        return (zero.get(section) or {}).get("device", "none") not in (None, "none")

    bf16 = bool((config.get("bf16") or {}).get("enabled"))
    fp16 = bool((config.get("fp16") or {}).get("enabled"))
    return {
        "zero_stage": zero.get("stage"),
        "offload_optimizer": offloaded("offload_optimizer"),
        "offload_params": offloaded("offload_param"),
        "mixed_precision": "bf16" if bf16 else "fp16" if fp16 else "no",
        "both_precisions": bf16 and fp16,
    }


def resolve_deepspeed_config(*, zero_stage: int, offload_optimizer: bool, offload_params: bool,
                             mixed_precision: str, user_config: dict[str, Any], world_size: int,
                             device: torch.device) -> dict[str, Any]:
    """Derive rltk's DeepSpeed config, merge ``user_config`` over it and check the result.

    The ``gradient_clipping`` placeholder is filled in by ``setup(grad_clip=...)``
    unless ``user_config`` sets it. Raises ``ValueError`` naming the DeepSpeed key
    and what is valid for: a ZeRO stage other than 1-3, parameter offload below
    ZeRO-3, bf16 and fp16 together, a precision the device cannot run, and a
    ``train_batch_size`` that DeepSpeed would reject.
    """
    config = merge_deepspeed_config(
        derive_deepspeed_config(zero_stage=zero_stage, offload_optimizer=offload_optimizer,
                                offload_params=offload_params, mixed_precision=mixed_precision, grad_clip=None,
                                world_size=world_size, pin_memory=device.type == "cuda"),
        user_config,
    )
    summary = summarize_deepspeed_config(config)
    stage = summary["zero_stage"]
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise ValueError(f"DeepSpeed config key 'zero_optimization.stage'={stage!r} is invalid; valid: 1, 2, 3 "
                         "(for plain data parallelism use training_strategy=accelerate).")
    if summary["offload_params"] and stage != 3:
        raise ValueError(
            f"offload_params=True (DeepSpeed key 'zero_optimization.offload_param.device') needs zero_stage=3, "
            f"got zero_stage={stage}: only ZeRO-3 partitions parameters. Use offload_optimizer=True with "
            "ZeRO-1/2, or zero_stage=3."
        )
    if summary["both_precisions"]:
        raise ValueError("DeepSpeed config enables both 'bf16.enabled' and 'fp16.enabled'; choose one "
                         "(mixed_precision='bf16' or 'fp16').")
    check_mixed_precision(summary["mixed_precision"], device)
    micro = config.get("train_micro_batch_size_per_gpu")
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
        raise ValueError(f"DeepSpeed config key 'train_micro_batch_size_per_gpu'={micro!r} must be an integer >= 1.")
    expected = micro * world_size  # gradient_accumulation_steps is always 1
    if "train_batch_size" in user_config and user_config["train_batch_size"] != "auto":
        if config["train_batch_size"] != expected:
            raise ValueError(
                f"DeepSpeed config key 'train_batch_size'={config['train_batch_size']!r} must equal "
                f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size = {micro} x 1 x "
                f"{world_size} = {expected}; rltk does not use DeepSpeed's data loader, so remove it or set it "
                "to \"auto\"."
            )
    config["train_batch_size"] = expected
    return config
