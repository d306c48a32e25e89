"""A VLM batch's images through the trainer's log-prob passes (rltk.models.vision.inputs, rltk.batch.collate).

Each sample carries its prompt's pixel values and grids in the batch; every pass (here the strategy's, as the
old, reference and update passes run it) must give the log-probs of a direct ``model(**processor outputs)``
forward of that sample alone, however the rows are cut into micro-batches, and the frozen tower's feature
cache (rltk.models.vision.features) must change nothing but how often the tower runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from rltk.batch import Experience, collate, slice_batch
from rltk.models.tiny import build_char_tokenizer, build_tiny_processor, build_tiny_vlm
from rltk.models.vision.features import ImageFeatureCache
from rltk.models.vision.inputs import encode_prompt, vision_inputs_of
from rltk.models.vision.tower import freeze_vision_tower, vision_token_ids
from rltk.training.step.forward import ForwardSettings, batched_logprobs
from rltk.training.step.micro_batches import micro_batches

#: fp32 on CPU: the padded, batched forward against one unpadded row's; measured 4.8e-7 here.
ATOL = 1e-5
#: fp32 gradients of one micro-batch against two (the same per-row terms summed in another order); measured
#: 7.2e-7 here. The feature cache's gradients measured equal bitwise, held to the same tolerance.
GRAD_ATOL = 5e-6

#: (colours of the prompt's images, its text): 1, 2 and no images; each prompt is sampled twice.
SPECS = [(["red"], "colour?"), (["blue", "yellow"], "which two?"), ([], "1+2=")]


@pytest.fixture(scope="module")
def parts():
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer(vision=True)
    processor = build_tiny_processor(tokenizer)
    model = build_tiny_vlm(tokenizer, seed=2).float()
    freeze_vision_tower(model)
    return tokenizer, processor, model


def _rendered(tokenizer, colours, text):
    messages = [{"role": "user", "content": [{"type": "image"}] * len(colours) + [{"type": "text", "text": text}]}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), \
        [Image.new("RGB", (56, 42 + 14 * i), c) for i, c in enumerate(colours)]


def _experiences(tokenizer, processor, model):
    """Two samples of each prompt, responses of ordinary tokens of different lengths."""
    banned = set(vision_token_ids(model)) | {tokenizer.pad_token_id}
    allowed = [i for i in range(len(tokenizer)) if i not in banned]
    generator = torch.Generator().manual_seed(7)
    experiences = []
    for group, (colours, text) in enumerate(SPECS):
        ids, vision = encode_prompt(processor, *_rendered(tokenizer, colours, text))
        for sample in range(2):
            length = 3 + 2 * sample + group
            response = [allowed[int(i)] for i in torch.randint(len(allowed), (length,), generator=generator)]
            experiences.append(Experience(prompt_ids=ids, response_ids=response, score=0.0, group_id=group,
                                          vision=vision))
    return experiences


def _direct_logprobs(model, processor, tokenizer, experience, colours, text) -> torch.Tensor:
    """The sample's response log-probs from ``model(**processor(text, images))`` with the response appended."""
    rendered, images = _rendered(tokenizer, colours, text)
    out = processor(text=[rendered], images=images or None, return_tensors="pt", add_special_tokens=False)
    response = torch.tensor([experience.response_ids])
    inputs = dict(out)
    inputs["input_ids"] = torch.cat([out["input_ids"], response], 1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    inputs["mm_token_type_ids"] = torch.cat([out["mm_token_type_ids"], torch.zeros_like(response)], 1)
    with torch.no_grad():
        logits = model(**inputs).logits[0, out["input_ids"].shape[1] - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, response[0, :, None])[:, 0]


def _strategy(model):
    from rltk.strategies.accelerate_strategy import AccelerateStrategy

    strategy = AccelerateStrategy(cpu=True)
    strategy.setup(model, lr=1e-3, total_steps=1, warmup_steps=0, lr_schedule="constant", grad_clip=None)
    return strategy


def test_the_batch_keeps_each_samples_images_and_counts_their_tokens(parts):
    tokenizer, processor, model = parts
    batch = collate(_experiences(tokenizer, processor, model), tokenizer.pad_token_id)
    assert batch["pixel_values"].shape[0] == batch["image_grid_thw"].shape[0] == 6
    # the samples of the prompt with two images hold both; the text prompt's rows hold none
    assert (batch["image_grid_thw"][2:4].prod(-1) > 0).sum(-1).tolist() == [2, 2]
    assert batch["image_grid_thw"][4:].abs().sum() == 0 and batch["pixel_values"][4:].abs().sum() == 0
    # the prompt ids hold one placeholder per merged patch (2 x 2 patches of 14 pixels)
    image_id = model.config.image_token_id
    tokens = (batch["input_ids"] == image_id).sum(-1)
    assert tokens.tolist() == (batch["image_grid_thw"].prod(-1).sum(-1) // 4).tolist()
    # a slice of rows (a micro-batch) holds exactly its samples' inputs, in row order
    experiences = _experiences(tokenizer, processor, model)
    sliced = vision_inputs_of(slice_batch(batch, torch.tensor([3, 0])))
    torch.testing.assert_close(sliced["image_grid_thw"], torch.cat([experiences[3].vision.image_grid_thw,
                                                                   experiences[0].vision.image_grid_thw]))
    torch.testing.assert_close(sliced["pixel_values"], torch.cat([experiences[3].vision.pixel_values,
                                                                 experiences[0].vision.pixel_values]))
    assert vision_inputs_of(slice_batch(batch, torch.tensor([4, 5]))) is None


@pytest.mark.parametrize("settings", [ForwardSettings(micro_batch_size=2),
                                      ForwardSettings(micro_batch_size=6, max_tokens_per_micro_batch=60)],
                         ids=["rows", "token-budget"])
def test_the_strategys_pass_equals_a_direct_forward_of_each_sample(parts, settings):
    tokenizer, processor, model = parts
    experiences = _experiences(tokenizer, processor, model)
    batch = collate(experiences, tokenizer.pad_token_id)
    strategy = _strategy(model)
    logprobs, _ = batched_logprobs(strategy.unwrap(), batch, settings, strategy=strategy)
    for row, experience in enumerate(experiences):
        colours, text = SPECS[row // 2]
        direct = _direct_logprobs(model, processor, tokenizer, experience, colours, text)
        torch.testing.assert_close(logprobs[row, :len(direct)], direct, atol=ATOL, rtol=0)
    # teeth: other pixels for the second prompt's images change what its samples score, and only theirs
    swapped = dict(batch, pixel_values=batch["pixel_values"].clone())
    swapped["pixel_values"][2:4] = swapped["pixel_values"][2:4].flip(-1)
    other, _ = batched_logprobs(strategy.unwrap(), swapped, settings, strategy=strategy)
    assert (other[2:4] - logprobs[2:4]).abs().max() > 1e-3
    torch.testing.assert_close(other[[0, 1, 4, 5]], logprobs[[0, 1, 4, 5]], atol=0, rtol=0)


def _summed_gradients(model, batch, micro_batch_size: int, *, cache: bool) -> dict[str, torch.Tensor]:
    """Gradients of the summed response log-probs, accumulated over micro-batches of ``micro_batch_size`` rows."""
    settings = ForwardSettings(micro_batch_size=micro_batch_size)
    model.zero_grad(set_to_none=True)
    features = ImageFeatureCache()
    with features.serving([model] if cache else []):
        for mb in micro_batches(None, batch, micro_batch_size=micro_batch_size):
            logprobs, _ = settings.logprobs(model, mb.data, batch["response_mask"].shape[1])
            (logprobs * mb.data["response_mask"]).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads, features


def test_one_and_two_micro_batches_give_equal_gradients_and_the_tower_gets_none(parts):
    tokenizer, processor, model = parts
    batch = collate(_experiences(tokenizer, processor, model), tokenizer.pad_token_id)
    whole, _ = _summed_gradients(model, batch, 6, cache=False)
    halves, _ = _summed_gradients(model, batch, 3, cache=False)
    assert whole and not any(name.startswith(("visual", "model.visual")) for name in whole)
    assert whole.keys() == halves.keys()
    for name in whole:
        torch.testing.assert_close(halves[name], whole[name], atol=GRAD_ATOL, rtol=1e-5, msg=name)


def test_the_feature_cache_runs_the_tower_once_per_image_and_changes_nothing(parts):
    tokenizer, processor, model = parts
    batch = collate(_experiences(tokenizer, processor, model), tokenizer.pad_token_id)
    settings = ForwardSettings(micro_batch_size=2)
    plain, _ = batched_logprobs(model, batch, settings)
    calls = []
    tower = model.model.visual
    handle = tower.register_forward_hook(lambda module, args, kwargs, output: calls.append(kwargs["grid_thw"].shape[0]),
                                         with_kwargs=True)
    try:
        features = ImageFeatureCache()
        with features.serving([model]):
            first, _ = batched_logprobs(model, batch, settings)   # the old-log-prob pass
            second, _ = batched_logprobs(model, batch, settings)  # the reference / update passes
        assert "get_image_features" not in vars(model.model)  # the model's own method is back
    finally:
        handle.remove()
    # three distinct images, six in the rows of a pass: the tower ran on each once, in the first pass only
    assert sum(calls) == 3 and features.computed == 3 and features.reused == 3 + 6
    torch.testing.assert_close(first, plain, atol=ATOL, rtol=0)
    torch.testing.assert_close(second, first, atol=0, rtol=0)
    cached, _ = _summed_gradients(model, batch, 2, cache=True)
    uncached, _ = _summed_gradients(model, batch, 2, cache=False)
    for name in uncached:
        torch.testing.assert_close(cached[name], uncached[name], atol=GRAD_ATOL, rtol=1e-5, msg=name)


def test_a_tower_that_trains_is_never_cached(parts):
    tokenizer, processor, model = parts
    trainable = build_tiny_vlm(tokenizer, seed=2)
    features = ImageFeatureCache()
    with features.serving([trainable]):
        assert "get_image_features" not in vars(trainable.model)
    with features.serving([model]):
        assert "get_image_features" in vars(model.model)


@pytest.mark.parametrize("impl", ["torch", "naive"])
def test_the_fused_head_op_and_the_full_logits_agree_with_images(parts, impl):
    from rltk.models.logprobs import response_logprobs, response_logprobs_naive

    tokenizer, processor, model = parts
    batch = collate(_experiences(tokenizer, processor, model), tokenizer.pad_token_id)
    width = batch["response_mask"].shape[1]
    vision = vision_inputs_of(batch)
    with torch.no_grad():
        fused, _ = response_logprobs(model, batch["input_ids"], batch["attention_mask"], width, impl=impl,
                                     vision_inputs=vision)
        full, _ = response_logprobs_naive(model, batch["input_ids"], batch["attention_mask"], width,
                                          vision_inputs=vision)
        text_only, _ = response_logprobs_naive(model, batch["input_ids"], batch["attention_mask"], width)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(fused[mask], full[mask], atol=ATOL, rtol=0)
    assert (text_only[:4][mask[:4]] - full[:4][mask[:4]]).abs().max() > 1e-3  # the images matter


def test_the_prompt_length_with_images_is_read_off_their_sizes(parts):
    from rltk.models.vision.inputs import expanded_length

    tokenizer, processor, _ = parts
    for colours, text in SPECS:
        rendered, images = _rendered(tokenizer, colours, text)
        assert expanded_length(processor, rendered, images) == len(encode_prompt(processor, rendered, images)[0])
    wide = [Image.new("RGB", (140, 30), "red"), Image.new("RGB", (20, 90), "blue")]
    text = "<image> and <image>: which?"  # a text prompt's placeholders
    assert expanded_length(processor, text, wide) == len(encode_prompt(processor, text, wide)[0])
    arrays = [np.asarray(image) for image in wide]  # a synthetic task's rows may hold arrays
    assert expanded_length(processor, text, arrays) == len(encode_prompt(processor, text, arrays)[0])


def test_max_prompt_tokens_counts_the_image_tokens(tmp_path):
    import json

    from rltk.config.loader import load_config
    from rltk.errors import ConfigError
    from rltk.training.scaffold.rows import build_rows

    Image.new("RGB", (56, 56), "red").save(tmp_path / "big.png")
    rows = [{"prompt": f"<image> colour {i}?", "answer": "red", "images": ["big.png"]} for i in range(12)]
    rows += [{"prompt": f"colour {i}?", "answer": "red"} for i in range(12)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["model.tiny.vision.depth=2", f"data.path={tmp_path / 'rows.jsonl'}", "data.task=null"]
    tokenizer = build_char_tokenizer(vision=True)
    # "<image> colour 1?" is 17 characters, but 16 ids once the processor replaces <image> with the vision
    # markers around the image's 4 tokens ("colour 10?": 17); a text row "colour 1?" is 9
    train, held_out = build_rows(load_config([], [*base, "data.max_prompt_tokens=16"]), tokenizer)
    kept = train + held_out
    assert len(kept) == 12 + 10 and sum(bool(row.get("images")) for row in kept) == 10
    train, held_out = build_rows(load_config([], [*base, "data.max_prompt_tokens=15"]), tokenizer)
    assert not any(row.get("images") for row in train + held_out) and len(train + held_out) == 12
    with pytest.raises(ConfigError, match=r"is 16 tokens \(with its 1 image.*data.max_prompt_tokens=15"):
        build_rows(load_config([], [*base, "data.max_prompt_tokens=15", "data.on_too_long=error"]), tokenizer)


def test_the_hf_engine_samples_the_same_with_the_cache_and_runs_the_tower_once_per_image(parts):
    from rltk.rollout.base import SamplingParams
    from rltk.rollout.hf import HFRolloutEngine

    tokenizer, processor, model = parts
    prompts, visions = zip(*(encode_prompt(processor, *_rendered(tokenizer, colours, text)) for colours, text in SPECS))
    engine = HFRolloutEngine(model, tokenizer)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=5, stop_token_ids=[], seed=11)
    plain = engine.generate(list(prompts), params, vision_inputs=list(visions))
    features = ImageFeatureCache()
    with features.serving([model]):
        cached = engine.generate(list(prompts), params, vision_inputs=list(visions))
    # three samples of each prompt in one prefill: each of the 3 images ran the tower once, not 3 times
    assert features.computed == 3 and features.reused == 2 * 3
    for joint, single in zip(cached, plain):
        assert [c.token_ids for c in joint] == [c.token_ids for c in single]
        torch.testing.assert_close(torch.tensor([c.logprobs for c in joint]),
                                   torch.tensor([c.logprobs for c in single]), atol=ATOL, rtol=0)
