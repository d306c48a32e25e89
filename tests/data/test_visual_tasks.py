"""The shape_colour task: pictures drawn in code whose colour only the picture tells."""

from collections import Counter

import numpy as np
import pytest

import rltk
from rltk.data.loading import format_prompts
from rltk.data.synthetic import make_task, sft_examples
from rltk.data.visual_tasks import PALETTE, SHADES, draw_shape, shape_colour


def pixels(row):
    return np.asarray(row["images"][0])


def test_rows_are_chat_prompts_with_one_picture_and_a_colour_name():
    rows = shape_colour("train", 30, seed=0, image_size=56)
    for row in rows:
        assert row["prompt"] == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
        assert len(row["images"]) == 1 and row["images"][0].mode == "RGB" and row["images"][0].size == (56, 56)
        assert row["ground_truth"] in row["extras"]["choices"] == ["red", "green", "blue"]
        assert row["id"].startswith(f"shape_colour/{row['ground_truth']}/")
    assert len({row["id"] for row in rows}) == 30


def test_the_shape_is_painted_in_its_shaded_colour_on_a_grey_background():
    for row in shape_colour("train", 40, seed=1):
        e, image = row["extras"], pixels(row)
        want = [round(c * e["shade"]) for c in PALETTE[row["ground_truth"]]]
        # The middle of the bottom half of the box lies inside a square, a disc and an upward triangle alike.
        y, x = e["top"] + (3 * e["side"]) // 4, e["left"] + e["side"] // 2
        assert image[y, x].tolist() == want, row["id"]
        inside = np.zeros(image.shape[:2], dtype=bool)
        inside[e["top"]:e["top"] + e["side"], e["left"]:e["left"] + e["side"]] = True
        outside = image[~inside]
        assert (outside[:, 0] == outside[:, 1]).all() and (outside[:, 1] == outside[:, 2]).all()  # grey
        assert outside.max() <= 60 + 24


def test_each_colour_is_dealt_equally_often_and_every_prompt_is_the_same_text():
    """So a policy blind to the picture scores at most 1/3 (to within a row): the text-only chance level."""
    rows = shape_colour("test", 151, seed=3)
    counts = Counter(row["ground_truth"] for row in rows)
    assert sorted(counts.values()) == [50, 50, 51]
    assert len({str(row["prompt"]) for row in rows}) == 1


def test_the_picture_alone_answers_every_row():
    """An independent reader of the pixels (the colour of the pixels that are not grey) is always right."""
    names, palette = list(PALETTE), np.array(list(PALETTE.values()), dtype=float)
    for row in shape_colour("train", 200, seed=4, colours="red green blue yellow white purple", noise=40):
        image = pixels(row).reshape(-1, 3).astype(float)
        coloured = image[np.ptp(image, axis=1) > 0]  # a grey pixel has r == g == b
        if not len(coloured):  # white is grey too: the brightest pixels are the shape
            coloured = image[image.sum(axis=1) >= image.sum(axis=1).max() - 1]
        mean = coloured.mean(axis=0)
        scale = max(mean.max(), 1.0) / 255
        guess = names[int(np.argmin(((palette * scale - mean) ** 2).sum(axis=1)))]
        assert guess == row["ground_truth"], row["id"]


def test_splits_are_disjoint_and_a_seed_draws_the_same_pixels_every_time():
    train = shape_colour("train", 300, seed=1)
    test = shape_colour("heldout", 300, seed=2)
    assert not {r["id"] for r in train} & {r["id"] for r in test}
    again = shape_colour("train", 300, seed=1)
    assert [r["id"] for r in again] == [r["id"] for r in train]
    assert all((pixels(a) == pixels(b)).all() for a, b in zip(again, train))
    assert [r["id"] for r in shape_colour("train", 300, seed=5)] != [r["id"] for r in train]


def test_draw_shape_paints_exactly_the_shapes_pixels():
    def painted(shape, side):
        image = draw_shape(shape, colour=(255, 0, 0), side=side, left=2, top=3, background=10, image_size=28,
                           noise=0, noise_seed="x")
        return (image[:, :, 0] == 255).sum(), image
    count, image = painted("square", 8)
    assert count == 64 and image[3, 2].tolist() == [255, 0, 0] and image[2, 2].tolist() == [10, 10, 10]
    assert abs(painted("disc", 20)[0] - np.pi * 100) < 20  # a disc of radius 10: ~314 pixels
    assert abs(painted("triangle", 20)[0] - 200) < 20  # half its box
    with pytest.raises(ValueError, match="shape='hexagon' is not one of square, disc, triangle"):
        painted("hexagon", 4)


@pytest.mark.parametrize("args, message", [
    ({"colours": ["red"]}, "must name at least two of red, green, blue"),
    ({"colours": "red mauve"}, "mauve is not one"),
    ({"min_side": 30, "max_side": 20}, "4 <= min_side <= max_side <= image_size"),
    ({"image_size": 56, "max_side": 60}, "max_side <= image_size"),
    ({"noise": 101}, "0 <= noise <= 100"),
    ({"question": " "}, "question must be a non-empty text"),
])
def test_bad_arguments_name_what_is_valid(args, message):
    with pytest.raises(ValueError, match=message):
        shape_colour("train", 5, seed=0, **args)


def test_it_is_a_registered_task_whose_warm_up_teaches_the_name():
    assert rltk.get_component("task", "shape_colour") is shape_colour
    rows = make_task("shape_colour", "train", 6, 0, colours=["red", "blue"])
    assert [completion for _, completion in sft_examples(rows)] == [row["ground_truth"] for row in rows]
    with pytest.raises(ValueError, match="has no argument"):
        make_task("shape_colour", "train", 6, 0, colour="red")


def test_the_tiny_vlm_template_renders_the_picture_once_within_the_shipped_prompt_budget():
    from rltk.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer(vision=True)
    rows = format_prompts(shape_colour("train", 4, seed=0), tokenizer, use_chat_template=True, max_prompt_tokens=16)
    assert len(rows) == 4
    for row in rows:
        assert row["prompt"] == "<|user|><|vision_start|><|image_pad|><|vision_end|>Colour?<|eos|><|assistant|>"
        assert len(row["images"]) == 1
