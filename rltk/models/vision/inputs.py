"""A VLM's image inputs as prompts and batch rows carry them: one prompt's images and processor outputs.

A processor (``Qwen2_5_VLProcessor`` ...) turns a prompt's images into ``pixel_values`` (one row per 14-pixel
patch, ``[patches, 3 * 2 * 14 * 14]``) and ``image_grid_thw`` (one ``(frames, height, width)`` patch grid per
image, ``[images, 3]``), and repeats the prompt's image placeholder once per merged patch. The model places image
``i``'s features at the ``i``-th run of placeholder tokens of the whole batch, in row order; so a batch's inputs
are its rows' inputs concatenated in row order, and each row keeps its own (the ``n`` samples of a prompt repeat
their prompt's).

**Per prompt** (what a workflow hands a rollout engine): :class:`rltk.batch.PromptImages` holds the decoded images (RGB
``PIL.Image`` s, what vLLM takes as ``multi_modal_data``) and the processor's outputs (what the ``hf`` engine and
every trainer forward take), made by :func:`encode_prompt` from the prompt's text and images; the prompt's ids
(placeholders expanded) come back beside it. A rollout engine's ``generate(prompt_ids, params,
vision_inputs=[PromptImages | None per prompt])`` reads whichever it needs.

**Per batch row** (what :func:`rltk.batch.collate` writes, :func:`rltk.batch.collate_vision`): ``pixel_values``
``[B, N, D]`` (each row's patches, zero rows after them) and ``image_grid_thw`` ``[B, I, 3]`` (each row's
grids, zero grids after them; a zero grid is no image). Padded tensors slice by row like every other field
(micro-batches, mini-batches, ranks, checkpoints), so no sample's images ever mix with another's;
:func:`vision_inputs_of` gives a slice's model inputs back. Packing rows into one sequence would need the
patches re-ordered and the 3-D positions restarted per sample: refused instead (:func:`refuse_packing_reason`).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from rltk.batch import PromptImages

#: The keys of one sample's image inputs.
VISION_KEYS = ("pixel_values", "image_grid_thw")
#: A text prompt's placeholder for one image (verl's and LLaVA's; :data:`rltk.data.images.TEXT_IMAGE_PLACEHOLDER`).
TEXT_IMAGE_PLACEHOLDER = "<image>"


def image_marker(processor) -> str:
    """The text one image stands for in ``processor``'s prompts, before the processor expands it.

    Qwen-VL chat templates render an image part as ``<|vision_start|><|image_pad|><|vision_end|>``; a text
    prompt's ``<image>`` is rewritten to that (or to the bare image token where the tokenizer has no markers).
    """
    token = processor.image_token
    vocab = processor.tokenizer.get_vocab()
    start, end = "<|vision_start|>", "<|vision_end|>"
    return f"{start}{token}{end}" if start in vocab and end in vocab else token


def encode_prompt(processor, text: str, images: Sequence) -> tuple[list[int], PromptImages | None]:
    """``(prompt ids, PromptImages)`` of a rendered prompt ``text`` and its ``images`` (``(ids, None)`` without).

    ``text`` holds one image marker per image (the chat template's, or ``<image>`` of a text prompt, see
    :func:`image_marker`); the processor expands each into the image's feature tokens, so the ids are what every
    forward sees and every token count (budgets, lengths) counts them.
    """
    if not images:
        return list(processor.tokenizer(text, add_special_tokens=False)["input_ids"]), None
    if processor.image_token not in text:
        text = text.replace(TEXT_IMAGE_PLACEHOLDER, image_marker(processor))
    out = processor(text=[text], images=list(images), return_tensors="pt", add_special_tokens=False)
    return out["input_ids"][0].tolist(), PromptImages(list(images), out["pixel_values"].float(),
                                                      out["image_grid_thw"].long())


def expanded_length(processor, text: str, images: Sequence) -> int:
    """How many ids :func:`encode_prompt` gives ``text`` with ``images``, from the images' sizes alone (no pixels
    processed): the text's tokens plus, per image, its feature tokens less the one placeholder they replace."""
    if images and processor.image_token not in text:
        text = text.replace(TEXT_IMAGE_PLACEHOLDER, image_marker(processor))
    length = len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
    image_processor = processor.image_processor
    merge = getattr(image_processor, "merge_size", 1) ** 2
    return length + sum(image_processor.get_number_of_image_patches(*_height_width(image), {}) // merge - 1
                        for image in images)


def _height_width(image) -> tuple[int, int]:
    """A ``PIL.Image``'s or an ``H x W (x C)`` array's height and width."""
    if hasattr(image, "height"):
        return image.height, image.width
    shape = getattr(image, "shape", None) or np.asarray(image).shape
    return int(shape[0]), int(shape[1])


def _model_inputs(row: Any) -> dict | None:
    if row is None:
        return None
    return row.model_inputs() if isinstance(row, PromptImages) else row


def batch_vision_inputs(rows: Sequence[Any], device: torch.device | None = None) -> dict | None:
    """The model inputs of a batch whose row ``r`` has ``rows[r]`` (a :class:`PromptImages`, a dict of
    :data:`VISION_KEYS`, or None / empty: no images), or None if none has."""
    given = [inputs for row in rows if (inputs := _model_inputs(row)) and inputs["image_grid_thw"].numel()]
    if not given:
        return None
    batch = {key: torch.cat([row[key] for row in given]) for key in VISION_KEYS}
    return {key: value.to(device) for key, value in batch.items()} if device is not None else batch


def row_vision_inputs(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> list[dict | None]:
    """Each row's own inputs from the padded fields (None for a row without images)."""
    rows: list[dict | None] = []
    for pixels, grids in zip(pixel_values, image_grid_thw):
        real = grids[grids.prod(-1) > 0]
        count = int(real.prod(-1).sum())
        rows.append({"pixel_values": pixels[:count], "image_grid_thw": real} if count else None)
    return rows


def vision_inputs_of(data: dict[str, torch.Tensor]) -> dict | None:
    """The model inputs of a batch (or a slice of one) that may hold the padded fields; None without images."""
    if "image_grid_thw" not in data:
        return None
    return batch_vision_inputs(row_vision_inputs(data["pixel_values"], data["image_grid_thw"]))


def image_token_count(image_grid_thw: torch.Tensor, merge_size: int = 2) -> torch.Tensor:
    """Placeholder tokens of each row's images (``[B, I, 3]`` padded grids -> ``[B]``): one per merged patch."""
    return image_grid_thw.prod(-1).sum(-1) // (merge_size * merge_size)


def token_type_ids(input_ids: torch.Tensor, model) -> torch.Tensor | None:
    """``mm_token_type_ids`` of ``input_ids`` (1 on image tokens, 2 on video tokens, 0 elsewhere), as a Qwen-VL
    processor gives them: without them the model cannot build its 3-D rotary positions and falls back to 1-D
    ones. None for a model whose config names no image token."""
    from rltk.models.wrappers import unwrap_model

    config = getattr(unwrap_model(model), "config", None)
    image_id = getattr(config, "image_token_id", None)
    if image_id is None:
        return None
    types = (input_ids == image_id).long()
    video_id = getattr(config, "video_token_id", None)
    if video_id is not None:
        types = types + 2 * (input_ids == video_id).long()
    return types


def refuse_packing_reason() -> str:
    """Why packing is refused for rows with images (the message an error gives)."""
    return ("packing (trainer.pack_sequences) is refused for rows with images: a packed row would need each "
            "sample's image patches re-ordered and its 3-D rotary positions restarted; run with packing off")
