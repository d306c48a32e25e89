"""Token-by-token sampling of the ``hf`` engine for Qwen2 and Llama models: ``generate``'s
results with less compute.

``model.generate`` computes every row at every step: all ``n`` copies of a prompt for its last
token, and rows that already stopped until the longest one ends. :func:`sample` computes a row
only while its tokens can still matter:

* the last prompt token runs once per distinct prompt (the other ``n - 1`` copies would compute
  the same numbers), and its logits and cache are copied out to the rows;
* a row that has sampled a stop token leaves the batch (its cache rows with it).

Everything else is ``generate``'s ``_sample`` loop, step for step: the same position ids, the same
causal mask (built for the whole batch, then the computed rows taken out of it, so attention takes
the same kernel path), the caller's logits processors on every row's scores, one
``torch.multinomial`` over all ``[N, V]`` rows (its random draws do not depend on the
probabilities, so the stream of random numbers is ``generate``'s), finished rows padded. Rows
are independent in every op of these models, and on the CPUs we measured MKL's matrix product
gives a row the same bits at any row count from 4 up (below, other kernels round differently), so
the loop keeps at least 4 rows (or all, if fewer) in each forward: its tokens and log-probs are
then ``generate``'s bit for bit (tested with ``==`` where the machine's BLAS behaves so, within
1e-5 elsewhere). A BLAS whose kernels depend on the row count (GPUs) rounds the rows it leaves
out differently, as ``generate`` itself does for a different batch size.

:func:`sampling_applies` says where the loop runs: a plain (unsharded, unwrapped by peft)
``Qwen2ForCausalLM`` or ``LlamaForCausalLM`` with ``sdpa`` attention and no sliding window.
Other models take ``generate``.
"""

from __future__ import annotations

import torch
from torch import nn

from rltk.models.kv_cache import cache_keyword
from rltk.models.sharding import has_sharded_parameters

#: The smallest row count a forward runs at: below it the BLAS takes other kernels, whose rounding
#: differs from the full batch's.
MIN_FORWARD_ROWS = 4


def sampling_applies(model: nn.Module) -> bool:
    """Whether :func:`sample` may run ``model`` (see the module docstring)."""
    return sampling_blocker(model) is None


def sampling_blocker(model: nn.Module) -> str | None:
    """Why :func:`sample` cannot run ``model`` (so the engine takes ``generate``), or None where it can."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM
    from transformers.masking_utils import create_causal_mask

    if type(model) not in (Qwen2ForCausalLM, LlamaForCausalLM):
        return f"it runs Qwen2ForCausalLM and LlamaForCausalLM only, not {type(model).__name__}"
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"it needs sdpa attention, not {getattr(config, '_attn_implementation', None)!r}"
    if (any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ["full_attention"])
            or getattr(model.model, "has_sliding_layers", False)):
        return "the model has sliding-window layers"
    if has_sharded_parameters(model):
        return "the parameters are sharded (ZeRO-3 or FSDP2)"
    if cache_keyword(model.forward) is None or cache_keyword(create_causal_mask) is None:
        return (f"{type(model).__name__}.forward or create_causal_mask declares neither `cache` nor "
                "`past_key_values` in this transformers release")
    return None


def sample(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
           greedy: bool, stop_ids: list[int], pad_id: int, logits_processor) -> torch.Tensor:
    """The ``[N, L]`` generated tokens (``L <= max_new_tokens``, finished rows padded with ``pad_id``).

    ``input_ids``/``attention_mask``: left-padded prompts. Shape: (N, W). ``logits_processor`` is
    called as ``generate`` calls it, ``(sequences so far, fp32 scores [N, V]) -> scores``.
    """
    from transformers import DynamicCache
    from transformers.masking_utils import create_causal_mask

    rows, width = input_ids.shape
    device = input_ids.device
    model_cache, mask_cache = cache_keyword(model.forward), cache_keyword(create_causal_mask)
    floor = min(MIN_FORWARD_ROWS, rows)
    # generate's position ids, and its mask: dropped (None) when nothing is padded
    positions = attention_mask.long().cumsum(-1) - 1
    positions = positions.masked_fill(attention_mask == 0, 0)
    mask = None if bool((attention_mask == 1).all()) else attention_mask

    def full_mask(cache, query_length: int):
        """The 4D causal mask the model would build for all ``rows`` rows (None: sdpa's is_causal)."""
        if mask is None:
            return None
        stub = torch.empty((rows, query_length, 0), dtype=model.dtype, device=device)
        return create_causal_mask(config=model.config, inputs_embeds=stub, attention_mask=mask,
                                  position_ids=positions[:, -query_length:], **{mask_cache: cache})

    def forward(computed: torch.Tensor, tokens: torch.Tensor, cache) -> torch.Tensor:
        """fp32 last-position logits of the ``computed`` rows (their cache rows in that order)."""
        query_length = tokens.shape[1]
        full = full_mask(cache, query_length)
        out = model(input_ids=tokens, attention_mask=None if full is None else full[computed],
                    position_ids=positions[computed, -query_length:], use_cache=True, logits_to_keep=1,
                    **{model_cache: cache})
        return out.logits[:, -1].to(copy=True, dtype=torch.float32)

    cache = DynamicCache(config=model.config)
    computed = torch.arange(rows, device=device)
    prompt_of_row, lead = shared_prompts(input_ids, attention_mask, floor)
    if prompt_of_row is None:  # every row its own prompt: generate's prefill
        logits = forward(computed, input_ids, cache)
    else:
        # the prompts but their last token, once per distinct prompt (lead[:U] are their first rows) ...
        distinct = lead[: int(prompt_of_row.max()) + 1]
        model(input_ids=input_ids[distinct, : width - 1], attention_mask=attention_mask[distinct, : width - 1],
              position_ids=positions[distinct, : width - 1], use_cache=True, logits_to_keep=1,
              **{model_cache: cache})
        if lead.numel() < rows:  # ... and the last token on those rows (topped up to `floor`)
            if lead.numel() > distinct.numel():
                cache.batch_select_indices(prompt_of_row[lead])
            logits = forward(lead, input_ids[lead, -1:], cache)[prompt_of_row]
            cache.batch_select_indices(prompt_of_row)
        else:  # ... or on every row, when that is no more rows than `floor`
            cache.batch_select_indices(prompt_of_row)
            logits = forward(computed, input_ids[:, -1:], cache)

    sequences = input_ids
    unfinished = torch.ones(rows, dtype=torch.long, device=device)
    stop_tensor = torch.tensor(stop_ids, dtype=torch.long, device=device) if stop_ids else None
    vocab = logits.shape[-1]
    for step in range(max_new_tokens):
        if logits.shape[0] == rows:
            scores = logits
        else:  # rows out of the batch: any valid scores (their tokens are replaced by padding)
            scores = logits.new_zeros((rows, vocab))
            scores[computed] = logits
        scores = logits_processor(sequences, scores)
        if greedy:
            next_tokens = torch.argmax(scores, dim=-1)
        else:
            next_tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        if stop_tensor is not None:
            next_tokens = next_tokens * unfinished + pad_id * (1 - unfinished)
            unfinished = unfinished & ~torch.isin(next_tokens, stop_tensor)
        sequences = torch.cat([sequences, next_tokens[:, None]], dim=-1)
        if step == max_new_tokens - 1 or not bool(unfinished.any()):
            break
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=-1)
        positions = torch.cat([positions, positions[:, -1:] + 1], dim=-1)
        keep = _rows_to_keep(computed, unfinished, floor)
        if keep is not None:
            cache.batch_select_indices(keep)
            computed = computed[keep]
        logits = forward(computed, next_tokens[computed, None], cache)
    return sequences[:, width:]


def shared_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, floor: int = 0):
    """``(prompt_of_row, lead)`` for left-padded rows that repeat prompts: every row's prompt number
    (prompts numbered by their first row), and each prompt's first row, in prompt order, followed by
    other rows up to ``floor`` rows in all. ``(None, None)`` when every row has its own prompt or
    the prompt is one token (nothing to share: a cache must leave a model one token to run)."""
    rows, width = input_ids.shape
    if width < 2:
        return None, None
    keys = torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1)
    unique, inverse = torch.unique(keys, dim=0, return_inverse=True)
    if unique.shape[0] == rows:
        return None, None
    arange = torch.arange(rows, device=input_ids.device)
    first = torch.full((unique.shape[0],), rows, dtype=torch.long, device=input_ids.device)
    first = first.scatter_reduce(0, inverse, arange, reduce="amin")
    first, order = first.sort()  # prompts numbered in the order of their first rows
    number = torch.empty_like(order)
    number[order] = torch.arange(order.numel(), device=order.device)
    prompt_of_row = number[inverse]
    if first.numel() < floor:
        others = torch.ones(rows, dtype=torch.bool, device=input_ids.device)
        others[first] = False
        first = torch.cat([first, others.nonzero().squeeze(1)[: floor - first.numel()]])
    return prompt_of_row, first


def _rows_to_keep(computed: torch.Tensor, unfinished: torch.Tensor, floor: int) -> torch.Tensor | None:
    """Positions in ``computed`` to keep for the next forward: its unfinished rows, topped up with
    finished ones to ``floor`` rows; None when that is all of them."""
    live = unfinished[computed].bool()
    if bool(live.all()):
        return None
    keep = live.nonzero().squeeze(1)
    if keep.numel() < floor:
        done = (~live).nonzero().squeeze(1)[: floor - keep.numel()]
        keep = torch.cat([keep, done]).sort().values
    return None if keep.numel() == computed.numel() else keep
