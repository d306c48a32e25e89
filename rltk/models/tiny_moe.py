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


def build_tiny_moe_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    num_experts: int = 8,
    top_k: int = 2,
    expert_size: int = 64,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool = True,
    seed: int = 0,
) -> Qwen3MoeForCausalLM:
    """A randomly initialised Qwen3-MoE causal LM sized for ``tokenizer`` (every layer sparse).

    Deterministic in ``seed``, without touching the global torch RNG. Sizes as in
    :func:`rltk.models.tiny.build_tiny_model`, plus:

    Args:
        num_experts: experts per sparse block (at least 2).
        top_k: experts each token is routed to (``num_experts_per_tok``), at most ``num_experts``.
        expert_size: width of each expert's MLP (``moe_intermediate_size``).
    """
    for name, value in dict(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                            num_kv_heads=num_kv_heads, num_experts=num_experts, top_k=top_k,
                            expert_size=expert_size, max_position_embeddings=max_position_embeddings).items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"build_tiny_moe_model: {name} must be a positive integer, got {value!r}")
    if num_experts < 2 or top_k > num_experts:
        raise ValueError(f"build_tiny_moe_model: need 2 <= num_experts and top_k <= num_experts, got "
                         f"num_experts={num_experts}, top_k={top_k}")
    if hidden_size % num_heads or (hidden_size // num_heads) % 2 or num_heads % num_kv_heads:
        raise ValueError(
            f"build_tiny_moe_model: hidden_size={hidden_size} must split into num_heads={num_heads} heads of even "
            f"size, and num_heads must be a multiple of num_kv_heads={num_kv_heads}")
    if tokenizer.eos_token_id is None:
        raise ValueError("build_tiny_moe_model: the tokenizer has no eos token; generation could never stop")
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=expert_size,  # unused: every layer is sparse (decoder_sparse_step=1)
        moe_intermediate_size=expert_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        # rltk adds the load-balancing loss itself (algorithm.router_aux_loss_coef), so the model's own is off
        output_router_logits=False,
        router_aux_loss_coef=0.0,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        use_sliding_window=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
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
        tokenizer, hidden_size=tiny.hidden_size, num_layers=tiny.num_layers, num_heads=tiny.num_heads,
        num_kv_heads=tiny.num_kv_heads, num_experts=tiny.moe.num_experts, top_k=tiny.moe.top_k,
        expert_size=tiny.moe.expert_size, max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=tiny.tie_word_embeddings, seed=seed)
    return tokenizer, model
