"""What the vLLM engines make of a prompt's images before vLLM sees them (rltk.rollout.vllm_vision): no vLLM needed."""

import importlib.util
import sys

import pytest
from PIL import Image

from rltk.rollout import vllm_vision

PAD = 7


def test_each_run_of_placeholders_goes_to_vllm_as_one_and_is_counted_against_the_images():
    ids = [1, 6, PAD, PAD, PAD, PAD, 8, 2, 6, PAD, PAD, 8, 3]
    assert vllm_vision.collapse_placeholders(ids, PAD) == [1, 6, PAD, 8, 2, 6, PAD, 8, 3]
    images = [Image.new("RGB", (28, 28)), Image.new("RGB", (56, 56))]
    prompt = vllm_vision.vllm_prompt(ids, images, PAD)
    assert prompt["prompt_token_ids"] == [1, 6, PAD, 8, 2, 6, PAD, 8, 3] and prompt["multi_modal_data"]["image"] == images
    assert vllm_vision.vllm_prompt(ids, [], PAD) == {"prompt_token_ids": ids}  # no images: the ids as they are
    vllm_vision.check_image_placeholders(ids, images, PAD, 0)
    with pytest.raises(ValueError, match=r"prompt 3 has 1 image\(s\) and 2 image placeholder\(s\)"):
        vllm_vision.check_image_placeholders(ids, images[:1], PAD, 3)
    with pytest.raises(ValueError, match="no image token"):
        vllm_vision.check_image_placeholders(ids, images, None, 0)
    vllm_vision.check_expansion(ids, ids, 0)
    with pytest.raises(RuntimeError, match="prompt 2: vLLM expanded its image placeholders to 9 tokens, the trainer's "
                                           "processor to 13"):
        vllm_vision.check_expansion(vllm_vision.collapse_placeholders(ids, PAD), ids, 2)


def test_a_prompts_images_come_as_pil_images_or_an_object_holding_them():
    image = Image.new("RGB", (28, 28))

    class PromptImages:  # the workflows' per-prompt object: images beside the processor's outputs
        def __init__(self, images):
            self.images = images
            self.pixel_values = None

    assert vllm_vision.prompt_images(None, 0) == []
    assert vllm_vision.prompt_images(image, 0) == [image]
    assert vllm_vision.prompt_images([image, image], 0) == [image, image]
    assert vllm_vision.prompt_images(PromptImages([image]), 0) == [image]
    with pytest.raises(ValueError, match=r"vision_inputs\[1\] carries processor outputs without the decoded images"):
        vllm_vision.prompt_images(PromptImages([]), 1)
    with pytest.raises(TypeError, match=r"vision_inputs\[0\]: vLLM takes decoded images \(PIL.Image\), got str"):
        vllm_vision.prompt_images(["cat.png"], 0)
    with pytest.raises(TypeError, match=r"vision_inputs\[0\] must be None, a PIL.Image"):
        vllm_vision.prompt_images(3, 0)


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="only where torchvision is missing")
def test_without_torchvision_qwen_vl_loads_its_image_module_and_processor():
    from transformers import Qwen2_5_VLProcessor

    from rltk.models.tiny import build_char_tokenizer, build_tiny_processor

    assert vllm_vision.register() and vllm_vision.register()  # idempotent: vLLM loads plugins per process
    module = sys.modules[vllm_vision.TORCHVISION_MODULE]
    assert module.__name__ == vllm_vision.PIL_MODULE and callable(module.smart_resize)
    assert "video_processor" not in Qwen2_5_VLProcessor.get_attributes()
    with pytest.raises(RuntimeError, match="videos need torchvision"):
        Qwen2_5_VLProcessor.video_processor()
    tokenizer = build_char_tokenizer(vision=True)
    folder_processor = build_tiny_processor(tokenizer)
    assert Qwen2_5_VLProcessor(folder_processor.image_processor, tokenizer).image_processor is not None
