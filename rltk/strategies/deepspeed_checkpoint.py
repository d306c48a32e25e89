"""DeepSpeed checkpoints outside a running strategy: their ``strategy.json``, the classes their files may
hold, conversion to a universal checkpoint, and export to a plain model folder (no process group needed).

The layout :meth:`~rltk.strategies.deepspeed_strategy.DeepSpeedStrategy.save` writes is in its docstring.
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from typing import Any

from torch import nn

from rltk.models.folders import load_model_folder
from rltk.serialization import check_torch_files, weights_only_everywhere
from rltk.strategies.base import MODEL_SUBDIR, STRATEGY_META_FILE, read_strategy_meta

CHECKPOINT_FORMAT = "rltk-deepspeed-v1"
DEEPSPEED_SUBDIR = "deepspeed"
UNIVERSAL_SUBDIR = "deepspeed_universal"
MODEL_CONFIG_SUBDIR = "model_config"  # config.json etc. when save_full_weights=False
CHECKPOINT_TAG = "state"


def read_checkpoint_meta(directory: str | Path) -> dict[str, Any]:
    """``strategy.json`` of a checkpoint written by :meth:`DeepSpeedStrategy.save`, checked."""
    directory = Path(directory)
    meta = read_strategy_meta(directory, "DeepSpeedStrategy", CHECKPOINT_FORMAT,
                              otherwise=f"start from its exported model folder '{directory / MODEL_SUBDIR}'")
    tag = meta.setdefault("tag", CHECKPOINT_TAG)
    # DeepSpeed joins the tag to the checkpoint folder: a path in it would read files from elsewhere.
    if not isinstance(tag, str) or not tag or tag in (".", "..") or "/" in tag or "\\" in tag:
        raise ValueError(f"checkpoint '{directory}' names DeepSpeed tag {tag!r} in {STRATEGY_META_FILE}; a tag is "
                         f"a plain folder name under '{DEEPSPEED_SUBDIR}/' (rltk writes {CHECKPOINT_TAG!r}).")
    return meta


def deepspeed_checkpoint_globals() -> list[Any]:
    """The classes DeepSpeed 0.19 pickles into its checkpoint files besides tensors and plain data.

    Measured on ZeRO-1/2/3 checkpoints (fp32, bf16, CPU offload) and their
    universal conversions: the loss scaler (static, or dynamic under fp16), the
    ZeRO stage enum, and ZeRO-1/2's fragment addresses. Each only stores the
    values it is built with, so constructing one from a file runs no code of
    the file's choosing. A newer DeepSpeed that pickles another class fails to
    resume with an error naming that class, never by loading it unchecked.
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def save_model_config(module: nn.Module, directory: Path) -> None:
    """Write a Hugging Face model's ``config.json`` (and generation config) without its weights.

    Modules without a Hugging Face config leave ``directory`` empty.
    """
    directory.mkdir(parents=True, exist_ok=True)
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    config = copy.deepcopy(config)
    config.architectures = [type(module).__name__]  # what save_pretrained records, so AutoModel finds it
    config.save_pretrained(directory)
    generation_config = getattr(module, "generation_config", None)
    if generation_config is not None and hasattr(generation_config, "save_pretrained"):
        generation_config.save_pretrained(directory)


def check_resumable(meta: dict[str, Any], zero_stage: int, directory: str | Path) -> None:
    """Raise unless a checkpoint described by ``meta`` can resume under ``zero_stage``.

    Measured with DeepSpeed 0.19 (universal checkpoints, any process counts):
    ZeRO-1 <-> ZeRO-2 and ZeRO-3 -> ZeRO-3 resume with weights, Adam moments
    and schedule; between ZeRO-1/2 and ZeRO-3 (either way) the converted
    checkpoint does not load, because ZeRO-3 keeps one model-state file per
    rank and ZeRO-1/2 a single one.
    """
    saved = meta.get("zero_stage")
    if saved is not None and (saved == 3) != (zero_stage == 3):
        raise ValueError(
            f"checkpoint '{directory}' was written under ZeRO-{saved} and cannot resume under ZeRO-{zero_stage}: "
            "DeepSpeed converts checkpoints between process counts and between ZeRO-1 and ZeRO-2, but not "
            f"between ZeRO-1/2 and ZeRO-3. Resume with zero_stage={saved}"
            f"{' (or the other of 1 and 2)' if saved != 3 else ''}, or start a new run from the full weights in "
            f"'{Path(directory) / MODEL_SUBDIR}' (the optimizer state starts fresh then)."
        )


def convert_to_universal(deepspeed_dir: str | Path, output_dir: str | Path, *, tag: str = CHECKPOINT_TAG) -> Path:
    """Convert DeepSpeed's sharded checkpoint into a universal checkpoint (``ds_to_universal``).

    A universal checkpoint stores every parameter's fp32 weight and Adam moments
    whole, so it loads under any number of processes and any ZeRO stage. Runs
    in this process only (no process group); returns ``output_dir``.
    """
    import argparse

    from deepspeed.checkpoint import ds_to_universal

    deepspeed_dir, output_dir = Path(deepspeed_dir), Path(output_dir)
    if not (deepspeed_dir / tag).is_dir():
        raise FileNotFoundError(f"no DeepSpeed checkpoint '{deepspeed_dir / tag}' to convert.")
    allowed = deepspeed_checkpoint_globals()
    check_torch_files(deepspeed_dir / tag, allowed_globals=allowed)
    # Convert beside the target and rename at the end: a conversion killed half-way is never mistaken
    # for a finished one.
    staging = output_dir.with_name(output_dir.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    args = argparse.Namespace(
        input_folder=str(deepspeed_dir / tag), output_folder=str(staging / tag), num_extract_workers=1,
        num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False,
    )
    with weights_only_everywhere(allowed):  # ds_to_universal reads the shards with weights_only=False
        ds_to_universal.main(args)
    (staging / "latest_universal").write_text(tag)
    shutil.rmtree(output_dir, ignore_errors=True)
    os.replace(staging, output_dir)
    return output_dir


def export_model_folder(checkpoint: str | Path, output_dir: str | Path) -> Path:
    """Write a plain Hugging Face model folder (safetensors) from a :class:`DeepSpeedStrategy` checkpoint.

    Copies the checkpoint's ``model/`` folder when it was saved with
    ``save_full_weights=True``. Otherwise consolidates the fp32 weights from
    DeepSpeed's shards (``zero_to_fp32``: any ZeRO stage and process count, one
    process, no GPU) into ``model.safetensors`` beside the model config that
    :meth:`DeepSpeedStrategy.save` kept in ``model_config/``. Returns ``output_dir``.
    """
    from safetensors.torch import save_file

    checkpoint, output_dir = Path(checkpoint), Path(output_dir)
    meta = read_checkpoint_meta(checkpoint)
    full_weights = checkpoint / MODEL_SUBDIR
    if full_weights.is_dir():
        load_model_folder(full_weights)  # fails with a clear message if the folder holds no weights
        shutil.copytree(full_weights, output_dir, dirs_exist_ok=True)
        return output_dir
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    allowed = deepspeed_checkpoint_globals()
    check_torch_files(checkpoint / DEEPSPEED_SUBDIR / meta["tag"], allowed_globals=allowed)
    with weights_only_everywhere(allowed):  # zero_to_fp32 reads the shards with weights_only=False
        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint / DEEPSPEED_SUBDIR), tag=meta["tag"])
    output_dir.mkdir(parents=True, exist_ok=True)
    # safetensors refuses tensors sharing storage (tied weights): store each key's own copy.
    save_file({name: tensor.contiguous().clone() for name, tensor in state.items()},
              str(output_dir / "model.safetensors"), metadata={"format": "pt"})
    config_dir = checkpoint / MODEL_CONFIG_SUBDIR
    if config_dir.is_dir():
        for item in config_dir.iterdir():
            shutil.copy2(item, output_dir / item.name)
    return output_dir
