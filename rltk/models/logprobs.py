"""Per-token log-probs (and entropy) of the response part of a batch, from a causal LM.

:func:`response_logprobs` runs the model up to its last hidden states and hands
them, with the LM-head weight, to :func:`rltk.kernels.token_logprobs_and_entropy`,
so the ``[B, S, V]`` logits never exist. :func:`response_logprobs_naive`
computes the same numbers through ``model(...).logits``: the reference in
tests, and the fallback for models the fused path cannot express.

Batch layout (:mod:`rltk.batch`): ``input_ids [B, S]`` hold prompts left-padded
to ``P = S - T`` and responses right-padded to ``T``; the hidden state at
position ``P - 1 + t`` predicts response token ``input_ids[:, P + t]``.
Position ids come from the attention mask (``cumsum - 1``, clamped at 0), so a
left-padded prompt gets the positions it had at generation time.

Models and wrappers:

* Hugging Face causal LMs whose base model (``get_decoder()``, ``.model`` or
  ``.base_model``) returns the final, normed hidden states and whose head is
  ``get_output_embeddings()``; tied and untied heads both work, as does an LM
  head with a bias.
* Final logit scalings that are a plain factor: Cohere's ``logit_scale``
  (logits * s) and Granite's ``logits_scaling`` (logits / s) are folded into
  the temperature. Tanh soft-capping (Gemma 2/3 ``final_logit_softcapping``,
  RecurrentGemma ``logits_soft_cap``) is not a linear-softmax and raises
  NotImplementedError; other model-specific edits of the logits inside
  ``forward`` (vocabulary slicing) are not detected: check new architectures
  against :func:`response_logprobs_naive`.
* A vision-language model's image and video placeholder tokens
  (:func:`rltk.models.vision.tower.vision_token_ids`) are out of every softmax
  here, naive and fused, as they are out of the rollout engines' sampling
  (:mod:`rltk.kernels.excluded_tokens`), so the trainer scores the distribution
  the engines sampled from; a text model's numbers are untouched.
* The model is always called through its own (possibly wrapped) ``forward``,
  so DDP gradient sync, FSDP2 unsharding and DeepSpeed hooks run; the last
  hidden states are taken from the base model with a forward hook, and
  ``logits_to_keep=1`` keeps the head's own output to one position.
* A head whose weight is only whole inside its own module's forward
  (DeepSpeed ZeRO-3 partitions every parameter outside it; an FSDP2 unit of
  its own reshards after it): the fused op then runs *as* the head module's
  forward, so the engine's hooks gather the weight before it, release it
  after, gather it again before the op's backward and reduce its gradient into
  the shard, exactly as for the model's own layers. Any ``impl`` works there.
* A head weight left sharded (a DTensor) by an FSDP2 wrapper whose hooks do
  not cover the head: ``impl="auto"`` computes the logits through a second
  forward of the model instead (the response positions only, where the model
  takes ``logits_to_keep``); an explicit ``impl`` is an error.
"""

from __future__ import annotations

import inspect
import logging
import warnings

import torch
from torch import nn

from rltk.kernels import IGNORE_INDEX, token_logprobs_and_entropy
from rltk.kernels.excluded_tokens import exclude_tokens
from rltk.models.kv_cache import cache_keyword
from rltk.models.packing import pack_rows
from rltk.models.sharding import has_sharded_parameters
from rltk.models.vision.inputs import refuse_packing_reason, token_type_ids
from rltk.models.vision.tower import forget_rope_deltas, vision_token_ids
from rltk.models.wrappers import unwrap_model
from rltk.notices import notice_once

logger = logging.getLogger(__name__)


def response_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_width: int,
    *,
    temperature: float = 1.0,
    impl: str = "auto",
    with_entropy: bool = False,
    chunk_size: int | tuple[int, int] | None = None,
    with_sum_pi_squared: bool = False,
    pack: bool = False,
    share_prompts: bool = True,
    routed_experts: torch.Tensor | None = None,
    router_trace=None,
    vision_inputs: dict | None = None,
) -> tuple[torch.Tensor, ...]:
    """Log-probs (and entropy) of the response tokens under ``model``, without full logits.

    Args:
        model: a causal LM (Hugging Face ``*ForCausalLM``), possibly wrapped by
            DDP, FSDP2 or a DeepSpeed engine (ZeRO 1-3; a partitioned head is
            gathered for the op, see the module docstring).
        input_ids: prompt left-padded to ``P``, response right-padded to ``T``. Shape: (B, S).
        attention_mask: 1 on real tokens. Shape: (B, S).
        response_width: ``T``, the number of response columns (``S - T >= 1``).
        temperature: the sampling temperature; logits are divided by it.
        impl: kernel backend, see :func:`rltk.kernels.token_logprobs_and_entropy`.
        with_entropy: also return the entropy of each next-token distribution.
        chunk_size: kernel tile size, see the op.
        with_sum_pi_squared: also return ``sum_v pi(v)^2`` of each next-token
            distribution (at ``temperature``), from the same pass over the
            vocabulary; detached (the optimal-token-baseline statistic).
        pack: run the model on the real tokens only, packed into one row with
            position ids restarting per sequence (:mod:`rltk.models.packing`),
            and the head op on the real response tokens only. Same numbers as
            the padded forward up to float rounding. Under FSDP2 with the head
            in the root module the padded forward runs instead (see below).
        share_prompts: run each distinct prompt once where ``model`` allows it
            (:func:`shared_prompt_hidden_states`); False runs every row whole.
            The two paths agree only up to float rounding, so a pass whose
            numbers are compared with another module's must take the path
            that one takes: the frozen reference and the old-policy pass
            follow the training forward (``prompt_sharing_applies(strategy.model)``),
            so that at equal weights their log-probs are bitwise equal, the KL
            term is exactly 0 and its gradient too (rounding noise there would
            become a full-size step once Adam normalises it).
        routed_experts: an MoE policy's recorded routing to replay, aligned with ``input_ids``
            (``-1``: the token keeps its own top-k). Shape: (B, S, L, k). See :mod:`rltk.models.moe`.
        router_trace: a :class:`rltk.models.moe.RouterTrace` to fill with what the routers computed
            (its ``valid`` marks the real tokens among the rows the routers saw).
            Either of the two turns prompt sharing off (one forward, whose tokens the routing aligns with).
        vision_inputs: a VLM's image inputs of these rows (:func:`rltk.models.vision.inputs.batch_vision_inputs`),
            or None; they turn prompt sharing off and refuse packing (see :func:`last_hidden_states`).

    Returns:
        ``(logprobs, entropy)``, fp32. Shape: (B, T) each; ``entropy`` is None
        unless ``with_entropy``. With ``with_sum_pi_squared`` a third (B, T)
        tensor ``sum_pi_squared`` follows, without gradient. All are 0 on
        response padding (``attention_mask == 0``); mask environment tokens
        yourself with ``response_mask``. Log-probs and entropy are
        differentiable with respect to the model's parameters.
    """
    batch_size, prompt_len, width = _check_batch(input_ids, attention_mask, response_width)
    if width == 0:
        return _empty_outputs(batch_size, input_ids.device, with_entropy, with_sum_pi_squared)
    if routed_experts is not None or router_trace is not None:
        return _routed_response_logprobs(model, input_ids, attention_mask, width, routed_experts, router_trace,
                                         pack=pack, temperature=temperature, impl=impl, with_entropy=with_entropy,
                                         chunk_size=chunk_size, with_sum_pi_squared=with_sum_pi_squared)
    if vision_inputs and pack:
        raise ValueError(refuse_packing_reason())
    share_prompts = share_prompts and not vision_inputs
    if pack:
        head = output_head_module(model)
        # A head sharded outside its own forward (the root module of an FSDP2 model: a DTensor here)
        # takes the padded path below, whose logits come from a second forward of the model when the
        # head stays sharded (no packing there). A head in an FSDP2 unit of its own, or
        # under ZeRO-3, is gathered for the op and packs.
        if _whole_only_in_forward(head) or not _is_dtensor(head.weight):
            return _packed_response_logprobs(model, input_ids, attention_mask, width, temperature=temperature,
                                             impl=impl, with_entropy=with_entropy, chunk_size=chunk_size,
                                             with_sum_pi_squared=with_sum_pi_squared)
    # [B, T, D]: positions P-1 .. S-2 predict input_ids[:, P:]; a prompt shared by several rows (the n
    # samples of a group) runs once
    hidden = shared_prompt_hidden_states(model, input_ids, attention_mask, prompt_len) if share_prompts else None
    if hidden is None:
        hidden = last_hidden_states(model, input_ids[:, :-1], attention_mask[:, :-1],
                                    vision_inputs=vision_inputs)[:, prompt_len - 1 :]
    head = output_head_module(model)
    gather_in_forward = _whole_only_in_forward(head)
    if not gather_in_forward and _is_dtensor(head.weight):
        _refuse_or_note_sharded_head(model, impl)
        return _response_logprobs_through_forward(model, input_ids, attention_mask, width, temperature=temperature,
                                                  with_entropy=with_entropy, with_sum_pi_squared=with_sum_pi_squared,
                                                  vision_inputs=vision_inputs)
    return _padded_head_outputs(model, head, hidden, input_ids, attention_mask, prompt_len, width,
                                gather_in_forward=gather_in_forward, temperature=temperature, impl=impl,
                                with_entropy=with_entropy, chunk_size=chunk_size,
                                with_sum_pi_squared=with_sum_pi_squared)


def _padded_head_outputs(model, head, hidden, input_ids, attention_mask, prompt_len, width, *, gather_in_forward,
                         temperature, impl, with_entropy, chunk_size,
                         with_sum_pi_squared) -> tuple[torch.Tensor, ...]:
    """:func:`response_logprobs`' head op over the padded response hidden states ``hidden`` ``[B, T, D]``,
    gathering the head inside its forward where only that makes it whole."""
    batch_size = input_ids.shape[0]
    response_valid = attention_mask[:, prompt_len:].bool()  # [B, T]
    labels = input_ids[:, prompt_len:].masked_fill(~response_valid, IGNORE_INDEX).reshape(-1)
    fused = _head_op(model, labels, temperature=temperature * logit_temperature_factor(model), impl=impl,
                     chunk_size=chunk_size, with_sum_pi_squared=with_sum_pi_squared)
    hidden = hidden.reshape(batch_size * width, -1)
    outputs = run_as_forward(head, fused, hidden) if gather_in_forward else fused(hidden)
    logprobs = outputs[0].view(batch_size, width)
    entropy = torch.where(response_valid, outputs[1].view(batch_size, width), 0.0) if with_entropy else None
    sum_pi_squared = None
    if with_sum_pi_squared:
        sum_pi_squared = torch.where(response_valid, outputs[2].view(batch_size, width), 0.0)
    return _outputs(logprobs, entropy, sum_pi_squared, with_sum_pi_squared)


def _packed_response_logprobs(model, input_ids, attention_mask, width, *, temperature, impl, with_entropy,
                              chunk_size, with_sum_pi_squared) -> tuple[torch.Tensor, ...]:
    """:func:`response_logprobs` with ``pack=True``: one packed forward, the op on the ``N`` real
    response tokens only, results scattered back to ``[B, T]``."""
    packed = pack_rows(input_ids, attention_mask, width)
    hidden = last_hidden_states(model, packed.input_ids, None, position_ids=packed.position_ids)  # [1, L, D]
    hidden = hidden[0, packed.predictors]  # [N, D]
    head = output_head_module(model)
    fused = _head_op(model, packed.labels, temperature=temperature * logit_temperature_factor(model), impl=impl,
                     chunk_size=chunk_size, with_sum_pi_squared=with_sum_pi_squared)
    outputs = run_as_forward(head, fused, hidden) if _whole_only_in_forward(head) else fused(hidden)
    batch_size = input_ids.shape[0]
    logprobs = packed.scatter(outputs[0].float(), batch_size, width)
    entropy = packed.scatter(outputs[1].float(), batch_size, width) if with_entropy else None
    sum_pi_squared = packed.scatter(outputs[2].float(), batch_size, width) if with_sum_pi_squared else None
    return _outputs(logprobs, entropy, sum_pi_squared, with_sum_pi_squared)


def replay_layout(routed_experts: torch.Tensor | None, attention_mask: torch.Tensor, *,
                  pack: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``routed_experts [B, S, L, k]`` laid out as the routers of one forward over these rows see their tokens,
    and which of those tokens are real: padded, every row but its last column (the forward of log-probs and of
    values both read ``input_ids[:, :-1]``); packed (:func:`rltk.models.packing.pack_rows`), the real tokens,
    row after row. Shape: -> ([N, L, k] or None, [N] bool)."""
    if pack:
        real = attention_mask.bool()
        replay = routed_experts[real] if routed_experts is not None else None  # [N_real, L, k]
        return replay, torch.ones(int(real.sum()), dtype=torch.bool, device=attention_mask.device)
    replay = routed_experts[:, :-1].reshape(-1, *routed_experts.shape[2:]) if routed_experts is not None else None
    return replay, attention_mask[:, :-1].reshape(-1).bool()


def _routed_response_logprobs(model, input_ids, attention_mask, width, routed_experts, router_trace, *, pack,
                              **kwargs) -> tuple[torch.Tensor, ...]:
    """:func:`response_logprobs` of an MoE policy under :func:`rltk.models.moe.route`: the one forward's
    routers take ``routed_experts`` flattened the way that forward lays out its tokens (padded: every row
    but its last column; packed: the real tokens, row after row) and/or fill ``router_trace``."""
    from rltk.models.moe import route

    replay, valid = replay_layout(routed_experts, attention_mask, pack=pack)
    if router_trace is not None:
        router_trace.valid, router_trace.rollout = valid, replay
        replay = replay if router_trace.replay else None
    with route(model, replay, router_trace):
        return response_logprobs(model, input_ids, attention_mask, width, pack=pack, share_prompts=False, **kwargs)


def _refuse_or_note_sharded_head(model: nn.Module, impl: str) -> None:
    """A head weight still a sharded DTensor after the forward: an error for an explicit ``impl`` (the fused
    op cannot see the full ``[V, D]`` matrix), else a one-time notice that logits come from a second forward."""
    if impl != "auto":
        raise NotImplementedError(
            f"the LM head weight of {type(unwrap_model(model)).__name__} is a sharded DTensor after the "
            f"forward pass (an FSDP wrapper that does not unshard the head), so the fused op (impl='{impl}') "
            "cannot see the full [V, D] matrix. Use impl='auto' (computes the logits through the model's "
            "forward then), or shard the model with FSDP2 with the head in the root module or in a unit "
            "of its own."
        )
    notice_once(logger, "the fused log-prob op is off",
                f"the LM head weight of {type(unwrap_model(model)).__name__} stays a sharded DTensor after the "
                "forward (an FSDP wrapper that does not unshard the head), so logits come from a second "
                "forward of the model; shard the head in the root module or a unit of its own to fuse")


def _head_op(model: nn.Module, labels: torch.Tensor, *, temperature: float, impl: str,
             chunk_size: int | tuple[int, int] | None, with_sum_pi_squared: bool):
    """The fused head op over ``hidden`` [N, D] for ``labels`` [N], as a function of ``hidden`` alone so it can
    run as the head module's forward (:func:`run_as_forward`). The head weight is read inside it: under
    ZeRO-3 or an FSDP2 unit of its own it is whole only there. ``temperature`` includes the model's own
    logit scaling. A VLM's image and video tokens are excluded from the softmax
    (:func:`rltk.kernels.excluded_tokens.exclude_tokens`), as the rollout engines exclude them."""

    excluded = vision_token_ids(model)

    def fused(hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weight, bias = output_head(model)
        dtype = torch.promote_types(hidden.dtype, weight.dtype)
        hidden, weight, bias = hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
        outputs = token_logprobs_and_entropy(
            hidden, weight, labels, bias=bias,
            temperature=temperature, impl=impl, chunk_size=chunk_size, with_sum_pi_squared=with_sum_pi_squared,
        )
        # a VLM's engines never sample its image/video placeholders: score the distribution they sample from
        return exclude_tokens(outputs, hidden, weight, bias, labels, excluded, temperature=temperature)

    return fused


def _empty_outputs(batch_size: int, device: torch.device, with_entropy: bool,
                   with_sum_pi_squared: bool) -> tuple[torch.Tensor, ...]:
    """The outputs for a batch with no response columns: fp32 tensors of shape (B, 0), each its own."""
    empty = torch.zeros(batch_size, 0, dtype=torch.float32, device=device)
    return _outputs(empty, empty.clone() if with_entropy else None,
                    empty.clone() if with_sum_pi_squared else None, with_sum_pi_squared)


def _outputs(logprobs, entropy, sum_pi_squared, with_sum_pi_squared: bool) -> tuple[torch.Tensor, ...]:
    """``(logprobs, entropy)``, with ``sum_pi_squared`` third only when it was asked for."""
    return (logprobs, entropy, sum_pi_squared) if with_sum_pi_squared else (logprobs, entropy)


def response_logprobs_naive(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_width: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
    vision_inputs: dict | None = None,
) -> tuple[torch.Tensor, ...]:
    """The reference for :func:`response_logprobs`: full ``model(...).logits`` and ``log_softmax``.

    Same arguments, returns and padding rules; costs ``[B, S, V]`` logits (and
    their fp32 log-softmax). Works for every model whose ``forward`` returns
    logits, including soft-capped ones and DeepSpeed ZeRO-3.
    """
    return _logprobs_from_logits(model, input_ids, attention_mask, response_width, temperature=temperature,
                                 with_entropy=with_entropy, with_sum_pi_squared=with_sum_pi_squared,
                                 keep_response_only=False, vision_inputs=vision_inputs)


def _response_logprobs_through_forward(model, input_ids, attention_mask, response_width, *, temperature,
                                       with_entropy, with_sum_pi_squared, vision_inputs=None):
    """:func:`response_logprobs_naive` restricted to the ``T + 1`` last positions where the model takes
    ``logits_to_keep``: ``[B, T + 1, V]`` logits instead of ``[B, S, V]``."""
    return _logprobs_from_logits(model, input_ids, attention_mask, response_width, temperature=temperature,
                                 with_entropy=with_entropy, with_sum_pi_squared=with_sum_pi_squared,
                                 keep_response_only=True, vision_inputs=vision_inputs)


def _logprobs_from_logits(model, input_ids, attention_mask, response_width, *, temperature, with_entropy,
                          with_sum_pi_squared, keep_response_only, vision_inputs=None):
    batch_size, prompt_len, width = _check_batch(input_ids, attention_mask, response_width)
    if width == 0:
        return _empty_outputs(batch_size, input_ids.device, with_entropy, with_sum_pi_squared)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask,
                  position_ids=positions_from_mask(attention_mask), use_cache=False)
    if vision_inputs:  # the model places the features and builds its 3-D positions (see last_hidden_states)
        forget_rope_deltas(unwrap_model(model))
        kwargs.update(vision_inputs, position_ids=None, mm_token_type_ids=token_type_ids(input_ids, model))
    keep = _logits_to_keep_argument(unwrap_model(model)) if keep_response_only else None
    if keep is not None:
        kwargs[keep] = width + 1  # positions P-1 .. S-1; the last one predicts nothing
    logits = model(**kwargs).logits[:, -(width + 1) : -1].float() / temperature  # [B, T, V]
    response_valid = attention_mask[:, prompt_len:].bool()
    labels = input_ids[:, prompt_len:].masked_fill(~response_valid, 0)
    excluded = vision_token_ids(model)
    full_logprobs = excluded_label = None
    if excluded:  # the rollout engines never sample a VLM's image/video placeholders: nor does this softmax
        rows = torch.tensor(excluded, device=logits.device)
        # an excluded label (an environment turn's image inside a multi-turn response) keeps the full softmax's
        # log-prob, finite (rltk.kernels.excluded_tokens)
        excluded_label = torch.isin(labels, rows)
        full_logprobs = logits.gather(-1, labels[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        logits = logits.index_fill(-1, rows, float("-inf"))
    log_probs = torch.log_softmax(logits, dim=-1)
    logprobs = log_probs.gather(-1, labels[..., None]).squeeze(-1)
    if excluded_label is not None:
        logprobs = torch.where(excluded_label, full_logprobs, logprobs)
    logprobs = torch.where(response_valid, logprobs, 0.0)
    entropy = sum_pi_squared = None
    if with_entropy:
        # the excluded tokens' 0 * -inf terms are 0, not NaN
        finite = torch.where(log_probs.isneginf(), 0.0, log_probs) if excluded else log_probs
        entropy = torch.where(response_valid, -(log_probs.exp() * finite).sum(-1), 0.0)
    if with_sum_pi_squared:
        # sum_v pi(v)^2 = exp(logsumexp(2 log pi)), detached: a statistic, not a loss input
        sum_pi_squared = torch.where(response_valid, torch.logsumexp(2.0 * log_probs.detach(), dim=-1).exp(), 0.0)
    return _outputs(logprobs, entropy, sum_pi_squared, with_sum_pi_squared)


# --------------------------------------------------------------------------
# Pieces: positions, hidden states, the head and its logit scaling
# --------------------------------------------------------------------------


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows: ``cumsum(mask) - 1``, clamped at 0. Shape: (B, S)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def last_hidden_states(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       *, position_ids: torch.Tensor | None = None, vision_inputs: dict | None = None) -> torch.Tensor:
    """The base model's final (normed) hidden states for a left-padded batch. Shape: (B, S, D).

    Calls ``model``'s own forward (so wrappers do their work) with
    ``logits_to_keep=1`` and catches the base model's output with a forward
    hook; without a base model it falls back to ``output_hidden_states=True``.
    ``position_ids`` default to :func:`positions_from_mask`; a packed row
    (:mod:`rltk.models.packing`) passes its own with ``attention_mask=None``. A VLM's ``vision_inputs`` go
    to its forward, which places the image features and computes its own (3-D) positions from them.
    """
    inner = unwrap_model(model)
    decoder = base_model(inner)
    if position_ids is None and not vision_inputs:
        position_ids = positions_from_mask(attention_mask)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    if vision_inputs:
        forget_rope_deltas(inner)
        kwargs.update(vision_inputs)
        # the processor's token types, which the model's 3-D rotary positions are built from
        kwargs["mm_token_type_ids"] = token_type_ids(input_ids, inner)
    keep = _logits_to_keep_argument(inner)
    if keep is not None:
        kwargs[keep] = 1
    elif decoder is not None and inner is model and not any(_is_dtensor(p) for p in inner.parameters()):
        # No wrapper or sharding hooks to honour, and no way to shorten the head: skip the head.
        return hidden_of_output(decoder(**kwargs))
    else:
        warnings.warn(
            f"{type(inner).__name__}.forward takes no logits_to_keep argument, so the wrapped model "
            "computes its full logits once before the fused log-prob op; memory use is that of naive.",
            stacklevel=3,
        )
    if decoder is None:
        return model(**kwargs, output_hidden_states=True).hidden_states[-1]
    captured: list = []
    handle = decoder.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        model(**kwargs)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(
            f"the base model {type(decoder).__name__} ran {len(captured)} times in one forward of "
            f"{type(inner).__name__}; cannot tell which output holds the last hidden states. "
            "Use response_logprobs_naive for this model."
        )
    return hidden_of_output(captured[0])


def shared_prompt_hidden_states(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                prompt_len: int) -> torch.Tensor | None:
    """The final hidden states at positions ``P-1 .. S-2`` with each distinct prompt run once, or None
    where that does not apply. Shape: (B, T, D).

    A causal LM's states over the prompt part of a row depend on that prompt alone, so the ``n``
    responses sampled for one prompt share them exactly. The prompt part runs for each distinct
    (left-padded) prompt once with a KV cache, whose keys and values are then indexed out to every
    row, and the response part runs on that cache. Gradients flow through the indexing back into the
    one prompt pass, so values and gradients are those of the full pass (up to float rounding), for
    ``U`` prompts at ``U * P + B * T`` token positions instead of ``B * (P + T)``: with GRPO's groups
    of 8 and short answers about half the work of the policy forward and backward.

    None (the caller runs the whole batch) when every prompt is distinct, and when the model is
    wrapped (DDP, DeepSpeed: their hooks expect one forward per backward), has sharded parameters (ZeRO-3
    or FSDP2 gather them collectively in every forward, and ranks must run the same number),
    trains with gradient checkpointing (HF turns the cache off then), or its base model takes no
    KV cache (:func:`prompt_sharing_applies`, which logs the reason once).
    """
    if not prompt_sharing_applies(model):
        return None
    from transformers import DynamicCache

    inner = unwrap_model(model)
    decoder = base_model(inner)

    prompts = torch.cat([input_ids[:, :prompt_len], attention_mask[:, :prompt_len].to(input_ids.dtype)], dim=1)
    unique, row_prompt = torch.unique(prompts, dim=0, return_inverse=True)  # [U, 2P], [B]
    if unique.shape[0] == input_ids.shape[0]:
        return None
    prompt_ids, prompt_mask = unique[:, :prompt_len], unique[:, prompt_len:].to(attention_mask.dtype)
    cache = DynamicCache(config=getattr(inner, "config", None))
    cache_arg = {cache_keyword(decoder.forward): cache}
    out = decoder(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions_from_mask(prompt_mask),
                  use_cache=True, **cache_arg)
    last_prompt = hidden_of_output(out)[:, -1:][row_prompt]  # [B, 1, D]
    if input_ids.shape[1] - prompt_len == 1:
        return last_prompt
    cache.batch_select_indices(row_prompt)  # [U, ...] -> [B, ...], differentiable indexing
    mask = attention_mask[:, :-1]
    out = decoder(input_ids=input_ids[:, prompt_len:-1], attention_mask=mask,
                  position_ids=positions_from_mask(mask)[:, prompt_len:], use_cache=True, **cache_arg)
    return torch.cat([last_prompt, hidden_of_output(out)], dim=1)  # [B, T, D]


def prompt_sharing_applies(model: nn.Module) -> bool:
    """Whether :func:`shared_prompt_hidden_states` may run ``model``: a plain (unwrapped, unsharded)
    causal LM whose decoder takes a KV cache and that does not checkpoint activations.

    Where it may not, the reason is logged once per process (:func:`prompt_sharing_blocker`): the
    full pass gives the same numbers, slower, and a slower run should never go unexplained.
    Passes that must agree with ``model``'s training forward take this answer from the *training*
    module (``strategy.model``), not from their own (see ``share_prompts`` in :func:`response_logprobs`).
    """
    reason = prompt_sharing_blocker(model)
    if reason is not None:
        notice_once(logger, "rows that share a prompt run it in full", reason)
    return reason is None


def prompt_sharing_blocker(model: nn.Module) -> str | None:
    """Why :func:`shared_prompt_hidden_states` cannot run ``model``, or None where it can."""
    inner = unwrap_model(model)
    decoder = base_model(inner)
    if decoder is None:
        return f"{type(inner).__name__} has no base model (get_decoder(), .model or .base_model) to run with a cache"
    if inner is not model:
        return (f"the model is wrapped ({type(model).__name__}), whose hooks expect one forward per backward; "
                "expected under DDP and DeepSpeed")
    checkpointing = getattr(inner, "is_activation_checkpointing", None)  # transformers 5; 4.x: the old name
    if checkpointing is None:
        checkpointing = getattr(inner, "is_gradient_checkpointing", False)
    if checkpointing:
        return "gradient checkpointing is on, and transformers turns the KV cache off under it"
    if has_sharded_parameters(inner) or any(_is_dtensor(p) for p in inner.parameters()):
        return ("the parameters are sharded (ZeRO-3 or FSDP2 gather them in every forward, and all ranks "
                "must run the same number of forwards)")
    if cache_keyword(decoder.forward) is None:
        return (f"{type(decoder).__name__}.forward declares neither `cache` (transformers >= 5.24) nor "
                "`past_key_values`, so it takes no KV cache")
    return None


def base_model(model: nn.Module) -> nn.Module | None:
    """The decoder stack that returns final hidden states: ``get_decoder()``, ``.model`` or ``.base_model``."""
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        try:
            decoder = get_decoder()
        except Exception:  # some models raise for "no decoder"; try the attributes below
            decoder = None
        if isinstance(decoder, nn.Module) and decoder is not model:
            return decoder
    for name in ("model", "base_model"):
        candidate = getattr(model, name, None)
        if isinstance(candidate, nn.Module) and candidate is not model:
            return candidate
    return None


def output_head_module(model: nn.Module) -> nn.Module:
    """The LM head module (``get_output_embeddings()``); raises NotImplementedError without a ``.weight``."""
    inner = unwrap_model(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise NotImplementedError(
            f"{type(inner).__name__}.get_output_embeddings() gives no Linear head with a .weight, so the "
            "fused log-prob op cannot be used; call response_logprobs_naive instead."
        )
    return head


def output_head(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight [V, D], bias [V] or None)`` of the LM head (the embedding matrix when tied).

    Raises NotImplementedError when the weight is sharded (FSDP2 outside its
    forward, DeepSpeed ZeRO-3 outside the head's forward), where the fused op
    cannot see the full matrix; :func:`response_logprobs` avoids that case by
    running the op inside the head's forward (:func:`run_as_forward`).
    """
    inner = unwrap_model(model)
    head = output_head_module(model)
    weight = head.weight
    if _is_dtensor(weight) or (hasattr(weight, "ds_id") and weight.numel() == 0):
        raise NotImplementedError(
            f"the LM head weight of {type(inner).__name__} is sharded ({type(weight).__name__} with shape "
            f"{tuple(weight.shape)}) after the forward pass (DeepSpeed ZeRO-3, or FSDP with the head "
            "resharded); the fused op needs the full [V, D] matrix. Call response_logprobs, which runs the "
            "op inside the head's forward, or response_logprobs_naive."
        )
    bias = getattr(head, "bias", None)
    return weight, bias if isinstance(bias, torch.Tensor) else None


def logit_temperature_factor(model: nn.Module) -> float:
    """Factor ``f`` with ``model logits = head(h) / f``: folded into the temperature.

    Cohere multiplies its logits by ``logit_scale`` (f = 1 / scale), Granite
    divides them by ``logits_scaling`` (f = scaling). Raises NotImplementedError
    for tanh soft-capping, which no temperature can express.
    """
    inner = unwrap_model(model)
    config = getattr(inner, "config", None)
    if config is None:
        return 1.0
    configs = [config]
    if hasattr(config, "get_text_config"):
        configs.append(config.get_text_config())
    for cfg in configs:
        for key in ("final_logit_softcapping", "logits_soft_cap"):
            if getattr(cfg, key, None) is not None:
                raise NotImplementedError(
                    f"{type(inner).__name__} soft-caps its logits ({key}={getattr(cfg, key)}): "
                    "cap * tanh(logits / cap) is not a linear softmax, so the fused log-prob op cannot "
                    "express it. Use response_logprobs_naive for this model."
                )
    factor = 1.0
    scale = getattr(inner, "logit_scale", None)  # Cohere keeps it on the model
    if scale is None:
        scale = getattr(config, "logit_scale", None) if getattr(config, "model_type", "").startswith("cohere") else None
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        factor /= float(scale)
    scaling = next((getattr(cfg, "logits_scaling") for cfg in configs if getattr(cfg, "logits_scaling", None)), None)
    if scaling is not None:
        factor *= float(scaling)
    return factor


def _check_batch(input_ids, attention_mask, response_width) -> tuple[int, int, int]:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S]; got shape {tuple(input_ids.shape)}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}"
        )
    batch_size, seq_len = input_ids.shape
    if isinstance(response_width, bool) or not isinstance(response_width, int):
        raise ValueError(f"response_width must be an int (T); got {response_width!r}")
    if not 0 <= response_width < seq_len:
        raise ValueError(
            f"response_width={response_width} must be in [0, S) with S = {seq_len} columns: at least one "
            "prompt column must precede the response, since position P - 1 predicts its first token."
        )
    return batch_size, seq_len - response_width, response_width


def _logits_to_keep_argument(model: nn.Module) -> str | None:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in ("logits_to_keep", "num_logits_to_keep") if name in params), None)


def hidden_of_output(output, who: str = "the base model",
                     advice: str = "use response_logprobs_naive for this model") -> torch.Tensor:
    """The last hidden states ``[B, S, D]`` in a decoder stack's output (its ``last_hidden_state``, or its first
    element); a RuntimeError saying that ``who`` returned something else, and ``advice``."""
    hidden = getattr(output, "last_hidden_state", None)
    if hidden is None:
        hidden = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        raise RuntimeError(f"{who} returned {type(output).__name__}, not last hidden states [B, S, D]; {advice}.")
    return hidden


def run_as_forward(module: nn.Module, fn, *args):
    """``fn(*args)`` called as ``module``'s forward, so the hooks registered on ``module`` run around it.

    Engines that gather a module's parameters only for its own forward and
    backward (DeepSpeed ZeRO-3, FSDP2 units) attach that work to the module
    call: the forward pre-hook gathers, the forward hook releases and marks the
    outputs, whose backward gathers again before ``fn``'s backward runs and
    hands the gradient to the engine's reduction. Tensors in ``args`` must be
    positional (forward pre-hooks see only those). ``module.forward`` is
    restored afterwards, even on error.
    """
    own = module.__dict__.get("forward")  # e.g. a wrapper's patched forward, put back as it was
    module.forward = fn
    try:
        return module(*args)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def _whole_only_in_forward(head: nn.Module) -> bool:
    """Whether the head's weight is complete only while its own module runs: a ZeRO-3 parameter
    (``ds_id``; partitioned outside the module's forward) or the weight of an FSDP2 unit of its own."""
    weight = head.weight
    if hasattr(weight, "ds_id"):
        return True
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return False
    return isinstance(head, FSDPModule) and _is_dtensor(weight)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(tensor, DTensor)
