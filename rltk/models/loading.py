"""Loading a causal LM and its tokenizer from a local Hugging Face folder.

rltk never downloads inside a training run: ``model.path`` must be a local
folder (download it beforehand with ``huggingface-cli download``).

The tokenizer rule (why not simply ``AutoTokenizer``): with transformers 5.x,
``AutoTokenizer`` on a folder whose tokenizer is declared generic
(``TokenizersBackend`` / ``PreTrainedTokenizerFast``) but whose
``config.json`` says e.g. ``qwen2`` rebuilds the tokenizer with Qwen's own
pre-tokenizer and silently changes token ids. So :func:`load_tokenizer` trusts
the class the folder's ``tokenizer_config.json`` declares: a generic class is
loaded verbatim from ``tokenizer.json`` with ``PreTrainedTokenizerFast``;
a model-specific class (``Qwen2Tokenizer``, ``LlamaTokenizerFast`` ...) goes
through ``AutoTokenizer`` so real model folders keep their own behaviour.
Either way, a tokenizer whose ids disagree with the folder's ``tokenizer.json``
on a probe text is reported with a warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Iterator

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from rltk.io import model_folder_problem

logger = logging.getLogger(__name__)

#: ``tokenizer_class`` values meaning "exactly what tokenizer.json says".
GENERIC_TOKENIZER_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})

DTYPES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "auto": "auto",
}

# Spaces, newlines, digits, letters and punctuation: a text on which any
# pre-tokenizer substitution changes ids.
_PROBE_TEXT = "Q: 17+25=?\n  A: 42.  Hello, World!\t#### 7 \\boxed{3/4} <answer>(1+2)*3</answer>"


def _require_folder(path: str | os.PathLike, config_key: str, needs: str) -> Path:
    problem = model_folder_problem(path, needs)
    if problem is not None:
        raise FileNotFoundError(f"{config_key}='{path}': {problem}.")
    return Path(path).expanduser()


def load_tokenizer(path: str | os.PathLike, *, config_key: str = "model.path") -> PreTrainedTokenizerBase:
    """The tokenizer saved in the local folder ``path``, with its token ids unchanged.

    See the module docstring for the rule that picks the class. ``config_key``
    names the config entry the path came from, for error messages.
    """
    folder = _require_folder(path, config_key, "tokenizer.json or tokenizer_config.json")
    tokenizer_json = folder / "tokenizer.json"
    tokenizer_config = folder / "tokenizer_config.json"
    if not tokenizer_json.exists() and not tokenizer_config.exists():
        present = sorted(p.name for p in folder.iterdir())[:20]
        raise FileNotFoundError(
            f"{config_key}='{path}' holds no tokenizer (no tokenizer.json or tokenizer_config.json). "
            f"Files present: {present}"
        )
    declared = None
    if tokenizer_config.exists():
        declared = json.loads(tokenizer_config.read_text(encoding="utf-8")).get("tokenizer_class")
    if tokenizer_json.exists() and (declared is None or declared in GENERIC_TOKENIZER_CLASSES):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if tokenizer_json.exists():
        _warn_if_ids_differ(tokenizer, tokenizer_json, declared)
    return tokenizer


def _warn_if_ids_differ(tokenizer: PreTrainedTokenizerBase, tokenizer_json: Path, declared: str | None) -> None:
    from tokenizers import Tokenizer

    try:
        raw = Tokenizer.from_file(str(tokenizer_json)).encode(_PROBE_TEXT, add_special_tokens=False).ids
    except Exception as exc:  # a tokenizer.json the installed `tokenizers` cannot read is not fatal here
        logger.debug("could not read %s for the id check: %s", tokenizer_json, exc)
        return
    loaded = tokenizer(_PROBE_TEXT, add_special_tokens=False)["input_ids"]
    if loaded != raw:
        logger.warning(
            "tokenizer %s (declared %r) encodes differently from %s: %s... vs %s... on a probe text. "
            "Check that this is what the model was trained with.",
            type(tokenizer).__name__, declared, tokenizer_json, loaded[:12], raw[:12],
        )


def load_model(
    path: str | os.PathLike, *, dtype: str = "float32", config_key: str = "model.path"
) -> torch.nn.Module:
    """The causal LM in the local folder ``path`` (``AutoModelForCausalLM``, no downloads).

    Args:
        path: a folder holding ``config.json`` and the weights.
        dtype: one of ``float32``, ``bfloat16``, ``float16`` (or ``fp32``,
            ``bf16``, ``fp16``), or ``auto`` for the dtype in the config.
        config_key: the config entry ``path`` came from, for error messages.
    """
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype='{dtype}' is not a dtype rltk loads. Valid: {', '.join(DTYPES)}")
    folder = _require_folder(path, config_key, "config.json and weights")
    if not (folder / "config.json").exists():
        present = sorted(p.name for p in folder.iterdir())[:20]
        raise FileNotFoundError(
            f"{config_key}='{path}' is not a Hugging Face model folder: it has no config.json. "
            f"Files present: {present}"
        )
    auto_class = AutoModelForCausalLM
    if is_vision_language_folder(folder):
        from transformers import AutoModelForImageTextToText as auto_class
    with quiet_model_io():
        return auto_class.from_pretrained(str(folder), dtype=DTYPES[dtype], local_files_only=True)


def is_vision_language_folder(path: str | os.PathLike) -> bool:
    """Whether the model folder ``path`` holds an image-text-to-text model (Qwen2.5-VL, Qwen3-VL ...).

    Its ``config.json`` has a ``vision_config`` and its model type is one that ``AutoModelForImageTextToText``
    builds; such a folder loads through that class and :func:`load_processor`.
    """
    config_file = Path(path).expanduser() / "config.json"
    if not config_file.is_file():
        return False
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if "vision_config" not in config:
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return config.get("model_type") in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def load_processor(path: str | os.PathLike, tokenizer: PreTrainedTokenizerBase, *, config_key: str = "model.path"):
    """The multimodal processor saved in the local VLM folder ``path`` (images only), around ``tokenizer``.

    Its class is the one ``processor_config.json`` declares (``AutoProcessor``'s choice: ``Qwen2_5_VLProcessor``
    ...), its image processor ``AutoImageProcessor``'s, its chat template the folder's. Two things differ from
    ``AutoProcessor.from_pretrained``, both on purpose: ``tokenizer`` is :func:`load_tokenizer`'s (the module
    docstring's rule; ``AutoProcessor`` would load it through ``AutoTokenizer``, which for a generic tokenizer
    under a Qwen model type rebuilds it with other ids), and there is no video processor: rltk feeds no videos,
    and transformers cannot build one without torchvision, which the locks leave out (:func:`image_only_processor`).
    """
    from transformers import AutoImageProcessor
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES, processor_class_from_name

    folder = _require_folder(path, config_key, "preprocessor_config.json or processor_config.json")
    files = [folder / name for name in ("processor_config.json", "preprocessor_config.json")]
    if not any(f.is_file() for f in files):
        present = sorted(p.name for p in folder.iterdir())[:20]
        raise FileNotFoundError(f"{config_key}='{path}' is a vision-language model folder without an image "
                                f"processor (no processor_config.json or preprocessor_config.json). "
                                f"Files present: {present}")
    declared = next((json.loads(f.read_text(encoding="utf-8")).get("processor_class") for f in files if f.is_file()
                     and json.loads(f.read_text(encoding="utf-8")).get("processor_class")), None)
    model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    name = declared or PROCESSOR_MAPPING_NAMES.get(model_type)
    processor_class = processor_class_from_name(name) if name else None
    if processor_class is None:
        raise FileNotFoundError(f"{config_key}='{path}': no processor class for it (processor_config.json names "
                                f"none and model_type {model_type!r} has none in transformers)")
    image_processor = AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
    template_file = folder / "chat_template.jinja"
    template = template_file.read_text(encoding="utf-8") if template_file.is_file() else tokenizer.chat_template
    return image_only_processor(processor_class, image_processor, tokenizer, template)


def image_only_processor(processor_class: type, image_processor, tokenizer, chat_template: str | None):
    """An instance of ``processor_class`` (a transformers multimodal processor) with no video processor.

    transformers checks every sub-processor its ``__init__`` names, the video processor too even when
    it is None, and that check fails without torchvision; a subclass whose ``__init__`` names only the
    image processor and the tokenizer is the same processor for images and text, and saves the same folder.
    """
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        processor_class.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    image_only = type(processor_class.__name__, (processor_class,), {"__init__": __init__,
                                                                    "__module__": processor_class.__module__})
    return image_only(image_processor, tokenizer, chat_template=chat_template)


@contextlib.contextmanager
def quiet_model_io() -> Iterator[None]:
    """Inside the block, transformers loads and saves models without progress bars or a DeepSpeed import.

    * Progress bars: ``from_pretrained`` draws "Loading weights" and
      ``save_pretrained`` "Writing model shards"; rltk loads and saves at every
      checkpoint and stage hand-off, and a bar each time buries the training
      progress line. Only transformers' own switch is turned off, and turned
      back on when the block ends, so the user's bars elsewhere stay as they were.
    * DeepSpeed: ``save_pretrained`` unwraps the model through accelerate,
      which imports DeepSpeed whenever it is installed just to test for its
      engine class; that import takes seconds and warns "Setting accelerator to
      CPU" on a machine without a GPU, under any strategy. No DeepSpeed engine
      can exist before DeepSpeed is imported, so until then the test is
      answered "not installed" for the duration of the block.

    Both are process-wide flags, flipped for the block only.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(_no_transformers_progress_bars())
        if "deepspeed" not in sys.modules:
            stack.enter_context(_accelerate_sees_no_deepspeed())
        yield


@contextlib.contextmanager
def _no_transformers_progress_bars() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    if not hf_logging.is_progress_bar_enabled():
        yield
        return
    if hasattr(hf_logging, "_tqdm_active"):
        # transformers' public disable_progress_bar() also switches off huggingface_hub's bars and
        # forgets the user's per-group hub settings; rltk reads local folders, so its own flag suffices.
        hf_logging._tqdm_active = False
        try:
            yield
        finally:
            hf_logging._tqdm_active = True
    else:
        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _accelerate_sees_no_deepspeed() -> Iterator[None]:
    try:
        from accelerate.utils import other as accelerate_other
    except ImportError:
        yield
        return
    original = getattr(accelerate_other, "is_deepspeed_available", None)
    if original is None:
        yield
        return
    accelerate_other.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        accelerate_other.is_deepspeed_available = original


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give ``tokenizer`` a pad token if it has none, and return it.

    Uses the eos token, as most decoder-only models do: padding is masked out
    everywhere in rltk, so sharing the id is harmless, while adding a new
    token would change the vocabulary size the model was trained with.
    """
    if tokenizer.pad_token_id is not None:
        return tokenizer
    if tokenizer.eos_token is None:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has neither a pad nor an eos token; rltk needs one to "
            f"pad batches. Set tokenizer.pad_token to an existing token before building the run."
        )
    tokenizer.pad_token = tokenizer.eos_token
    logger.info("tokenizer has no pad token; using eos %r (id %d) for padding",
                tokenizer.eos_token, tokenizer.eos_token_id)
    return tokenizer


#: Written beside a generic tokenizer so that ``AutoTokenizer(..., trust_remote_code=True)`` reads it exactly too.
AUTO_TOKENIZER_MODULE = "tokenization_rltk"
_AUTO_TOKENIZER_SOURCE = '''"""The tokenizer an rltk run trained with: tokenizer.json as it is (written by `rltk export` and `rltk serve-tinker`).

transformers' AutoTokenizer only reads this file when asked to trust the folder's code; otherwise
tokenizer_config.json's tokenizer_class (TokenizersBackend) gives the same tokenizer.
"""

from transformers import PreTrainedTokenizerFast


class RltkTokenizer(PreTrainedTokenizerFast):
    """tokenizer.json verbatim: no pre-tokenizer or normalizer of a model family put in its place."""
'''


def make_auto_tokenizer_exact(out_dir: Path) -> list:
    """Let ``AutoTokenizer.from_pretrained(out_dir)`` load the tokenizer rltk trained with, token for token.

    A tokenizer declared generic (``TokenizersBackend``, ``PreTrainedTokenizerFast``: what rltk's loader
    reads verbatim from ``tokenizer.json``, e.g. the tiny model's char tokenizer) is not what
    ``AutoTokenizer`` loads when ``config.json``'s ``model_type`` has a tokenizer class of its own:
    transformers 5.19 to 5.24 (``AutoTokenizer.from_pretrained``) replace a declared class that differs
    from the model type's by the model type's own (``Qwen2Tokenizer`` for ``qwen2``, which is in their
    ``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``), and that class rebuilds the pipeline from the vocab
    with its own byte-level pre-tokenizer: the char tokenizer's spaces vanish (``'a b'`` -> ``[25, 26]``
    instead of ``[25, 17, 26]``). Whatever ``tokenizer_class`` says. The one way the file can change
    that: that replacement is skipped when ``tokenizer_config.json`` has an ``auto_map``; without
    ``trust_remote_code=True`` the map is then dropped for such model types and the declared class
    loads; with it, the mapped class loads. So the export declares ``TokenizersBackend`` and maps
    ``AutoTokenizer`` to :data:`AUTO_TOKENIZER_MODULE` (a subclass of ``PreTrainedTokenizerFast`` that
    adds nothing). A tokenizer declared with a model-specific class is left as it is: rltk loaded it
    through ``AutoTokenizer`` too. Returns the files written. ``rltk export`` and ``rltk serve-tinker`` (the
    tokenizer it serves) both write their folders through it.
    """
    config_file, tokenizer_json = out_dir / "tokenizer_config.json", out_dir / "tokenizer.json"
    if not (config_file.is_file() and tokenizer_json.is_file()):
        return []
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if config.get("tokenizer_class", "PreTrainedTokenizerFast") not in GENERIC_TOKENIZER_CLASSES \
            or config.get("auto_map"):
        return []
    config["tokenizer_class"] = "TokenizersBackend"
    config["auto_map"] = {"AutoTokenizer": [None, f"{AUTO_TOKENIZER_MODULE}.RltkTokenizer"]}
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    module = out_dir / f"{AUTO_TOKENIZER_MODULE}.py"
    module.write_text(_AUTO_TOKENIZER_SOURCE, encoding="utf-8")
    return [config_file, module]
