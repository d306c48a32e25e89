"""The SDK's image chunks, for a vision-language model served by ``rltk serve-tinker``.

A Tinker ``ModelInput`` is a list of chunks; an ``ImageChunk`` (PNG or JPEG bytes) stands for the image's
tokens at its place, ``expected_tokens`` of them when the client says how many. The text chunks around it
carry the model's image markers as its chat template writes them (Qwen-VL: ``<|vision_start|>`` before,
``<|vision_end|>`` after), as tinker-cookbook's renderers write them.

The service decodes the bytes, runs them through the served folder's image processor (``pixel_values`` and
``image_grid_thw``), and puts the image's placeholder token (``<|image_pad|>``) at the chunk's place once per
merged patch (:func:`expand`): the model input every forward and the sampler see, as
:func:`rltk.models.vision.inputs.encode_prompt` makes it for ``rltk run``. So a datum's ``loss_fn_inputs``
count the image's positions too (``ModelInput.length``, which counts ``expected_tokens``). An image's
positions score nothing useful (their targets are the client's), as in Tinker. A count that differs from
``expected_tokens``, bytes that do not decode, or another format are a 400 naming the chunk.

``ImageAssetPointerChunk`` (an address) is refused: the service fetches nothing from a client's addresses.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from rltk.batch import PromptImages


class ImageChunkError(ValueError):
    """An image chunk the service cannot use; ``field`` names it (``prompt.chunks[1]``)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass
class ImageIn:
    """One image chunk of a model input: where it goes (after ``at`` text tokens), its bytes and format."""

    at: int
    data: bytes
    format: str
    expected_tokens: int | None
    field: str


def expand(processor: Any, tokens: list[int], images: list[ImageIn]) -> tuple[list[int], PromptImages | None]:
    """``tokens`` with each image's placeholder tokens inserted at its place, and the images' processor outputs.

    ``images`` are in input order (``at`` non-decreasing). Without images: ``(tokens, None)``.
    """
    if not images:
        return list(tokens), None
    from PIL import Image, UnidentifiedImageError

    decoded = []
    for image in images:
        if image.format not in ("png", "jpeg"):
            raise ImageChunkError(image.field, f"format {image.format!r}; an image chunk is 'png' or 'jpeg'")
        try:
            with Image.open(io.BytesIO(image.data)) as opened:
                decoded.append(opened.convert("RGB"))
        except (UnidentifiedImageError, OSError) as exc:
            raise ImageChunkError(image.field, f"{len(image.data)} bytes that do not decode as a "
                                               f"{image.format.upper()} image: {exc}") from None
    out = processor.image_processor(images=decoded, return_tensors="pt")
    grids = out["image_grid_thw"].long()
    merge = int(getattr(processor.image_processor, "merge_size", 2))
    pad_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    expanded, start = [], 0
    for image, picture, grid in zip(images, decoded, grids):
        count = int(grid.prod()) // (merge * merge)
        if image.expected_tokens is not None and image.expected_tokens != count:
            width, height = picture.size
            raise ImageChunkError(image.field, f"expected_tokens={image.expected_tokens}, but this {width}x{height} "
                                               f"image is {count} tokens for the served model's processor (patch "
                                               f"grid {grid.tolist()}, {merge}x{merge} patches a token)")
        expanded.extend(tokens[start:image.at])
        expanded.extend([pad_id] * count)
        start = image.at
    expanded.extend(tokens[start:])
    return expanded, PromptImages(decoded, out["pixel_values"].float(), grids)
