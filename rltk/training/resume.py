"""Where a run resumes from, and the weights that outlive a stage."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from rltk.checkpoint import STATE_FILE, CheckpointManager, give_default_mode
from rltk.config.loader import ConfigError
from rltk.strategies.base import MODEL_SUBDIR, load_full_state_into, load_model_folder


def resume_point(ckpt: CheckpointManager, mode: str) -> dict[str, Any] | None:
    """The checkpoint a run continues from: ``{"path", "global_step", **saved state}`` or None.

    ``mode`` is ``checkpoint.resume``: ``auto`` (the latest complete checkpoint,
    if any), ``never`` (start over), or a checkpoint folder.
    """
    if mode == "never":
        return None
    if mode == "auto":
        path = ckpt.latest()
        if path is None:
            return None
    else:
        path = Path(mode)
        if not (path / STATE_FILE).is_file():
            raise ConfigError(
                f"checkpoint.resume='{mode}' is not a complete rltk checkpoint (no {STATE_FILE} in it). "
                f"Valid: auto, never, or a step_XXXXXX folder under <output_dir>/checkpoints"
            )
    payload = json.loads((path / STATE_FILE).read_text())
    return {"path": path, "global_step": payload["step"], **payload["state"]}


def load_model_weights(checkpoint: str | Path, model: torch.nn.Module) -> None:
    """Copy only the model weights of a checkpoint into ``model`` (a new stage starts from them)."""
    folder = Path(checkpoint) / MODEL_SUBDIR
    load_full_state_into(model, load_model_folder(folder), folder)


def save_weights_atomically(state_dict: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write ``state_dict`` as safetensors through a temporary file and a rename."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A temporary name of this process's own: every rank of a run may write the same file at once
    # (the same bytes), and a shared name let one rank's rename take the file from under another's.
    temp = str(path.with_name(f".tmp-{uuid.uuid4().hex}-{path.name}"))
    try:
        # safetensors refuses tensors sharing storage (tied embeddings): store copies.
        save_file({k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()}, temp)
        give_default_mode([temp])
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def load_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Load a file written by :func:`save_weights_atomically` into ``model``."""
    from safetensors.torch import load_file

    load_full_state_into(model, load_file(str(path), device="cpu"), path)


def remove_run_state(run_dir: str | Path) -> None:
    """Delete checkpoints and stage weights of a previous run (``checkpoint.resume=never``)."""
    for name in ("checkpoints", "stage_weights"):
        shutil.rmtree(Path(run_dir) / name, ignore_errors=True)
