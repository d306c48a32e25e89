"""Export a checkpoint as a plain Hugging Face model folder."""

from __future__ import annotations

import shutil
from pathlib import Path

from rltk.checkpoint import (
    STATE_FILE,
    CheckpointManager,
    damage_summary,
    strategy_checkpoint_globals,
)
from rltk.errors import ConfigError
from rltk.io import give_default_mode
from rltk.models.lora import is_adapter_folder
from rltk.serialization import DamagedCheckpointError, check_json
from rltk.strategies.base import MODEL_SUBDIR, STRATEGY_META_FILE

TOKENIZER_SUBDIR = "tokenizer"  # saved by recipes at <output_dir>/tokenizer


def _checkpoint_globals(checkpoint: Path) -> list:
    """The allow-list of the registered strategy that wrote ``checkpoint`` (named in its strategy.json)."""
    from rltk.registry import list_components

    meta_file = checkpoint / STRATEGY_META_FILE
    if not meta_file.is_file():
        return []
    meta = check_json(meta_file)
    written_by = meta.get("strategy") if isinstance(meta, dict) else None
    for entry in list_components("training_strategy"):
        if getattr(entry.obj, "__name__", None) == written_by:
            return strategy_checkpoint_globals(entry.obj)
    return []


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, merge: bool = False) -> Path:
    """Copy a checkpoint's full model weights and config, plus the run's tokenizer, to ``out_dir``.

    ``checkpoint`` is a ``step_XXXXXX`` folder under ``<output_dir>/checkpoints``.
    Strategies that shard their checkpoints (DeepSpeed ZeRO) consolidate full
    weights into ``model/`` through their ``export_model_folder`` hook.

    A LoRA run's checkpoint holds only its adapter: without ``merge`` the
    export is that peft adapter folder (``adapter_config.json``,
    ``adapter_model.safetensors``; load it with ``PeftModel.from_pretrained``
    on the base model, or as ``model.lora.path``). With ``merge`` the base
    model is rebuilt from the run's ``config.yaml`` (``model.path``, or the
    seeded tiny model), the adapter is folded into its weights, and the export
    is a plain Hugging Face folder that transformers loads without peft. For a
    checkpoint of full weights ``merge`` changes nothing.
    """
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if not (checkpoint / STATE_FILE).is_file():
        raise ConfigError(
            f"'{checkpoint}' is not a complete rltk checkpoint (no {STATE_FILE}); pass a step_XXXXXX folder "
            f"under <output_dir>/checkpoints"
        )
    # The checkpoint's files are read (and DeepSpeed's shards unpickled) below: refuse a damaged one, or one
    # holding anything but tensors and plain data, naming the file.
    damage = CheckpointManager(checkpoint.parent).verify(checkpoint, allowed_globals=_checkpoint_globals(checkpoint))
    if damage:
        raise DamagedCheckpointError(damage[0].path, damage[0].reason, (
            f"checkpoint '{checkpoint}' is damaged: {damage_summary(damage, checkpoint)}. Export another checkpoint "
            "of the run (an earlier step_XXXXXX folder)."
        ))
    model_dir = checkpoint / MODEL_SUBDIR
    if is_adapter_folder(model_dir):
        _refuse_non_empty(out_dir)
        if merge:
            written = _write_merged(checkpoint, model_dir, out_dir)
        else:
            out_dir.mkdir(parents=True, exist_ok=True)
            written = [shutil.copy2(item, out_dir / item.name) for item in model_dir.iterdir() if item.is_file()]
        written += _copy_tokenizer(checkpoint, out_dir)
        give_default_mode(written)
        return out_dir
    if not (model_dir / "config.json").is_file():
        from rltk.strategies.deepspeed_checkpoint import export_model_folder

        model_dir = export_model_folder(checkpoint, out_dir / ".consolidated")
    _refuse_non_empty(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for item in model_dir.iterdir():
        if item.is_file():
            written.append(shutil.copy2(item, out_dir / item.name))
    shutil.rmtree(out_dir / ".consolidated", ignore_errors=True)
    written += _copy_tokenizer(checkpoint, out_dir)
    # copy2 keeps the source's mode, and checkpoints written before rltk fixed it hold 0600 weights
    give_default_mode(written)
    return out_dir


def _refuse_non_empty(out_dir: Path) -> None:
    if out_dir.exists() and any(p.name != ".consolidated" for p in out_dir.iterdir()):
        raise ConfigError(f"output folder '{out_dir}' is not empty; choose a new folder")


def _copy_tokenizer(checkpoint: Path, out_dir: Path) -> list:
    """The run's tokenizer (saved at ``<output_dir>/tokenizer``) into ``out_dir``; the files written."""
    from rltk.models.loading import make_auto_tokenizer_exact

    tokenizer_dir = checkpoint.parent.parent / TOKENIZER_SUBDIR
    if not tokenizer_dir.is_dir():
        return []
    written = [shutil.copy2(item, out_dir / item.name) for item in tokenizer_dir.iterdir() if item.is_file()]
    return written + make_auto_tokenizer_exact(out_dir)


def _write_merged(checkpoint: Path, adapter_dir: Path, out_dir: Path) -> list:
    """The base model of the run that wrote ``checkpoint`` with its adapter merged, saved to ``out_dir``."""
    from omegaconf import OmegaConf

    from rltk.config.schema import RunConfig
    from rltk.models.lora import merged_copy
    from rltk.models.folders import load_full_state_into, load_model_folder, save_model_folder
    from rltk.training.scaffold.setup import build_tokenizer_and_policy

    config_file = checkpoint.parent.parent / "config.yaml"
    if not config_file.is_file():
        raise ConfigError(
            f"cannot merge the adapter of '{checkpoint}': the run's config ({config_file}) is missing, and it names "
            f"the base model. Export without --merge (the adapter folder) and merge it onto the base yourself"
        )
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(config_file))
    _, policy = build_tokenizer_and_policy(cfg)  # the base the run trained on, with an adapter of its shape
    load_full_state_into(policy, load_model_folder(adapter_dir), adapter_dir)
    merged = merged_copy(policy)
    save_model_folder(merged, merged.state_dict(), out_dir)
    return [p for p in out_dir.iterdir() if p.is_file()]
