"""A VLM's image inputs as rows of a batch carry them: one sample's ``pixel_values`` and ``image_grid_thw``.

A processor (``Qwen2_5_VLProcessor`` ...) turns a prompt's images into ``pixel_values`` (one row per 14-pixel
patch, ``[patches, 3 * 2 * 14 * 14]``) and ``image_grid_thw`` (one ``(frames, height, width)`` patch grid per
image, ``[images, 3]``). The model places image ``i``'s features at the ``i``-th run of placeholder tokens of the
whole batch, in row order; so a batch's inputs are its rows' inputs concatenated in row order, and each row keeps
its own (the ``n`` samples of a prompt repeat their prompt's). Packing rows into one sequence would need the
patches re-ordered and the 3-D positions restarted per sample: refused instead (:func:`refuse_packing_reason`).
"""

from __future__ import annotations

from typing import Sequence

import torch

#: The keys of one sample's image inputs.
VISION_KEYS = ("pixel_values", "image_grid_thw")


def batch_vision_inputs(rows: Sequence[dict | None], device: torch.device | None = None) -> dict | None:
    """The model inputs of a batch whose row ``r`` has ``rows[r]`` (None or empty: no images), or None if none has."""
    given = [row for row in rows if row and row["image_grid_thw"].numel()]
    if not given:
        return None
    batch = {key: torch.cat([row[key] for row in given]) for key in VISION_KEYS}
    return {key: value.to(device) for key, value in batch.items()} if device is not None else batch


def refuse_packing_reason() -> str:
    """Why packing is refused for rows with images (the message an error gives)."""
    return ("packing (trainer.pack_sequences) is refused for rows with images: a packed row would need each "
            "sample's image patches re-ordered and its 3-D rotary positions restarted; run with packing off")
