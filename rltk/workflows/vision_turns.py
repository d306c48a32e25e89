"""Images in multi-turn episodes: what an environment shows the policy between its turns.

An environment's observation (or its opening, or a row's chat messages) may hold image content parts in
the HF/OpenAI chat format, the image itself under ``"image"``::

    StepResult(observation=[{"role": "user", "content": [
        {"type": "image", "image": picture},          # a PIL.Image, PNG/JPEG bytes, a path or an array
        {"type": "text", "text": "This is the board after your move."}]}])

(the values :func:`rltk.data.images.decode_image` reads). A row's ``{"type": "image"}`` parts without one
take the row's ``images`` (``data.image_key``) in order.

With a vision-language policy the workflow renders such messages with the chat template, as text ones,
and runs the text and the new images through the policy's processor (:func:`encode_images`): each image's
marker becomes its run of image tokens (one per merged patch) in the episode's ids, and its
``pixel_values`` and ``image_grid_thw`` join the episode's :class:`rltk.batch.PromptImages`
(:func:`join_images`), which the engine gets with every later turn's prompt (``vision_inputs``), so the
policy sees every image shown so far when it writes its next turn, and the episode's experience keeps
(``Experience.vision``), so every log-prob pass of the trainer sees them too. An image the policy cannot
see (a text policy, no processor) is an error naming the episode, never a silent drop.

The episode's record (``Experience.info["messages"]``) keeps a thumbnail of each image in its place
(:func:`transcript_record`): JSON, small, and what the trace view shows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rltk.batch import PromptImages
from rltk.data.images import IMAGE_PART_TYPES, decode_image, is_image, thumbnail


def image_parts(messages: Sequence[Mapping]) -> list[dict]:
    """The image content parts of ``messages``, in order."""
    return [part for message in messages if isinstance(message.get("content"), list)
            for part in message["content"] if isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES]


def message_images(messages: Sequence[Mapping], where: str) -> list:
    """The decoded images (RGB ``PIL.Image`` s) of ``messages``' image parts, in order.

    A part without its image (``{"type": "image"}`` alone) is an error naming ``where``: an environment
    must put the image in the part; a row's parts are filled from its ``images`` first (:func:`with_row_images`).
    """
    from pathlib import Path

    images = []
    for index, part in enumerate(image_parts(messages)):
        value = part.get("image", part.get("image_url"))
        if isinstance(value, Mapping) and "url" in value:  # OpenAI's {"type": "image_url", "image_url": {"url"}}
            value = value["url"]
        if value is None:
            raise ValueError(f"{where}: image part {index} has no image; put it under 'image' "
                             f"({{'type': 'image', 'image': <PIL.Image, bytes, path or array>}})")
        images.append(value if is_image(value) else
                      decode_image(value, where=f"{where}, image part {index}", key="image", base_dir=Path(".")))
    return images


def with_row_images(messages: list[dict], row: Mapping, where: str, *, all_shown: bool = True) -> list[dict]:
    """``messages`` whose image parts without an image take ``row["images"]`` in order (a dataset row's).

    ``all_shown``: the messages must place every image of the row (a row's own messages); otherwise (an
    environment's opening, which may show the row's images or not) messages without empty parts stay as
    they are."""
    images = list(row.get("images") or [])
    if not images:
        return messages
    empty = [part for part in image_parts(messages) if part.get("image") is None and part.get("image_url") is None]
    if not empty and not all_shown:
        return messages
    if len(empty) != len(images):
        raise ValueError(f"{where}: {len(images)} image(s) in the row's 'images' but its messages have {len(empty)} "
                         f"image part(s) without one; give one {{'type': 'image'}} part per image")
    out, supply = [], iter(images)
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [{**part, "image": next(supply)} if isinstance(part, Mapping) and part.get("type")
                       in IMAGE_PART_TYPES and part.get("image") is None and part.get("image_url") is None
                       else part for part in content]
        out.append({**message, "content": content})
    return out


def encode_images(processor: Any, text: str, images: Sequence) -> tuple[list[int], PromptImages]:
    """``(ids, PromptImages)`` of rendered ``text`` holding one image marker per image.

    The processor expands each marker (Qwen-VL: ``<|vision_start|><|image_pad|><|vision_end|>``) into the
    image's tokens; the ids are tokenized without special tokens added, as the workflow's other ids are.
    """
    out = processor(text=[text], images=list(images), return_tensors="pt", add_special_tokens=False)
    ids = out["input_ids"][0].tolist()
    image_token = getattr(processor, "image_token", None)
    grids = out["image_grid_thw"]
    if image_token is not None:
        token_id = processor.tokenizer.convert_tokens_to_ids(image_token)
        merge = getattr(getattr(processor, "image_processor", None), "merge_size", 2)
        if ids.count(token_id) != int(grids.prod(-1).sum()) // (merge * merge):
            raise ValueError(f"{len(images)} image(s) but the rendered text has {text.count(image_token)} "
                             f"'{image_token}' marker(s): the chat template must render one per image part")
    return ids, PromptImages(list(images), out["pixel_values"].float(), grids.long())


def join_images(vision: PromptImages | None, new: PromptImages | None) -> PromptImages | None:
    """The images of an episode so far (``vision``) and those of a newly appended message (``new``), in order:
    the model places image ``i``'s features at the ``i``-th run of image tokens of the sequence."""
    import torch

    if new is None:
        return vision
    if vision is None:
        return new
    return PromptImages(vision.images + new.images, torch.cat([vision.pixel_values, new.pixel_values]),
                        torch.cat([vision.image_grid_thw, new.image_grid_thw]))


def image_count(vision: PromptImages | None) -> int:
    """How many images ``vision`` holds."""
    return 0 if vision is None else int(vision.image_grid_thw.shape[0])


def transcript_record(messages: Sequence[Mapping]) -> list[dict]:
    """``messages`` as JSON: each image part replaced by its thumbnail part (:func:`rltk.data.images.thumbnail`)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [_part_record(part) for part in content]
        out.append({**message, "content": content})
    return out


def _part_record(part: Any) -> Any:
    if not isinstance(part, Mapping) or part.get("type") not in IMAGE_PART_TYPES:
        return part
    value = part.get("image")
    rest = {k: v for k, v in part.items() if k not in ("image", "image_url")}
    if value is None:
        return rest
    return {**rest, **thumbnail(value)}
