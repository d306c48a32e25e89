"""A dataset row's images (``data.image_key``, verl's ``images``): decoded, counted against the prompt's placeholders.

A row's image column holds one image or a list of them, each one of:

* a file path, relative to the data file's folder (or absolute);
* bytes of an encoded image (PNG, JPEG ...), or a ``{"bytes": ..., "path": ...}`` mapping, which is how parquet
  files and Hugging Face ``datasets``' ``Image`` column store them (the bytes win; the path is read when they are
  null);
* an array (numpy, or nested lists) of ``H x W`` grey or ``H x W x 3`` RGB (``x 4`` RGBA) values, integers in
  0-255 or floats in [0, 1] (nested lists of that shape are one image, see :func:`_is_pixel_rows`).

The prompt places them: one ``{"type": "image"}`` (or ``"image_url"``) content part per image in chat messages,
one ``<image>`` per image in a text prompt. A missing file, bytes that do not decode, an array of another shape,
or images and placeholders that do not match are an :class:`ImageDataError` naming the row, the key and the
file, raised while the rows load (before any model is built).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

#: A text prompt's placeholder for one image (verl's and LLaVA's).
TEXT_IMAGE_PLACEHOLDER = "<image>"
#: Chat content-part types that stand for one image.
IMAGE_PART_TYPES = ("image", "image_url")


class ImageDataError(ValueError):
    """A row's images cannot be read or do not match its prompt; the message names the row, the key and the file."""


def row_images(value: Any, *, where: str, key: str, base_dir: Path) -> list:
    """The RGB ``PIL.Image`` s of one row's image column (``[]`` for null); see the module docstring."""
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) and not _is_pixel_rows(value) else [value]
    return [decode_image(item, where=f"{where}, image {index}", key=key, base_dir=base_dir)
            for index, item in enumerate(items)]


def decode_image(value: Any, *, where: str, key: str, base_dir: Path):
    """One image as an RGB ``PIL.Image``; ``where`` names the row (and image) and ``key`` the column in errors."""
    from PIL import Image, UnidentifiedImageError


    column = f"column '{key}', data.image_key"
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        value = value.get("bytes") if value.get("bytes") is not None else value.get("path")
    if isinstance(value, (str, Path)):
        path = Path(value).expanduser()
        path = path if path.is_absolute() else base_dir / path
        if not path.is_file():
            raise ImageDataError(f"{where} ({column}): image file '{path}' does not exist (paths are relative to the "
                            f"data file's folder, {base_dir})")
        try:
            with Image.open(path) as image:
                return image.convert("RGB")
        except (UnidentifiedImageError, OSError) as exc:
            raise ImageDataError(f"{where} ({column}): image file '{path}' does not decode as an image: {exc}") from exc
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            with Image.open(io.BytesIO(bytes(value))) as image:
                return image.convert("RGB")
        except (UnidentifiedImageError, OSError) as exc:
            raise ImageDataError(f"{where} ({column}): {len(bytes(value))} bytes that do not decode as an image "
                            f"(PNG, JPEG ...): {exc}") from exc
    return _image_from_array(value, where=where, column=column)


def _image_from_array(value: Any, *, where: str, column: str):
    import numpy as np
    from PIL import Image


    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise ImageDataError(f"{where} ({column}): {type(value).__name__} is not an image (a path, bytes or an "
                        f"array)") from exc
    if array.dtype.kind not in "uif" or not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))) \
            or min(array.shape[:2], default=0) < 1:
        raise ImageDataError(f"{where} ({column}): an array of shape {array.shape} and dtype {array.dtype} is not an "
                        f"image; give H x W (grey) or H x W x 3 (RGB) numbers, or a path or bytes")
    if array.dtype.kind == "f":
        if array.min() < 0 or array.max() > 1:
            raise ImageDataError(f"{where} ({column}): float pixels must lie in [0, 1], got {array.min()}..{array.max()}")
        array = np.rint(array * 255)
    elif array.min() < 0 or array.max() > 255:
        raise ImageDataError(f"{where} ({column}): integer pixels must lie in 0..255, got {array.min()}..{array.max()}")
    return Image.fromarray(array.astype(np.uint8)).convert("RGB")


def _is_pixel_rows(value: Any) -> bool:
    """Whether a list is one image's nested pixel values rather than a list of images.

    Nested numbers that form ``H x W`` or ``H x W x 3|4`` are one image; anything else (paths, bytes, arrays,
    nested lists of another shape) is a list of images. Several grey images of width 3 or 4 as nested lists
    would read as one RGB image: give them as a list of arrays.
    """
    import numpy as np

    first = value[0] if len(value) else None
    if not (isinstance(first, (list, tuple)) and first and not isinstance(first[0], (str, bytes, dict))):
        return False
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):
        return False
    return array.dtype.kind in "uif" and (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4)))


def placeholder_count(prompt: str | list[dict]) -> int:
    """Images a prompt places: image content parts in chat messages, ``<image>`` in a text prompt."""
    if isinstance(prompt, str):
        return prompt.count(TEXT_IMAGE_PLACEHOLDER)
    return sum(1 for message in prompt if isinstance(message.get("content"), list)
               for part in message["content"] if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES)


def check_placeholders(prompt: str | list[dict], images: list, *, where: str, key: str) -> None:
    """Stop a row whose prompt places another number of images than its image column holds."""

    places = placeholder_count(prompt)
    if places != len(images):
        how = (f"'{TEXT_IMAGE_PLACEHOLDER}' in its text" if isinstance(prompt, str)
               else "{'type': 'image'} content parts in its messages")
        raise ImageDataError(f"{where}: {len(images)} image(s) in column '{key}' (data.image_key) but the prompt places "
                        f"{places} ({how}); give one placeholder per image")


#: A trace's thumbnail of an image: its longer side at most this many pixels ...
THUMBNAIL_SIDE = 64
#: ... and its PNG at most this many bytes (a 64 x 64 photo's PNG is ~10 KiB; the side shrinks until it fits).
THUMBNAIL_MAX_BYTES = 8192
#: The prefix of a thumbnail's ``src``: the dashboard shows no image whose address does not start with it.
THUMBNAIL_PREFIX = "data:image/png;base64,"


def thumbnail(image, *, side: int = THUMBNAIL_SIDE, max_bytes: int = THUMBNAIL_MAX_BYTES) -> dict:
    """A small PNG of ``image`` (a ``PIL.Image``, or anything :func:`decode_image` reads), as traces keep it.

    ``{"type": "image", "width": W, "height": H, "thumbnail": "data:image/png;base64,..."}``: ``W x H`` the
    image's own size, the thumbnail at most ``side`` pixels on its longer side (aspect kept, never enlarged)
    and at most ``max_bytes`` of PNG: a noisy image that does not fit is shrunk by 3/4 steps until it does.
    The dict is a chat content part (``type`` image), so a transcript that carries it still reads as one.
    """
    import base64

    from PIL import Image

    if not isinstance(image, Image.Image):
        image = decode_image(image, where="thumbnail", key="image", base_dir=Path("."))
    width, height = image.size
    target = max(1, min(int(side), max(width, height)))
    while True:
        small = image.convert("RGB")
        small.thumbnail((target, target), Image.Resampling.LANCZOS)
        buffer = io.BytesIO()
        small.save(buffer, format="PNG", optimize=True)
        data = buffer.getvalue()
        if len(data) <= max_bytes or target <= 4:
            break
        target = max(4, target * 3 // 4)
    return {"type": "image", "width": width, "height": height,
            "thumbnail": THUMBNAIL_PREFIX + base64.b64encode(data).decode("ascii")}


def is_image(value: Any) -> bool:
    """Whether ``value`` is a decoded image (a ``PIL.Image``), without importing PIL where nothing uses it."""
    import sys

    image_module = sys.modules.get("PIL.Image")
    return image_module is not None and isinstance(value, image_module.Image)
