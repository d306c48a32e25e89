"""Ulysses sequence parallelism: each rank of a group holds ``S / SP`` tokens of every sequence.

DeepSpeed-Ulysses (Jacobs et al., 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of
Extreme Long Sequence Transformer Models"). Everything but attention is per token, so it runs on the
rank's own slice of the sequence; attention needs every token, so around it the ranks exchange heads for
tokens by all-to-all: ``[B, H, S/SP, d]`` (all heads of my tokens) becomes ``[B, H/SP, S, d]`` (my heads
of all tokens), the model's own attention function runs on that, and the inverse all-to-all brings the
output back to ``[B, S/SP, H, d]``. Activations per rank shrink by ``SP``, the head included (the
vocabulary-sized logits of only ``S/SP`` tokens).

It plugs into Hugging Face models through their attention interface: :func:`ulysses_attention` registers
one attention function (``rltk_ulysses``) that wraps the model's configured one (``sdpa``, ``eager``, ...)
with the two all-to-alls, and builds the attention mask of the whole sequence itself (causal and the
rows' padding), since the model only ever sees its slice. Position ids are the whole sequence's, sliced.

:func:`ulysses_response_logprobs` is :func:`rltk.models.logprobs.response_logprobs` on that split: each
rank takes the log-probs, entropy (and ``sum pi^2``) of its own tokens, and gathers them over the group
into the whole ``[B, T]``, so token sums of losses, KL and entropy downstream are those of the whole
sequence. The gather's backward keeps the rank's own slice of the gradient: every rank of the group
computes the same loss from the same gathered tensor (they hold the same rows), so each token's
gradient enters exactly once, through the rank that computed it, and a data-parallel gradient
all-reduce over every rank sums the group's partial gradients into the whole one.

Needs ``num_key_value_heads`` (and so ``num_attention_heads``) divisible by ``SP``
(:func:`check_heads_divide`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rltk.errors import ConfigError
from rltk.kernels import IGNORE_INDEX
from rltk.models.logprobs import (_head_op, _is_dtensor, _whole_only_in_forward, last_hidden_states,
                                  logit_temperature_factor, output_head_module, positions_from_mask, run_as_forward)
from rltk.models.wrappers import unwrap_model

ATTENTION_NAME = "rltk_ulysses"
SIZE_KEY = "strategy_args.sequence_parallel_size"


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Chunk ``scatter_dim`` over the group's ranks (chunk ``j`` to rank ``j``) and concatenate what each
    rank sent, in rank order, along ``gather_dim``."""
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """:func:`_all_to_all` whose backward is the inverse exchange (gather and scatter dims swapped)."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


class _GatherTokens(torch.autograd.Function):
    """Every rank's ``[B, s]`` slice, concatenated along the tokens; the backward keeps this rank's slice of
    the gradient (the loss downstream is the same on every rank of the group: see the module docstring)."""

    @staticmethod
    def forward(ctx, x, group):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.slice = slice(dist.get_rank(group) * x.shape[1], (dist.get_rank(group) + 1) * x.shape[1])
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.slice].contiguous(), None


@dataclass
class _Split:
    """What the attention function needs while a split forward runs."""

    group: object
    inner: object  # the model's own attention function
    mask: torch.Tensor | None  # additive, the whole sequence's: [B, 1, S, S]; None: causal alone (see below)


_active: list[_Split] = []


def _attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """The registered attention: heads for tokens, the model's attention on whole sequences, and back.
    ``attention_mask`` (built by the model for its slice) is replaced by the whole sequence's."""
    split = _active[-1]
    query, key, value = (_AllToAll.apply(t, split.group, 1, 2) for t in (query, key, value))  # [B, h, S, d]
    kwargs.pop("is_causal", None)
    if split.mask is None:
        out, _ = split.inner(module, query, key, value, None, is_causal=True, **kwargs)
    else:
        out, _ = split.inner(module, query, key, value, split.mask.to(query.dtype), is_causal=False, **kwargs)
    return _AllToAll.apply(out, split.group, 1, 2), None  # [B, S, h, d] -> [B, S/SP, H, d]


def _no_mask(*args, **kwargs):
    """The model's own mask for its slice is never used (:func:`_attention` builds the whole one)."""
    return None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


def whole_sequence_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Causal and key-padding mask of left-padded rows, additive (0 or the dtype's minimum). Shape: (B, 1, S, S).

    A query that may see no key (a left-padding position) sees them all with equal weight, as a
    finite minimum makes softmax do; its output is never read."""
    S = attention_mask.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = causal[None] & attention_mask.bool()[:, None, :]
    return torch.zeros(allowed.shape, dtype=torch.float32, device=attention_mask.device).masked_fill_(
        ~allowed, torch.finfo(torch.float32).min)[:, None]


#: Attention functions that apply causality themselves when given no mask (``is_causal``); eager needs the mask.
CAUSAL_WITHOUT_MASK = ("sdpa", "flash_attention_2", "flash_attention_3")


def only_trailing_padding(attention_mask: torch.Tensor) -> bool:
    """Whether every row of ``attention_mask`` ``[B, S]`` is ones then zeros (no left padding). Then causality
    alone masks right: a real query sees no later position, and the trailing positions' outputs are never read."""
    mask = attention_mask.bool()
    return bool(mask[:, 0].all() and (mask[:, 1:] <= mask[:, :-1]).all())


def check_heads_divide(model: nn.Module, size: int) -> None:
    """Refuse (naming the key) a group size that does not divide the model's key/value and query heads."""
    config = getattr(unwrap_model(model), "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads is None:
        raise ConfigError(f"{SIZE_KEY}={size}: {type(unwrap_model(model)).__name__} has no num_attention_heads in "
                          "its config; sequence parallelism splits attention heads over the group")
    if heads % size or kv_heads % size:
        raise ConfigError(f"{SIZE_KEY}={size} does not divide the model's {heads} attention heads and "
                          f"{kv_heads} key/value heads; choose a size that divides {math.gcd(heads, kv_heads)}")


@contextlib.contextmanager
def ulysses_attention(model: nn.Module, group, attention_mask: torch.Tensor):
    """Inside, ``model``'s attention runs split over ``group`` for rows whose whole mask is ``attention_mask``
    ``[B, S]`` (each rank then calls the model on its ``S / SP`` tokens)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = unwrap_model(model).config
    own = config._attn_implementation
    if own == ATTENTION_NAME:  # nested (the reference inside a policy pass): the outer split holds
        raise RuntimeError("ulysses_attention: this model's attention is already split")
    if own not in ALL_ATTENTION_FUNCTIONS:
        raise ConfigError(f"{SIZE_KEY}: the model's attention implementation '{own}' has no attention function "
                          f"to split (valid: {', '.join(sorted(ALL_ATTENTION_FUNCTIONS.valid_keys()))})")
    _register()
    # an [S, S] mask would cost S^2 per row, and on CPU it sends sdpa to its math kernel, which keeps the
    # [h, S, S] attention weights for the backward: measured 0.71x of one process's saved bytes at SP=2 with
    # it, against (see benchmarks/parallel.py sp-memory) without
    causal_alone = own in CAUSAL_WITHOUT_MASK and only_trailing_padding(attention_mask)
    mask = None if causal_alone else whole_sequence_mask(attention_mask)
    _active.append(_Split(group, ALL_ATTENTION_FUNCTIONS[own], mask))
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = own
        _active.pop()


def ulysses_response_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              response_width: int, *, group, temperature: float = 1.0, impl: str = "auto",
                              with_entropy: bool = False, chunk_size=None, with_sum_pi_squared: bool = False,
                              share_prompts: bool = True) -> tuple[torch.Tensor, ...]:
    """:func:`rltk.models.logprobs.response_logprobs` with every sequence split over ``group`` (see the module
    docstring): same arguments and outputs (``[B, T]`` on every rank of the group), same numbers up to
    float rounding. ``share_prompts`` is accepted and ignored: each rank runs its slice of every row."""
    del share_prompts
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    B, S = input_ids.shape
    prompt_len = S - response_width
    # the forward runs on tokens 0 .. S-2 (the last predicts nothing), padded to a multiple of the group
    n = S - 1
    local = -(-n // size)
    ids = F.pad(input_ids[:, :-1], (0, local * size - n))
    mask = F.pad(attention_mask[:, :-1], (0, local * size - n))
    valid = attention_mask[:, 1:].bool().clone()
    valid[:, : prompt_len - 1] = False  # only response tokens are asked for
    labels = F.pad(input_ids[:, 1:].masked_fill(~valid, IGNORE_INDEX), (0, local * size - n), value=IGNORE_INDEX)
    mine = slice(rank * local, (rank + 1) * local)
    with ulysses_attention(model, group, mask):
        hidden = last_hidden_states(model, ids[:, mine], None, position_ids=positions_from_mask(mask)[:, mine])
    fused = _head_op(model, labels[:, mine].reshape(-1), temperature=temperature * logit_temperature_factor(model),
                     impl=impl, chunk_size=chunk_size, with_sum_pi_squared=with_sum_pi_squared)
    head = output_head_module(model)
    if _whole_only_in_forward(head):  # ZeRO-3, an FSDP2 unit of its own: the head is whole in its forward only
        outputs = run_as_forward(head, fused, hidden.reshape(B * local, -1))
    elif _is_dtensor(head.weight):
        raise ConfigError(f"{SIZE_KEY}: the LM head of {type(unwrap_model(model)).__name__} stays sharded outside "
                          "its forward (FSDP2 with the head in the root module); shard it in a unit of its own")
    else:
        outputs = fused(hidden.reshape(B * local, -1))
    response = slice(prompt_len - 1, prompt_len - 1 + response_width)
    response_valid = valid[:, response]

    def whole(part: torch.Tensor) -> torch.Tensor:
        return _GatherTokens.apply(part.view(B, local), group)[:, response]

    logprobs = whole(outputs[0])
    entropy = torch.where(response_valid, whole(outputs[1]), 0.0) if with_entropy else None
    if not with_sum_pi_squared:
        return logprobs, entropy
    return logprobs, entropy, torch.where(response_valid, whole(outputs[2].detach()), 0.0)
