"""``data.image_key``: a row's images as paths (relative to the data file), bytes or arrays, counted against the
prompt's placeholders; every bad image stops the load naming the row, the key and the file (rltk.data.images)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from rltk.data.images import ImageDataError
from rltk.data.loading import load_rows


def _png(colour, size=(4, 3)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _chat(n_images: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": "colour?"}]}]


def _write(tmp_path, rows) -> str:
    path = tmp_path / "data" / "rows.jsonl"
    path.parent.mkdir(exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_paths_relative_to_the_data_file_arrays_and_several_per_prompt(tmp_path):
    (tmp_path / "data" / "img").mkdir(parents=True)
    (tmp_path / "data" / "img" / "red.png").write_bytes(_png((255, 0, 0)))
    grey = [[0, 128], [255, 64]]
    rows = load_rows(_write(tmp_path, [
        {"prompt": _chat(2), "answer": "red", "images": ["img/red.png", grey], "note": "x"},
        {"prompt": "<image> what colour?", "answer": "blue", "images": np.full((2, 2, 3), 1.0).tolist(), "note": "y"},
    ]), image_key="images")
    first, second = rows
    assert [im.size for im in first["images"]] == [(4, 3), (2, 2)]
    assert first["images"][0].getpixel((0, 0)) == (255, 0, 0)
    assert first["images"][1].getpixel((1, 0)) == (128, 128, 128)  # grey rows -> RGB
    assert second["images"][0].getpixel((0, 0)) == (255, 255, 255)  # floats in [0, 1] scale to 255
    assert first["extras"] == {"note": "x"}  # the image column is not an extra


def test_bytes_and_the_hf_image_mapping_from_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    table = pa.table({"prompt": ["<image>a", "<image>b"], "answer": ["green", "blue"],
                      "pic": [{"bytes": _png((0, 255, 0)), "path": None}, {"bytes": _png((0, 0, 255)), "path": None}]})
    path = tmp_path / "rows.parquet"
    pq.write_table(table, path)
    rows = load_rows(str(path), image_key="pic")
    assert [r["images"][0].getpixel((0, 0)) for r in rows] == [(0, 255, 0), (0, 0, 255)]


def test_a_dataset_without_the_column_loads_as_text(tmp_path):
    rows = load_rows(_write(tmp_path, [{"prompt": "1+1=", "answer": "2"}]), image_key="images")
    assert "images" not in rows[0]


@pytest.mark.parametrize("row, message", [
    ({"prompt": "<image>?", "answer": "a", "images": "img/missing.png"},
     "rows.jsonl: row 0, image 0 (column 'images', data.image_key): image file '"),
    ({"prompt": "<image>?", "answer": "a", "images": {"bytes": None, "path": "nope.png"}}, "nope.png' does not exist"),
    ({"prompt": "<image>?", "answer": "a", "images": [[[[1, 2, 3, 4, 5]]]]}, "an array of shape (1, 1, 5)"),
    ({"prompt": "<image>?", "answer": "a", "images": [[2.0, 0.5]]}, "float pixels must lie in [0, 1]"),
    ({"prompt": _chat(1), "answer": "a", "images": []},
     "row 0: 0 image(s) in column 'images' (data.image_key) but the prompt places 1 ({'type': 'image'} content parts"),
    ({"prompt": "two?", "answer": "a", "images": [[[0, 0]], [[0, 0]]]}, "places 0 ('<image>' in its text)"),
])
def test_bad_images_name_the_row_the_key_and_the_file(tmp_path, row, message):
    with pytest.raises(ImageDataError) as caught:
        load_rows(_write(tmp_path, [row]), image_key="images")
    assert message in str(caught.value)


def test_undecodable_bytes_are_named(tmp_path):
    from rltk.data.images import decode_image

    with pytest.raises(ImageDataError, match=r"row 3 \(column 'pic', data.image_key\): 5 bytes that do not decode"):
        decode_image(b"notpn", where="row 3", key="pic", base_dir=tmp_path)
    (tmp_path / "bad.png").write_bytes(b"not a png")
    with pytest.raises(ImageDataError, match="bad.png' does not decode as an image"):
        decode_image("bad.png", where="row 3", key="pic", base_dir=tmp_path)


def test_a_text_policy_on_image_rows_exits_2_before_anything_heavy(tmp_path, capsys):
    from rltk.commands.cli import main

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "red.png").write_bytes(_png((255, 0, 0)))
    data = _write(tmp_path, [{"prompt": "<image>?", "answer": "red", "images": "red.png"}] * 4)
    assert main(["run", "grpo", f"output_dir={tmp_path / 'run'}", f"data.path={data}", "data.task=null",
                 "stages=[]"]) == 2
    err = capsys.readouterr().err
    assert "data.image_key='images'" in err and "is a text model" in err and "Traceback" not in err
    missing = _write(tmp_path, [{"prompt": "<image>?", "answer": "red", "images": "gone.png"}])
    assert main(["run", "grpo", f"output_dir={tmp_path / 'run2'}", f"data.path={missing}", "stages=[]"]) == 2
    assert "gone.png' does not exist" in capsys.readouterr().err


def _decoded(part: dict):
    import base64

    from PIL import Image

    from rltk.data.images import THUMBNAIL_PREFIX

    assert part["thumbnail"].startswith(THUMBNAIL_PREFIX)
    data = base64.b64decode(part["thumbnail"][len(THUMBNAIL_PREFIX):])
    return data, Image.open(io.BytesIO(data))


def test_a_thumbnail_is_a_small_png_that_keeps_the_aspect_and_the_colours():
    from PIL import Image

    from rltk.data.images import thumbnail

    image = Image.new("RGB", (200, 100), (255, 0, 0))
    image.paste((0, 0, 255), (100, 0, 200, 100))  # left half red, right half blue
    part = thumbnail(image)
    assert (part["type"], part["width"], part["height"]) == ("image", 200, 100)  # the image's own size
    data, small = _decoded(part)
    assert small.format == "PNG" and small.size == (64, 32)  # longer side 64, aspect 2:1 kept
    assert small.convert("RGB").getpixel((8, 16)) == (255, 0, 0) and small.convert("RGB").getpixel((56, 16)) == (0, 0, 255)
    tiny = thumbnail(Image.new("RGB", (20, 10), (0, 255, 0)))
    assert _decoded(tiny)[1].size == (20, 10)  # never enlarged


def test_a_noisy_image_shrinks_until_its_png_fits_the_byte_cap():
    import numpy as np

    from rltk.data.images import THUMBNAIL_MAX_BYTES, thumbnail

    noise = np.random.default_rng(0).integers(0, 256, size=(300, 300, 3), dtype=np.uint8)
    unbounded, _ = _decoded(thumbnail(noise, max_bytes=10**9))
    assert len(unbounded) > THUMBNAIL_MAX_BYTES  # 64 x 64 x 3 bytes of noise do not compress
    data, small = _decoded(thumbnail(noise))
    assert len(data) <= THUMBNAIL_MAX_BYTES and max(small.size) < 64 and small.size[0] == small.size[1]
