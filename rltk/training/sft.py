"""Supervised fine-tuning steps (the warm-up stage before RL)."""

from __future__ import annotations

import torch

from rltk.batch import Experience, collate
from rltk.models.logprobs import response_logprobs
from rltk.training.micro_batches import micro_batches, run_logprobs


def sft_batch(examples: list[tuple[list[int], ...]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Supervised examples as a collated batch whose ``response_mask`` marks the tokens the loss covers.

    An example is ``(prompt ids, completion ids)`` (the loss covers the whole
    completion) or ``(prompt ids, response ids, loss mask)``: a chat
    transcript after its opening, the mask 1 on assistant tokens and 0 on tool
    results, user or environment messages and template tokens (see
    :func:`rltk.data.chat.tokenize_transcript`).
    """
    experiences = []
    for i, example in enumerate(examples):
        prompt_ids, response_ids, *mask = example
        experiences.append(Experience(prompt_ids=prompt_ids, response_ids=response_ids, score=0.0, group_id=i,
                                      response_mask=list(mask[0]) if mask else None))
    return collate(experiences, pad_token_id)


def sft_step(strategy, batch: dict[str, torch.Tensor], *, micro_batch_size: int, impl: str = "auto",
             chunk_size: int | None = None, max_tokens_per_micro_batch: int | None = None,
             pack_sequences: bool = False) -> dict[str, float]:
    """One optimizer step of token-level cross-entropy on the completion tokens.

        L = - sum_{i,t} m_{i,t} log pi(y_{i,t} | x_i, y_{i,<t}) / sum_{i,t} m_{i,t}

    ``m`` is ``batch["response_mask"]``: the completion, or a transcript's
    assistant tokens (tool results and user turns are read, never taught).

    normalised by the global token count so micro-batching and data parallelism
    give the gradient of one large batch. Returns ``sft_loss`` (that L),
    ``entropy`` (the mean entropy of the next-token distributions over the same
    tokens, before the update) and the strategy's step info (``grad_norm``,
    ``lr``, ``skipped``).

    ``max_tokens_per_micro_batch`` and ``pack_sequences`` cut and run the
    micro-batches as ``trainer.*`` of the same names do in RL (a token budget;
    each micro-batch's real tokens packed into one row, no padding computed).
    They change how the forward runs, not the loss.
    """
    T = batch["response_mask"].shape[1]
    global_tokens = strategy.all_reduce_sum(
        torch.tensor([batch["response_mask"].sum().item()], dtype=torch.float64)
    ).item()
    total_nll = total_entropy = 0.0
    # as many micro-batches as the busiest rank; padding ones have zero weight (see policy_update)
    for micro in micro_batches(strategy, batch, micro_batch_size=micro_batch_size,
                               max_tokens=max_tokens_per_micro_batch, packed=pack_sequences):
        mb, padding = {k: v.to(strategy.device) for k, v in micro.data.items()}, micro.padding
        with strategy.accumulate(micro.is_last):
            with strategy.autocast():
                # the fused kernel computes the entropy beside the log-probs anyway; the divergence
                # guard reads it (a collapse to uniform or to one token)
                if pack_sequences or max_tokens_per_micro_batch is not None:
                    logprobs, entropy = run_logprobs(strategy.model, mb, T, trim=True, pack=pack_sequences,
                                                     impl=impl, chunk_size=chunk_size, with_entropy=True)
                else:
                    logprobs, entropy = response_logprobs(strategy.model, mb["input_ids"], mb["attention_mask"], T,
                                                          impl=impl, chunk_size=chunk_size, with_entropy=True)
                loss = -(logprobs * mb["response_mask"]).sum() / max(global_tokens, 1.0)
            strategy.backward(loss * 0.0 if padding else loss)
        if not padding:
            total_nll += loss.item()
            total_entropy += (entropy.detach() * mb["response_mask"]).sum().item() / max(global_tokens, 1.0)
    info = strategy.step()
    # ranks' shares of the global means
    total_nll, total_entropy = strategy.all_reduce_sum(
        torch.tensor([total_nll, total_entropy], dtype=torch.float64)).tolist()
    return {"sft_loss": total_nll, "entropy": total_entropy, **{k: float(v) for k, v in info.items()}}
