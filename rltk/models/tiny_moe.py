"""A tiny mixture-of-experts causal LM, built locally like the dense tiny default.

:func:`build_tiny_moe_model` gives a randomly initialised ``Qwen3MoeForCausalLM`` (the architecture of
Qwen3-30B-A3B, shrunk): every decoder layer's MLP is a sparse block of ``num_experts`` small experts of
which a linear router picks the ``top_k`` per token, the experts' outputs weighted by the router's
softmax renormalised over the picked ones (``norm_topk_prob``). With the char tokenizer and the defaults
(hidden 64, 2 layers, 8 experts of width 64, top-2) it has about 230k parameters, of which a token uses
about 70k. It saves to an ordinary Hugging Face folder
(:func:`rltk.models.tiny.save_pretrained_dir`) and loads back through :mod:`rltk.models.loading`.

Selected by config with ``model.tiny.moe.num_experts=8`` (0, the default, keeps the dense Qwen2); the
other ``model.tiny.*`` sizes apply to both. Routing replay and the MoE metrics are
:mod:`rltk.models.moe`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen3MoeForCausalLM


#: The sizes the MoE model shares with the dense tiny model, defaults taken from
#: :func:`rltk.models.tiny.build_tiny_model`.
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
        sizes: any of :data:`SHARED_SIZES`, as in :func:`rltk.models.tiny.build_tiny_model` (its defaults).
    """
    import inspect

    from rltk.models.tiny import build_tiny_model

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
    from rltk.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer(tool_role=tiny.tool_role)
    model = build_tiny_moe_model(
        tokenizer, num_experts=tiny.moe.num_experts, top_k=tiny.moe.top_k, expert_size=tiny.moe.expert_size,
        seed=seed, **{name: getattr(tiny, name) for name in SHARED_SIZES})
    return tokenizer, model
