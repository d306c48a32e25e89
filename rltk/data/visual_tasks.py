"""Synthetic visual tasks: a picture drawn in code and a question only the picture answers.

``shape_colour``: one shape (a square, a disc or a triangle) of a random size and place on a noisy dark
background; the question, the same text in every row, asks for the shape's colour, one of ``colours``
(``red green blue`` by default). The colours are dealt in turn before the rows are shuffled, so every answer
is as frequent as any other (to within one row): a policy that does not look at the image can do no better
than ``1 / len(colours)``, the task's text-only chance level, whatever it learns from the prompts.

Each row is in the standard form of a dataset row with images (:mod:`rltk.data.loading`): the prompt is one
user message whose content is an image part and a text part (the HF/OpenAI chat form, rendered by the
model's chat template: ``data.use_chat_template=true``), and ``images`` holds that one RGB ``PIL.Image``,
decoded and checked against the prompt's placeholder by :mod:`rltk.data.images` like a data file's column
(``data.image_key``). The ground truth is the colour's name, which the supervised warm-up teaches, and
``extras["choices"]`` lists the names the ``multiple_choice`` reward accepts.

Train and held-out splits are disjoint by the same rule as :mod:`rltk.data.synthetic`: a picture belongs
to ``"test"`` exactly when a hash of its key (colour, shade, shape, size, place, background) falls below
``test_fraction``; seeds only choose which pictures of a split are drawn. A picture's pixels are a function
of its key alone (its noise is seeded by the key), so a row is the same in every process.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from rltk.data.images import check_placeholders, decode_image
from rltk.data.synthetic import _check_common, is_held_out

#: Each colour name's pure RGB; a shape's colour is this scaled by a shade (see :data:`SHADES`).
PALETTE = {
    "red": (255, 40, 40), "green": (40, 220, 40), "blue": (50, 80, 255),
    "yellow": (240, 230, 40), "white": (245, 245, 245), "purple": (170, 50, 220),
}
#: Brightness factors of a colour: a dim red must still read as red, so the model cannot go by brightness.
SHADES = (0.55, 0.7, 0.85, 1.0)
SHAPES = ("square", "disc", "triangle")
SHAPE_COLOUR_QUESTION = "Colour?"
# The background's grey level is drawn from 0..BACKGROUND_MAX with per-pixel noise of up to +-noise on top.
_BACKGROUND_MAX = 60


def shape_colour(
    split: str,
    size: int,
    seed: int,
    *,
    colours: str | list[str] = ("red", "green", "blue"),
    image_size: int = 56,
    min_side: int = 12,
    max_side: int = 28,
    noise: int = 24,
    question: str = SHAPE_COLOUR_QUESTION,
    test_fraction: float = 0.2,
) -> list[dict]:
    """``size`` pictures of one coloured shape each, with the question ``question`` -> the colour's name.

    Args:
        split: ``"train"`` or ``"test"`` (held out; ``"heldout"``, ``"eval"`` ... mean ``"test"``).
        size: number of rows.
        seed: which pictures are drawn and in which order.
        colours: the answers, names from :data:`PALETTE` (a list or a space-separated string); at least two.
        image_size: the pictures' side in pixels (the tiny VLM's ``model.tiny.vision.image_size`` keeps them
            unscaled).
        min_side, max_side: the shape's side (a disc's diameter) in pixels, at most ``image_size``.
        noise: the background's per-pixel noise amplitude, 0..100.
        question: the text part of the prompt, the same for every row.
        test_fraction: share of all pictures held out for ``"test"``.
    """
    split = _check_common("shape_colour", split, size, test_fraction)
    names = _check_shape_colour_args(colours, image_size, min_side, max_side, noise, question)
    rng = random.Random(f"shape_colour|{split}|{seed}")
    want_test = split == "test"
    rows, seen = [], set()
    for _ in range(200 * size + 10_000):
        colour = names[len(rows) % len(names)]  # dealt in turn: each answer equally often
        side = rng.randint(min_side, max_side)
        key = (colour, rng.randrange(len(SHADES)), rng.choice(SHAPES), side, rng.randint(0, image_size - side),
               rng.randint(0, image_size - side), rng.randint(0, _BACKGROUND_MAX), image_size, noise)
        text_key = "/".join(map(str, key))
        if text_key in seen or is_held_out(text_key, test_fraction) != want_test:
            continue
        seen.add(text_key)
        rows.append(_shape_colour_row(key, text_key, names, question, len(rows)))
        if len(rows) == size:
            rng.shuffle(rows)
            return rows
    raise ValueError(f"shape_colour: could not draw {size} distinct '{split}' pictures of side {min_side}..{max_side} "
                     f"in {image_size} pixels; lower size or widen the sides")


def _check_shape_colour_args(colours, image_size, min_side, max_side, noise, question) -> list[str]:
    names = list(dict.fromkeys(colours.split() if isinstance(colours, str) else colours))
    unknown = [name for name in names if name not in PALETTE]
    if unknown or len(names) < 2:
        raise ValueError(f"shape_colour: colours={colours!r} must name at least two of {', '.join(PALETTE)}"
                         + (f" ({', '.join(map(str, unknown))} is not one)" if unknown else ""))
    ints = dict(image_size=image_size, min_side=min_side, max_side=max_side, noise=noise)
    if any(not isinstance(v, int) or isinstance(v, bool) for v in ints.values()) \
            or not (8 <= image_size <= 1024 and 4 <= min_side <= max_side <= image_size and 0 <= noise <= 100):
        raise ValueError(f"shape_colour: need 8 <= image_size <= 1024, 4 <= min_side <= max_side <= image_size and "
                         f"0 <= noise <= 100 (integers), got {ints}")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"shape_colour: question must be a non-empty text, got {question!r}")
    return names


def _shape_colour_row(key: tuple, text_key: str, names: list[str], question: str, index: int) -> dict:
    colour, shade, shape, side, left, top, background, image_size, noise = key
    pixels = draw_shape(shape, colour=tuple(round(c * SHADES[shade]) for c in PALETTE[colour]), side=side,
                        left=left, top=top, background=background, image_size=image_size, noise=noise,
                        noise_seed=text_key)
    where = f"task 'shape_colour': row {index} (id 'shape_colour/{text_key}')"
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    images = [decode_image(pixels, where=where, key="images", base_dir=Path("."))]
    check_placeholders(prompt, images, where=where, key="images")
    return {
        "prompt": prompt,
        "ground_truth": colour,
        "extras": {"task": "shape_colour", "choices": list(names), "shape": shape, "side": side,
                   "left": left, "top": top, "shade": SHADES[shade]},
        "id": f"shape_colour/{text_key}",
        "images": images,
    }


def draw_shape(shape: str, *, colour: tuple[int, int, int], side: int, left: int, top: int, background: int,
               image_size: int, noise: int, noise_seed: str):
    """An ``image_size`` square ``uint8`` RGB array: grey ``background`` plus uniform noise of ``+-noise``
    (seeded by ``noise_seed``), with ``shape`` of ``side`` pixels at column ``left``, row ``top`` in ``colour``.

    The triangle points up: its apex at the top edge's middle, its base the bottom edge.
    """
    import numpy as np

    digest = hashlib.blake2b(noise_seed.encode("utf-8"), digest_size=8, person=b"rltk-noise").digest()
    rng = np.random.default_rng(int.from_bytes(digest, "big"))
    grey = background + rng.integers(-noise, noise + 1, size=(image_size, image_size, 1))
    image = np.repeat(np.clip(grey, 0, 255), 3, axis=2).astype(np.uint8)
    rows, cols = np.mgrid[0:side, 0:side] + 0.5
    if shape == "square":
        mask = np.ones((side, side), dtype=bool)
    elif shape == "disc":
        mask = (rows - side / 2) ** 2 + (cols - side / 2) ** 2 <= (side / 2) ** 2
    elif shape == "triangle":
        mask = np.abs(cols - side / 2) <= rows / 2
    else:
        raise ValueError(f"draw_shape: shape={shape!r} is not one of {', '.join(SHAPES)}")
    image[top:top + side, left:left + side][mask] = colour
    return image
