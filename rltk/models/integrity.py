"""Refuse weights that would load but cannot work: unreadable, non-finite, or one repeated byte.

A checkpoint's verification (:meth:`rltk.checkpoint.CheckpointManager.verify`) checks sizes and
headers, so a file overwritten in place at the same size (every byte 0xFF, say) passes it and only
shows up as NaN log-probs on every request. :func:`check_weights` reads every ``.safetensors``
file of a model folder (memory-mapped) and raises :class:`DamagedCheckpointError` naming the file,
and the tensor where there is one, when:

* the file does not open as safetensors (truncated, header damaged);
* a floating-point tensor holds NaN or inf;
* the file's tensor data is a single byte value repeated (all 0x00, all 0xFF): no trained
  model is that, and a zeroed or wiped file is what it looks like.

Other weight formats (``.bin`` pickles) are left to their loaders; checking is linear in the
weights' size (about 1 s per GB here).
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import numpy as np
import torch

from rltk.serialization import DamagedCheckpointError


def _data_is_one_byte(path: Path) -> int | None:
    """The byte every byte of the file's tensor data is, or ``None`` when they differ (or there is no data)."""
    with open(path, "rb") as handle:
        header_len = struct.unpack("<Q", handle.read(8))[0]
        start = 8 + header_len
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            data = np.frombuffer(mapped, dtype=np.uint8, offset=start) if len(mapped) > start else None
            if data is None or data.size == 0:
                return None
            first = int(data[0])
            step = 1 << 24
            for chunk_start in range(0, data.size, step):  # chunks: no file-sized temporary
                if not (data[chunk_start:chunk_start + step] == first).all():
                    del data
                    return None
            del data
            return first


def check_weights(folder: str | Path) -> None:
    """Raise :class:`DamagedCheckpointError` for the first damaged ``.safetensors`` file under ``folder``."""
    from safetensors import safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as weights:
                names = list(weights.keys())
                for name in names:
                    tensor = weights.get_tensor(name)
                    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                        bad = int((~torch.isfinite(tensor)).sum())
                        raise DamagedCheckpointError(path, f"tensor '{name}' holds {bad} NaN/inf values of "
                                                           f"{tensor.numel()}: the weights are damaged")
        except DamagedCheckpointError:
            raise
        except Exception as exc:  # safetensors' own errors: truncated file, bad header
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DamagedCheckpointError(path, f"it does not open as safetensors ({reason[:200]}): the file is "
                                               "truncated or damaged") from None
        try:
            byte = _data_is_one_byte(path)
        except (OSError, struct.error, ValueError, json.JSONDecodeError):
            byte = None
        if byte is not None and names:
            raise DamagedCheckpointError(path, f"every byte of its tensor data is 0x{byte:02X}: the file was wiped "
                                               "or overwritten")
