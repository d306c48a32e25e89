"""A tiny causal LM (dense, or a mixture of experts) and a character-level tokenizer, built locally with no downloads.

This is what rltk's embedded default trains: a randomly initialised Qwen2 of a
few hundred thousand parameters over a ~100-symbol character vocabulary, small
enough for GRPO on two CPU cores in minutes. Both save to an ordinary Hugging
Face folder (:func:`save_pretrained_dir`) that every other part of rltk loads
like a real model (:mod:`rltk.models.loading`).

Token ids are fixed forever: special tokens first (:data:`SPECIAL_TOKENS`),
then :data:`ALPHABET` in order, then ``extra_chars``, then the special tokens
added later (:data:`LATE_SPECIAL_TOKENS`, the ``<|tool|>`` role, only in
tokenizers built with ``tool_role=True``). Never reorder them, or saved
checkpoints decode to garbage; a new token goes at the very end, so every
existing id keeps its meaning.

The chat template (:data:`CHAT_TEMPLATE`, documented in
:func:`build_char_tokenizer`) renders roles as one token each, tool schemas
as one short line and tool calls in the Hermes/Qwen form
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

:func:`build_tiny_moe_model` gives a randomly initialised ``Qwen3MoeForCausalLM`` (the architecture of
Qwen3-30B-A3B, shrunk): every decoder layer's MLP is a sparse block of ``num_experts`` small experts of
which a linear router picks the ``top_k`` per token, the experts' outputs weighted by the router's
softmax renormalised over the picked ones (``norm_topk_prob``). With the char tokenizer and the defaults
(hidden 64, 2 layers, 8 experts of width 64, top-2) it has about 230k parameters, of which a token uses
about 70k. It saves and loads like the dense one.

Selected by config with ``model.tiny.moe.num_experts=8`` (0, the default, keeps the dense Qwen2); the
other ``model.tiny.*`` sizes apply to both. Routing replay and the MoE metrics are
:mod:`rltk.models.moe`.

:func:`build_tiny_vlm` gives a randomly initialised ``Qwen2_5_VLForConditionalGeneration`` (Qwen2.5-VL's
architecture, shrunk): a vision tower of ``depth`` blocks cuts each image into 14-pixel patches, merges 2x2
of them into one token of the language model's width, and the language model (the ``model.tiny.*`` sizes)
reads those tokens where the prompt has ``<|image_pad|>`` placeholders, with Qwen2.5-VL's 3-D rotary
positions. Its tokenizer is the char tokenizer with :data:`VISION_TOKENS` appended (``vision=True``), its
image processor (:func:`build_tiny_image_processor`) scales every image to about ``image_size ** 2`` pixels,
so a square image is ``(image_size / 28) ** 2`` placeholder tokens (4 for the default 56). The processor
(:func:`build_tiny_processor`, a ``Qwen2_5_VLProcessor``) saves beside the model; the folder loads back with
``AutoModelForImageTextToText`` and ``AutoProcessor`` like any Hugging Face VLM. Selected by config with
``model.tiny.vision.depth=2`` (0, the default, keeps a text-only model).
"""

from __future__ import annotations

import os
import string
from pathlib import Path

from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

if TYPE_CHECKING:
    import torch
    from transformers import Qwen2ForCausalLM, Qwen3MoeForCausalLM

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|eos|>"
BOS_TOKEN = "<|bos|>"
UNK_TOKEN = "<|unk|>"
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
TOOL_TOKEN = "<|tool|>"

#: Special tokens and their ids (pad 0, eos 1, bos 2, unk 3, then the chat roles).
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN, SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN,
)

#: Special tokens added after the first release, with ids after every ordinary
#: symbol (and after ``extra_chars``): appending them kept every earlier id.
#: ``<|tool|>`` opens a tool result message (id ``len(SPECIAL_TOKENS) +
#: len(ALPHABET)`` = 104 without extra characters). Only tokenizers built with
#: ``tool_role=True`` have it: a token more changes the random init of every
#: tiny model (the embedding is drawn first), and the single-turn default's
#: learning was measured over seeds with the 104-token vocabulary.
LATE_SPECIAL_TOKENS: tuple[str, ...] = (TOOL_TOKEN,)

#: Qwen2.5-VL's image markers, appended (after ``<|tool|>`` when there is one) by ``vision=True``: an image
#: renders as ``<|vision_start|><|image_pad|><|vision_end|>`` and the processor repeats ``<|image_pad|>``
#: once per merged patch. ``<|video_pad|>`` is there because the processor and the model's config need a
#: video token id that no text can produce (rltk feeds no videos).
VISION_TOKENS: tuple[str, ...] = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_TOKEN = "<|image_pad|>"

#: Every ordinary symbol, in id order after the special tokens. Arithmetic and
#: Countdown come first so their ids stay small and stable; then letters,
#: punctuation and the characters answer formats use (``#### 42``,
#: ``\\boxed{42}``, ``<answer>...</answer>``).
ALPHABET: str = (
    string.digits
    + " +-*/=()"
    + string.ascii_lowercase
    + string.ascii_uppercase
    + ".,:;!?'\"_%$&@^~|[]`"
    + "#<>\\{}"
    + "\n\t"
)

# One token per role marker (rather than spelling "user:" out in characters)
# keeps prompts short, which matters for a model with 256 positions. Each
# message ends with eos, so a model trained on the template stops after its
# answer; the template rejects unknown roles instead of silently dropping them.
#
# Tools (``tools=``, OpenAI function schemas or bare {"name", "parameters"}
# dicts) are rendered as one line of signatures in the first system turn,
# ``tools: calculator(expression);search(query,k)``, never the full JSON schema:
# a schema with its descriptions is hundreds of characters, more than the
# whole context of the tiny model. A system message's content comes first and
# the tool line after a newline; without a system message the tool line is a
# system turn of its own. Only the first message may be a system message when
# tools are given, so the tool line is written exactly once.
#
# An assistant message's ``tool_calls`` (OpenAI's {"type": "function",
# "function": {"name", "arguments"}} or bare {"name", "arguments"}; arguments a
# dict or a JSON string) follow its content as Hermes/Qwen tool calls,
# ``<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>``,
# one after another without separators, then eos. Tool results are
# ``<|tool|>result<|eos|>``. Every message renders on its own, independent of
# the ones after it, so rendering a conversation prefix gives a prefix of the
# whole conversation's text: a multi-turn rollout can append each new
# message's rendering to the tokens it already has.
# ROLES and ROLE_NAMES are filled in by chat_template(): the tool role is opt-in.
_TEMPLATE_SOURCE: str = (
    "{%- macro tool_line() -%}"
    "{{ 'tools: ' }}"
    "{%- for tool in tools -%}"
    "{%- set f = tool['function'] if tool['function'] is defined else tool -%}"
    "{%- if not loop.first -%};{%- endif -%}"
    "{{ f['name'] }}("
    "{%- if f['parameters'] is defined and f['parameters']['properties'] is defined -%}"
    "{{ f['parameters']['properties'].keys() | join(',') }}"
    "{%- endif -%}"
    ")"
    "{%- endfor -%}"
    "{%- endmacro -%}"
    "{%- if tools and (not messages or messages[0]['role'] != 'system') -%}"
    "<|system|>{{ tool_line() }}<|eos|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ROLES -%}"
    "{{ raise_exception('tiny chat template: role must be ROLE_NAMES, got ' + message['role']) }}"
    "{%- endif -%}"
    "{%- if tools and message['role'] == 'system' and not loop.first -%}"
    "{{ raise_exception('tiny chat template: with tools, only the first message may be a system message') }}"
    "{%- endif -%}"
    "<|{{ message['role'] }}|>"
    "{%- if message['content'] is string -%}{{ message['content'] }}{%- endif -%}"
    "CONTENT_PARTS"
    "{%- if tools and message['role'] == 'system' -%}{{ '\\n' }}{{ tool_line() }}{%- endif -%}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set c = call['function'] if call['function'] is defined else call -%}"
    "<tool_call>{\"name\": {{ c['name'] | tojson }}, \"arguments\": "
    "{%- if c['arguments'] is string %} {{ c['arguments'] }}{%- else %} {{ c['arguments'] | tojson }}{%- endif -%}"
    "}</tool_call>"
    "{%- endfor -%}"
    "{%- endif -%}"
    "<|eos|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


# Content given as a list of parts (the HF/OpenAI chat form): text parts in order, and an image part
# ({"type": "image"} or "image_url") as the three vision markers, which the processor expands.
_CONTENT_PARTS: str = (
    "{%- if message['content'] is not string and message['content'] is iterable -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] in ['image', 'image_url'] -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- else -%}{{ raise_exception('tiny chat template: a content part is text or image, got ' + part['type']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
)


def chat_template(tool_role: bool, vision: bool = False) -> str:
    """The tiny chat template for a tokenizer with (or without) the ``<|tool|>`` token and the vision markers.

    Without ``<|tool|>`` a ``tool`` message is an error that says how to get the role,
    rather than ``<|tool|>`` spelled out in characters the model never saw. With ``vision`` a message's
    content may be a list of text and image parts (:data:`VISION_TOKENS`).
    """
    roles = ["system", "user", "assistant"] + (["tool"] if tool_role else [])
    names = "system, user, assistant or tool" if tool_role else (
        "system, user or assistant (a tool message needs the tool role: model.tiny.tool_role=true, "
        "build_char_tokenizer(tool_role=True))")
    source = _TEMPLATE_SOURCE.replace("CONTENT_PARTS", _CONTENT_PARTS if vision else "")
    return source.replace("ROLES", repr(roles)).replace("ROLE_NAMES", names)


#: The chat template of :func:`build_char_tokenizer` with its defaults (no tool role).
CHAT_TEMPLATE: str = chat_template(tool_role=False)


def build_char_tokenizer(extra_chars: str = "", *, tool_role: bool = False,
                         vision: bool = False) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over :data:`ALPHABET` plus ``extra_chars``.

    Every character is one token; a character outside the vocabulary becomes
    ``<|unk|>`` (one per character, so lengths are preserved). Special tokens
    have fixed ids: ``<|pad|>`` 0, ``<|eos|>`` 1, ``<|bos|>`` 2, ``<|unk|>`` 3,
    ``<|system|>`` 4, ``<|user|>`` 5, ``<|assistant|>`` 6, and with ``tool_role``
    ``<|tool|>`` the last id of all (after ``extra_chars``; see
    :data:`LATE_SPECIAL_TOKENS`). Nothing is added
    around the text when encoding (no bos), like Qwen tokenizers; rltk
    tokenizes prompts with ``add_special_tokens=False`` anyway.

    The chat template renders ``<|role|>content<|eos|>`` per message and
    ``<|assistant|>`` as the generation prompt, so
    ``apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False,
    add_generation_prompt=True)`` is ``"<|user|>1+2=<|eos|><|assistant|>"``.
    Roles are ``system``, ``user``, ``assistant`` and, with ``tool_role``, ``tool``. ``tools=``
    renders one line of signatures, ``tools: calculator(expression)``, and an
    assistant's ``tool_calls`` render as
    ``<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>``
    after its content (see the comment on :data:`CHAT_TEMPLATE`).

    Args:
        extra_chars: characters to add after the fixed alphabet (duplicates of
            existing symbols are ignored), e.g. ``"éü"``.
        tool_role: add the ``<|tool|>`` token and the ``tool`` role (multi-turn
            tasks whose tools answer in tool messages).
        vision: add :data:`VISION_TOKENS` (after ``<|tool|>``) and image content parts to the template.
    """
    late = (LATE_SPECIAL_TOKENS if tool_role else ()) + (VISION_TOKENS if vision else ())
    vocab: dict[str, int] = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in ALPHABET + extra_chars:
        if char not in vocab:
            vocab[char] = len(vocab)
    for token in late:
        vocab[token] = len(vocab)
    # BPE with no merges over text with no pre-tokenizer is exactly a
    # character lookup; Fuse() joins decoded characters without separators.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS + late))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, *late],
    )
    tokenizer.chat_template = chat_template(tool_role, vision)
    return tokenizer


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool = True,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 causal LM sized for ``tokenizer``.

    The vocabulary size and the pad/bos/eos ids come from ``tokenizer``, so
    generation stops at its eos. Initialisation is deterministic in ``seed``
    and does not touch the global torch RNG (it runs inside ``fork_rng``).
    The defaults give about 130k parameters (with the char tokenizer).

    Args:
        tokenizer: the tokenizer the model will read, e.g. from
            :func:`build_char_tokenizer`.
        hidden_size: width of the residual stream; divisible by ``num_heads``
            with an even head size (rotary embeddings rotate pairs).
        num_layers: number of decoder layers.
        num_heads: attention heads; a multiple of ``num_kv_heads``.
        num_kv_heads: key/value heads (grouped-query attention).
        intermediate_size: width of each MLP.
        max_position_embeddings: longest prompt + response the model handles.
        tie_word_embeddings: share input embedding and output projection.
        seed: initialisation seed.
    """
    _check_positive(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                    num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                    max_position_embeddings=max_position_embeddings)
    if hidden_size % num_heads != 0 or (hidden_size // num_heads) % 2 != 0:
        raise ValueError(
            f"build_tiny_model: hidden_size={hidden_size} must be divisible by num_heads={num_heads} "
            f"into an even head size (rotary embeddings need pairs); e.g. hidden_size={8 * num_heads}"
        )
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"build_tiny_model: num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} "
            f"(grouped-query attention shares each key/value head between num_heads/num_kv_heads heads)"
        )
    if tokenizer.eos_token_id is None:
        raise ValueError("build_tiny_model: the tokenizer has no eos token; generation could never stop")
    # here, not at the top: the tokenizer alone (`rltk validate` checks warm-up examples with it) needs neither
    # torch nor transformers' modelling code, whose import is most of a validate's time
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        use_sliding_window=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def build_tiny_reward_model(tokenizer: PreTrainedTokenizerFast, *, seed: int = 0, **sizes: int):
    """A randomly initialised ``Qwen2ForSequenceClassification`` with one output (``num_labels=1``): a reward model.

    Same decoder as :func:`build_tiny_model` (``sizes`` are its size arguments, and the decoder
    weights are the ones it would give for ``seed``), with a linear score head on the last token.
    ``save_pretrained_dir`` writes the folder ``reward_model``'s ``path`` loads.
    """
    import torch
    from transformers import Qwen2ForSequenceClassification

    lm = build_tiny_model(tokenizer, seed=seed, **sizes)
    config = lm.config
    config.num_labels = 1
    config.architectures = ["Qwen2ForSequenceClassification"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        model = Qwen2ForSequenceClassification(config)
        # A head of std 1/sqrt(hidden) rather than the 0.02 init: rewards of order 1 that differ between
        # texts, so tests can tell texts (and truncations) apart.
        torch.nn.init.normal_(model.score.weight, std=config.hidden_size ** -0.5)
    model.model.load_state_dict(lm.model.state_dict())
    return model


def build_tiny_from_config(tiny, seed: int) -> tuple[PreTrainedTokenizerFast, Qwen2ForCausalLM]:
    """The tokenizer and random-init model the ``model.tiny`` config section describes.

    ``tiny`` is that section (any object with its fields: the sizes,
    ``tie_word_embeddings`` and ``tool_role``); ``seed`` is the run's seed.
    With ``tiny.moe.num_experts > 0`` the model is the tiny mixture of experts
    (:func:`build_tiny_moe_from_config`).
    """
    moe = getattr(tiny, "moe", None)
    vision = getattr(tiny, "vision", None)
    if moe is not None and moe.num_experts and vision is not None and vision.depth:
        raise ValueError(f"model.tiny.moe.num_experts={moe.num_experts} with model.tiny.vision.depth={vision.depth}: "
                         f"the tiny VLM is a dense Qwen2.5-VL; set one of them to 0")
    if moe is not None and moe.num_experts:
        return build_tiny_moe_from_config(tiny, seed)
    if vision is not None and vision.depth:
        return build_tiny_vlm_from_config(tiny, seed)
    tokenizer = build_char_tokenizer(tool_role=tiny.tool_role)
    model = build_tiny_model(
        tokenizer, hidden_size=tiny.hidden_size, num_layers=tiny.num_layers, num_heads=tiny.num_heads,
        num_kv_heads=tiny.num_kv_heads, intermediate_size=tiny.intermediate_size,
        max_position_embeddings=tiny.max_position_embeddings, tie_word_embeddings=tiny.tie_word_embeddings,
        seed=seed,
    )
    return tokenizer, model


#: The sizes the MoE model shares with the dense tiny model, defaults taken from
#: :func:`build_tiny_model`.
SHARED_SIZES = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "max_position_embeddings",
                "tie_word_embeddings")


def build_tiny_moe_model(tokenizer: PreTrainedTokenizerFast, *, num_experts: int = 8, top_k: int = 2,
                         expert_size: int = 64, seed: int = 0, **sizes) -> Qwen3MoeForCausalLM:
    """A randomly initialised Qwen3-MoE causal LM sized for ``tokenizer`` (every layer sparse).

    Deterministic in ``seed``, without touching the global torch RNG.

    Args:
        num_experts: experts per sparse block (at least 2).
        top_k: experts each token is routed to (``num_experts_per_tok``), at most ``num_experts``.
        expert_size: width of each expert's MLP (``moe_intermediate_size``).
        sizes: any of :data:`SHARED_SIZES`, as in :func:`build_tiny_model` (its defaults).
    """
    import inspect

    unknown = sorted(set(sizes) - set(SHARED_SIZES))
    if unknown:
        raise ValueError(f"build_tiny_moe_model: unknown size(s) {unknown}; valid: {', '.join(SHARED_SIZES)}")
    defaults = inspect.signature(build_tiny_model).parameters
    sizes = {name: sizes.get(name, defaults[name].default) for name in SHARED_SIZES}
    counts = {"num_experts": num_experts, "top_k": top_k, "expert_size": expert_size,
              **{k: v for k, v in sizes.items() if k != "tie_word_embeddings"}}
    bad = {k: v for k, v in counts.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1}
    heads, kv_heads, hidden = sizes["num_heads"], sizes["num_kv_heads"], sizes["hidden_size"]
    if bad or num_experts < 2 or top_k > num_experts or hidden % heads or (hidden // heads) % 2 or heads % kv_heads:
        raise ValueError(
            f"build_tiny_moe_model: got {counts}: every size a positive integer, 2 <= num_experts, top_k <= "
            f"num_experts, hidden_size split into num_heads heads of even size, num_heads a multiple of num_kv_heads")
    if tokenizer.eos_token_id is None:
        raise ValueError("build_tiny_moe_model: the tokenizer has no eos token; generation could never stop")
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=sizes["num_layers"],
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=sizes["max_position_embeddings"], tie_word_embeddings=sizes["tie_word_embeddings"],
        # every layer sparse (decoder_sparse_step=1), so the dense MLP width is unused
        num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_size,
        intermediate_size=expert_size, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        # rltk adds the load-balancing loss itself (algorithm.router_aux_loss_coef), so the model's own is off
        output_router_logits=False, router_aux_loss_coef=0.0, use_sliding_window=False,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config)
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        setattr(model.generation_config, key, getattr(tokenizer, key))
    return model


def build_tiny_moe_from_config(tiny, seed: int):
    """The tokenizer and random-init MoE model of a ``model.tiny`` section with ``moe.num_experts > 0``."""
    tokenizer = build_char_tokenizer(tool_role=tiny.tool_role)
    model = build_tiny_moe_model(
        tokenizer, num_experts=tiny.moe.num_experts, top_k=tiny.moe.top_k, expert_size=tiny.moe.expert_size,
        seed=seed, **{name: getattr(tiny, name) for name in SHARED_SIZES})
    return tokenizer, model


#: Qwen2.5-VL's vision patch, merge and frame sizes; an image side is a multiple of patch * merge pixels.
VISION_PATCH_SIZE, VISION_MERGE_SIZE, VISION_TEMPORAL_PATCH_SIZE = 14, 2, 2


def build_tiny_image_processor(image_size: int = 56):
    """A Qwen2-VL image processor (the PIL backend: no torchvision) that scales every image to ``image_size ** 2`` pixels.

    ``image_size`` must be a multiple of 28 (patch 14 times merge 2). The least and the most pixels are both
    about ``image_size ** 2``, so a square image of any size becomes ``(image_size / 28) ** 2`` tokens; other
    shapes keep their aspect ratio (sides rounded to multiples of 28), about as many tokens.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    step = VISION_PATCH_SIZE * VISION_MERGE_SIZE
    if not isinstance(image_size, int) or isinstance(image_size, bool) or image_size < step or image_size % step:
        raise ValueError(f"model.tiny.vision.image_size={image_size!r} must be a positive multiple of {step} "
                         f"(patch {VISION_PATCH_SIZE} x merge {VISION_MERGE_SIZE}), e.g. 56")
    pixels = image_size * image_size
    return Qwen2VLImageProcessorPil(
        patch_size=VISION_PATCH_SIZE, merge_size=VISION_MERGE_SIZE, temporal_patch_size=VISION_TEMPORAL_PATCH_SIZE,
        size={"shortest_edge": pixels, "longest_edge": pixels})


def build_tiny_processor(tokenizer: PreTrainedTokenizerFast, image_size: int = 56):
    """The ``Qwen2_5_VLProcessor`` of the tiny VLM: ``tokenizer`` (built with ``vision=True``) and its image processor."""
    from transformers import Qwen2_5_VLProcessor

    from rltk.models.loading import image_only_processor

    missing = [t for t in VISION_TOKENS if t not in tokenizer.get_vocab()]
    if missing:
        raise ValueError(f"build_tiny_processor: the tokenizer lacks {missing}; build it with "
                         f"build_char_tokenizer(vision=True)")
    return image_only_processor(Qwen2_5_VLProcessor, build_tiny_image_processor(image_size), tokenizer,
                                tokenizer.chat_template)


def build_tiny_vlm(tokenizer: PreTrainedTokenizerFast, *, depth: int = 2, vision_hidden_size: int = 32,
                   vision_heads: int = 2, seed: int = 0, **sizes):
    """A randomly initialised ``Qwen2_5_VLForConditionalGeneration`` sized for ``tokenizer`` (with the vision tokens).

    Deterministic in ``seed``, without touching the global torch RNG. The last vision block attends over the
    whole image, the others within windows (Qwen2.5-VL's layout; with images of up to 4x4 merged patches a
    window holds the whole image anyway).

    Args:
        depth: vision-tower blocks.
        vision_hidden_size: the vision tower's width (MLP twice that), split into ``vision_heads`` heads.
        sizes: any of :data:`SHARED_SIZES` and ``intermediate_size``, as in :func:`build_tiny_model` (its defaults).
    """
    import inspect

    allowed = SHARED_SIZES + ("intermediate_size",)
    unknown = sorted(set(sizes) - set(allowed))
    if unknown:
        raise ValueError(f"build_tiny_vlm: unknown size(s) {unknown}; valid: {', '.join(allowed)}")
    defaults = inspect.signature(build_tiny_model).parameters
    sizes = {name: sizes.get(name, defaults[name].default) for name in allowed}
    _check_positive(depth=depth, vision_hidden_size=vision_hidden_size, vision_heads=vision_heads,
                    **{k: v for k, v in sizes.items() if k != "tie_word_embeddings"})
    hidden, heads = sizes["hidden_size"], sizes["num_heads"]
    head_dim = hidden // heads
    if hidden % heads or head_dim % 2 or head_dim < 8 or vision_hidden_size % vision_heads \
            or (vision_hidden_size // vision_heads) % 4:
        raise ValueError(
            f"build_tiny_vlm: hidden_size={hidden} must split into num_heads={heads} heads of an even size of at "
            f"least 8 (3-D rotary sections), and vision_hidden_size={vision_hidden_size} into vision_heads="
            f"{vision_heads} heads of a size divisible by 4 (2-D rotary)")
    missing = [t for t in VISION_TOKENS if t not in tokenizer.get_vocab()]
    if missing:
        raise ValueError(f"build_tiny_vlm: the tokenizer lacks {missing}; build it with build_char_tokenizer(vision=True)")
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    # mrope splits each head's rotary half (head_dim / 2 frequencies) into time, height and width sections
    half = head_dim // 2
    mrope = [half - 2 * (half // 3), half // 3, half // 3]
    ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(token) for name, token in
           zip(("vision_start", "vision_end", "image", "video"), VISION_TOKENS)}
    special = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=sizes["intermediate_size"],
            num_hidden_layers=sizes["num_layers"], num_attention_heads=heads,
            num_key_value_heads=sizes["num_kv_heads"], max_position_embeddings=sizes["max_position_embeddings"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope},
            tie_word_embeddings=sizes["tie_word_embeddings"], use_sliding_window=False, **special),
        vision_config=dict(
            depth=depth, hidden_size=vision_hidden_size, intermediate_size=2 * vision_hidden_size,
            num_heads=vision_heads, patch_size=VISION_PATCH_SIZE, spatial_merge_size=VISION_MERGE_SIZE,
            temporal_patch_size=VISION_TEMPORAL_PATCH_SIZE, out_hidden_size=hidden,
            fullatt_block_indexes=[depth - 1], window_size=4 * VISION_PATCH_SIZE * VISION_MERGE_SIZE),
        tie_word_embeddings=sizes["tie_word_embeddings"], **ids, **special)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    for key, value in special.items():
        setattr(model.generation_config, key, value)
    return model


def build_tiny_vlm_from_config(tiny, seed: int):
    """The tokenizer and random-init VLM of a ``model.tiny`` section with ``vision.depth > 0``.

    The processor is :func:`build_tiny_processor` over that tokenizer and ``tiny.vision.image_size``.
    """
    tokenizer = build_char_tokenizer(tool_role=tiny.tool_role, vision=True)
    model = build_tiny_vlm(
        tokenizer, depth=tiny.vision.depth, vision_hidden_size=tiny.vision.hidden_size,
        vision_heads=tiny.vision.num_heads, seed=seed, intermediate_size=tiny.intermediate_size,
        **{name: getattr(tiny, name) for name in SHARED_SIZES})
    return tokenizer, model


def save_pretrained_dir(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, path: str | os.PathLike, *, processor=None
) -> Path:
    """Save ``model`` (safetensors) and ``tokenizer`` (and a VLM's ``processor``) into one Hugging Face folder.

    The folder loads back with :func:`rltk.models.loading.load_model` and
    :func:`rltk.models.loading.load_tokenizer` (and :func:`rltk.models.loading.load_processor`), or
    ``model.path=<folder>`` in a config. Returns the folder as a ``Path``.
    """
    from rltk.io import give_default_mode
    from rltk.models.loading import quiet_model_io

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with quiet_model_io():
        model.save_pretrained(path)
    if processor is not None:
        processor.save_pretrained(path)  # preprocessor_config.json, processor_config.json and the tokenizer
    tokenizer.save_pretrained(path)
    give_default_mode(path.glob("*.safetensors"))
    return path


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"build_tiny_model: {name} must be a positive integer, got {value!r}")
