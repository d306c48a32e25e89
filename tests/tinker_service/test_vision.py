"""``rltk serve-tinker`` serving a vision-language model: the SDK's ImageChunk in sampling and forward_backward.

A real server over a tiny Qwen2.5-VL folder written here, the real SDK client. The model input
``[text, ImageChunk, text]`` must score as rltk's own forward of the same weights scores the processor's
expansion of it (the image's four tokens at the chunk's place, its pixel values), and sample as the hf engine does.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch
from PIL import Image

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
from tinker import types  # noqa: E402

from tests.tinker_service.test_app import _benchmark  # noqa: E402
from tests.waits import scaled  # noqa: E402

pytestmark = pytest.mark.slow

KEY = "tml-key-vision"
#: The text chunks around the image, as the tiny VLM's chat template writes a user turn with one image.
BEFORE, AFTER = "<|user|><|vision_start|>", "<|vision_end|>Its colour?<|eos|><|assistant|>"


def _png(colour) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (56, 56), colour).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from rltk.models.tiny import build_char_tokenizer, build_tiny_processor, build_tiny_vlm, save_pretrained_dir

    os.environ["TINKER_TELEMETRY"] = "0"
    root = tmp_path_factory.mktemp("tinker-vlm")
    tokenizer = build_char_tokenizer(vision=True)
    processor = build_tiny_processor(tokenizer)
    model = build_tiny_vlm(tokenizer, seed=4).float()
    folder = save_pretrained_dir(model, tokenizer, root / "tiny-vlm", processor=processor)
    proc, url = _benchmark().start_server(str(folder), "--api-key", KEY, "--state-dir", str(root / "state"),
                                          "--threads", "1")
    try:
        yield {"url": url, "model": model.eval(), "tokenizer": tokenizer, "processor": processor}
    finally:
        proc.terminate()
        proc.wait(scaled(30))


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def _direct_logits(server, tokens_before, colour, tokens_after):
    """rltk's reading of the model input: the processor's expansion of the image, the model's own forward."""
    from rltk.models.vision.inputs import token_type_ids
    from rltk.models.vision.tower import forget_rope_deltas

    model, tokenizer, processor = server["model"], server["tokenizer"], server["processor"]
    out = processor.image_processor(images=[Image.open(io.BytesIO(_png(colour))).convert("RGB")], return_tensors="pt")
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ids = torch.tensor([tokens_before + [pad] * 4 + tokens_after])
    forget_rope_deltas(model)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=token_type_ids(ids, model),
                       pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"]).logits[0].float()
    return ids[0], logits


def test_forward_and_sample_read_the_image_chunk_as_rltk_reads_the_image(server):
    tokenizer = server["tokenizer"]
    before, after = _ids(tokenizer, BEFORE), _ids(tokenizer, AFTER) + _ids(tokenizer, "red")
    service = tinker.ServiceClient(base_url=server["url"], api_key=KEY)
    client = service.create_lora_training_client(base_model="tiny-vlm", rank=4).result()

    def datum(colour):
        model_input = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=before),
                                               types.ImageChunk(data=_png(colour), format="png", expected_tokens=4),
                                               types.EncodedTextChunk(tokens=after)])
        assert model_input.length == len(before) + 4 + len(after)
        ids, _ = _direct_logits(server, before, colour, after)
        targets = np.array(ids[1:].tolist() + [0])  # position i scores token i + 1
        return types.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": targets}), ids

    red, ids = datum((220, 30, 30))
    got = client.forward([red], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    _, logits = _direct_logits(server, before, (220, 30, 30), after)
    from rltk.models.vision.tower import vision_token_ids

    full = logits.log_softmax(-1)[:-1].gather(-1, ids[1:, None])[:, 0]
    # the softmax the sampler draws from, without the image tokens (rltk.kernels.excluded_tokens); the image
    # placeholders themselves, as targets, keep the full softmax's log-prob
    banned = vision_token_ids(server["model"])
    kept = logits.index_fill(-1, torch.tensor(banned), float("-inf")).log_softmax(-1)[:-1]
    direct = torch.where(torch.isin(ids[1:], torch.tensor(banned)), full, kept.gather(-1, ids[1:, None])[:, 0])
    np.testing.assert_allclose(got[:-1], direct.numpy(), atol=1e-4)  # the adapter starts at B = 0: the base model
    # another picture moves the scores after the image, and only there
    blue, _ = datum((30, 60, 220))
    other = client.forward([blue], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    image_end = len(before) + 4
    np.testing.assert_array_equal(other[:len(before) - 1], got[:len(before) - 1])
    assert np.abs(other[image_end:-1] - got[image_end:-1]).max() > 1e-3
    # a training step on the image datum runs (LoRA on the language model only)
    client.forward_backward([red], "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    sampler = service.create_lora_training_client(base_model="tiny-vlm", rank=4).result() \
        .save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=before),
                                      types.ImageChunk(data=_png((220, 30, 30)), format="png"),
                                      types.EncodedTextChunk(tokens=_ids(tokenizer, AFTER))])
    result = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=3, seed=0)).result()
    from rltk.models.vision.tower import vision_token_ids

    prompt_ids, _ = _direct_logits(server, before, (220, 30, 30), _ids(tokenizer, AFTER))
    for sequence in result.sequences:
        assert 1 <= len(sequence.tokens) <= 3
        _, logits = _direct_logits(server, before, (220, 30, 30), _ids(tokenizer, AFTER) + sequence.tokens)
        logits[:, vision_token_ids(server["model"])] = float("-inf")  # the hf engine never samples an image token
        scored = logits.log_softmax(-1)[len(prompt_ids) - 1:-1].gather(-1, torch.tensor(sequence.tokens)[:, None])[:, 0]
        np.testing.assert_allclose(sequence.logprobs, scored.numpy(), atol=1e-4)
    service.close("success").result()


def test_bad_image_chunks_are_a_400_naming_the_chunk(server):
    tokenizer = server["tokenizer"]
    before = _ids(tokenizer, BEFORE)
    service = tinker.ServiceClient(base_url=server["url"], api_key=KEY)
    sampler = service.create_lora_training_client(base_model="tiny-vlm", rank=4).result() \
        .save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=2)
    cases = [(types.ImageChunk(data=_png((1, 2, 3)), format="png", expected_tokens=5),
              r"prompt\.chunks\[1\]: expected_tokens=5, but this 56x56 image is 4 tokens for the served model's processor"),
             (types.ImageChunk(data=b"not a png", format="png", expected_tokens=4),
              r"prompt\.chunks\[1\]: 9 bytes that do not decode as a PNG image"),
             (types.ImageAssetPointerChunk(format="png", location="http://127.0.0.1:9/x.png", expected_tokens=4),
              r"prompt\.chunks\[1\]: an image_asset_pointer chunk; rltk serve-tinker fetches no image addresses")]
    for chunk, message in cases:
        prompt = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=before), chunk,
                                          types.EncodedTextChunk(tokens=_ids(tokenizer, AFTER))])
        with pytest.raises(tinker.BadRequestError, match=message):
            sampler.sample(prompt, 1, params).result()


def test_a_vision_language_models_adapters_leave_the_vision_tower_alone():
    from rltk.models.tiny import build_char_tokenizer, build_tiny_vlm
    from rltk.tinker_service.adapters import Workspace

    tokenizer = build_char_tokenizer(vision=True)
    workspace = Workspace(build_tiny_vlm(tokenizer), tokenizer)
    workspace.create("a", 4)
    names = [n for n, _ in workspace.peft_model.named_parameters() if ".a." in n]
    assert names and not any(".visual." in n for n in names)  # the tower's gate/up/down projections too
    assert any("mlp.gate_proj" in n for n in names) and any("self_attn.q_proj" in n for n in names)
