"""Export a checkpoint as a plain Hugging Face model folder."""

from __future__ import annotations

import shutil
from pathlib import Path

from rltk.checkpoint import STATE_FILE, give_default_mode
from rltk.config.errors import ConfigError
from rltk.strategies.base import MODEL_SUBDIR

TOKENIZER_SUBDIR = "tokenizer"  # saved by recipes at <output_dir>/tokenizer


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
