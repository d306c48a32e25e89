"""Export a checkpoint as a plain Hugging Face model folder."""

from __future__ import annotations

import shutil
from pathlib import Path

from rltk.checkpoint import (
    STATE_FILE,
    CheckpointManager,
    damage_summary,
    give_default_mode,
    strategy_checkpoint_globals,
)
from rltk.config.errors import ConfigError
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


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Copy a checkpoint's full model weights and config, plus the run's tokenizer, to ``out_dir``.

    ``checkpoint`` is a ``step_XXXXXX`` folder under ``<output_dir>/checkpoints``.
    Strategies that shard their checkpoints (DeepSpeed ZeRO) consolidate full
    weights into ``model/`` through their ``export_model_folder`` hook.
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
    if not (model_dir / "config.json").is_file():
        from rltk.strategies.deepspeed_strategy import export_model_folder

        model_dir = export_model_folder(checkpoint, out_dir / ".consolidated")
    if out_dir.exists() and any(p.name != ".consolidated" for p in out_dir.iterdir()):
        raise ConfigError(f"output folder '{out_dir}' is not empty; choose a new folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for item in model_dir.iterdir():
        if item.is_file():
            written.append(shutil.copy2(item, out_dir / item.name))
    shutil.rmtree(out_dir / ".consolidated", ignore_errors=True)
    tokenizer_dir = checkpoint.parent.parent / TOKENIZER_SUBDIR
    if tokenizer_dir.is_dir():
        for item in tokenizer_dir.iterdir():
            written.append(shutil.copy2(item, out_dir / item.name))
    # copy2 keeps the source's mode, and checkpoints written before rltk fixed it hold 0600 weights
    give_default_mode(written)
    return out_dir
