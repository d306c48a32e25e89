"""The tiny VLM default (``model.tiny.vision.depth``): tokenizer ids, chat template, processor, the real
``from_pretrained`` round trip, a frozen vision tower, and the hf engine generating with it."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from rltk.models.loading import is_vision_language_folder, load_model, load_processor, load_tokenizer
from rltk.models.tiny import (
    ALPHABET,
    SPECIAL_TOKENS,
    VISION_TOKENS,
    build_char_tokenizer,
    build_tiny_model,
    build_tiny_processor,
    build_tiny_vlm,
    save_pretrained_dir,
)

TEXT_IDS = len(SPECIAL_TOKENS) + len(ALPHABET)  # 104: every text token keeps its id
ASK = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(vision=True)


@pytest.fixture(scope="module")
def processor(tokenizer):
    return build_tiny_processor(tokenizer)


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_vlm(tokenizer)


def _image(colour, size=(56, 56)):
    return Image.new("RGB", size, colour)


def test_vision_tokens_come_after_every_text_token(tokenizer):
    text = build_char_tokenizer()
    assert tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)) == [104, 105, 106, 107]
    assert tokenizer("1+2= ab\n")["input_ids"] == text("1+2= ab\n")["input_ids"]
    with_tools = build_char_tokenizer(tool_role=True, vision=True)
    assert with_tools.convert_tokens_to_ids(["<|tool|>", *VISION_TOKENS]) == list(range(TEXT_IDS, TEXT_IDS + 5))


def test_chat_template_renders_image_parts_as_the_vision_markers(tokenizer):
    text = tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    assert text == "<|user|><|vision_start|><|image_pad|><|vision_end|>colour?<|eos|><|assistant|>"
    plain = [{"role": "user", "content": "1+2="}]
    assert tokenizer.apply_chat_template(plain, tokenize=False) == build_char_tokenizer().apply_chat_template(
        plain, tokenize=False)
    with pytest.raises(Exception, match="a content part is text or image, got audio"):
        tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "audio"}]}], tokenize=False)


def test_processor_expands_each_image_to_its_merged_patches(processor):
    text = processor.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    # 56 px and 100 px squares alike: 56x56 pixels, 4x4 patches of 14, merged 2x2 into 4 tokens
    out = processor(text=[text, text], images=[[_image("red")], [_image("blue", (100, 100))]], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
    assert tuple(out["pixel_values"].shape) == (32, 3 * 2 * 14 * 14)  # 16 patches per image, 2 frames of 14x14 RGB
    assert (out["input_ids"] == 106).sum(dim=1).tolist() == [4, 4]


def test_model_shapes_and_deterministic_init(tokenizer, model):
    config = model.config
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert (config.text_config.hidden_size, config.text_config.num_hidden_layers, config.vision_config.depth) == (64, 2, 2)
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size  # merger lands in the LM's width
    assert config.image_token_id == 106 and config.text_config.vocab_size == len(tokenizer) == 108
    state = torch.random.get_rng_state()
    again = build_tiny_vlm(tokenizer)
    assert torch.equal(state, torch.random.get_rng_state())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    with pytest.raises(ValueError, match="lacks"):
        build_tiny_vlm(build_char_tokenizer())


def test_the_image_changes_the_logits(processor, model):
    text = processor.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    red, blue = (processor(text=[text], images=[_image(c)], return_tensors="pt") for c in ("red", "blue"))
    with torch.no_grad():
        assert not torch.allclose(model(**red).logits[0, -1], model(**blue).logits[0, -1])


def test_saved_folder_loads_through_from_pretrained_unchanged(tmp_path, tokenizer, processor, model):
    folder = save_pretrained_dir(model, tokenizer, tmp_path / "vlm", processor=processor)
    text_folder = save_pretrained_dir(build_tiny_model(build_char_tokenizer()), build_char_tokenizer(), tmp_path / "lm")
    assert is_vision_language_folder(folder) and not is_vision_language_folder(text_folder)
    loaded, loaded_tokenizer = load_model(folder), load_tokenizer(folder)
    loaded_processor = load_processor(folder, loaded_tokenizer)
    assert type(loaded).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(loaded_processor).__name__ == "Qwen2_5_VLProcessor"
    text = loaded_processor.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    ours = processor(text=[text], images=[_image("green")], return_tensors="pt")
    theirs = loaded_processor(text=[text], images=[_image("green")], return_tensors="pt")
    assert torch.equal(ours["input_ids"], theirs["input_ids"]) and torch.equal(ours["pixel_values"], theirs["pixel_values"])
    with torch.no_grad():
        assert torch.equal(model(**ours).logits, loaded(**theirs).logits)
    with pytest.raises(FileNotFoundError, match="without an image processor"):
        load_processor(text_folder, loaded_tokenizer)


@pytest.mark.parametrize("freeze", [True, False])
def test_freeze_vision_tower(freeze):
    from rltk.config.loader import load_config
    from rltk.training.scaffold.setup import build_processor, build_tokenizer_and_policy

    cfg = load_config([], ["model.tiny.vision.depth=2", f"model.freeze_vision_tower={str(freeze).lower()}"])
    tokenizer, policy = build_tokenizer_and_policy(cfg)
    tower = {n for n, _ in policy.named_parameters() if n.startswith("model.visual.")}
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert tower and (tower.isdisjoint(trainable) if freeze else tower <= trainable)
    assert "lm_head.weight" in trainable or "model.language_model.embed_tokens.weight" in trainable
    assert type(build_processor(cfg, tokenizer)).__name__ == "Qwen2_5_VLProcessor"


def test_hf_engine_generates_batches_of_different_sizes(tokenizer, model):
    """Qwen2.5-VL keeps the last forward's rotary offsets; the next batch of another size must not read them."""
    from rltk.rollout.base import SamplingParams
    from rltk.rollout.hf import HFRolloutEngine

    engine = HFRolloutEngine(model, tokenizer)
    prompts = [tokenizer("1+2=")["input_ids"], tokenizer("3+4=")["input_ids"]]
    params = SamplingParams(n=4, max_new_tokens=3, temperature=1.0, seed=0)
    first = engine.generate(prompts, params)
    again = engine.generate(prompts[:1], SamplingParams(n=2, max_new_tokens=3, temperature=1.0, seed=0))
    assert [len(c) for c in first] == [4, 4] and len(again[0]) == 2
    assert all(len(c.token_ids) <= 3 for group in first + again for c in group)


def test_lora_adapts_the_language_model_only():
    from rltk.config.loader import load_config
    from rltk.training.scaffold.setup import build_tokenizer_and_policy

    cfg = load_config([], ["model.tiny.vision.depth=2", "model.lora.r=4"])
    _, policy = build_tokenizer_and_policy(cfg)
    adapters = [n for n, p in policy.named_parameters() if "lora_" in n]
    assert adapters and all(p.requires_grad for n, p in policy.named_parameters() if "lora_" in n)
    assert not [n for n in adapters if ".visual." in n]
    assert any(".language_model." in n for n in adapters)


def test_the_runs_tokenizer_folder_makes_an_exported_vlm_folder_complete(tmp_path):
    """What a run saves at <output_dir>/tokenizer and `rltk export` copies beside the weights: with the processor,
    the folder loads through AutoModelForImageTextToText and AutoTokenizer reads the ids the run trained with."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from rltk.config.loader import load_config
    from rltk.models.loading import make_auto_tokenizer_exact
    from rltk.training.scaffold.setup import build_tokenizer_and_policy, save_tokenizer_folder

    cfg = load_config([], ["model.tiny.vision.depth=2"])
    tokenizer, policy = build_tokenizer_and_policy(cfg)
    folder = tmp_path / "export"
    save_tokenizer_folder(cfg, tokenizer, folder)
    assert (folder / "processor_config.json").is_file()
    policy.save_pretrained(folder)  # the checkpoint's weights and config, as the export copies them
    make_auto_tokenizer_exact(folder)
    assert type(AutoModelForImageTextToText.from_pretrained(folder)).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert AutoTokenizer.from_pretrained(folder)("a b<|image_pad|>")["input_ids"] == [25, 17, 26, 106]
    processor = load_processor(folder, load_tokenizer(folder))
    out = processor(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[_image("red")], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]
