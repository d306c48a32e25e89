"""Supervised fine-tuning steps (the warm-up stage before RL)."""

from __future__ import annotations

import functools

import torch

from rltk.batch import Experience, collate
from rltk.models.vision.inputs import vision_inputs_of
from rltk.training.step.micro_batches import MicroBatch, micro_batches, run_logprobs
from rltk.training.updates.update_loop import MicroLoss, optimizer_step


def sft_batch(examples: list[tuple[list[int], ...]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Supervised examples as a collated batch whose ``response_mask`` marks the tokens the loss covers.

    An example is ``(prompt ids, completion ids)`` (the loss covers the whole
    completion) or ``(prompt ids, response ids, loss mask)``: a chat
    transcript after its opening, the mask 1 on assistant tokens and 0 on tool
    results, user or environment messages and template tokens (see
    :func:`rltk.data.chat.tokenize_transcript`); a fourth item is the prompt's
    :class:`rltk.batch.PromptImages` (a VLM's row with images), which the batch carries.
    """
    experiences = []
    for i, example in enumerate(examples):
        prompt_ids, response_ids, *rest = example
        mask = rest[0] if rest else None
        vision = rest[1] if len(rest) > 1 else None
        experiences.append(Experience(prompt_ids=prompt_ids, response_ids=response_ids, score=0.0, group_id=i,
                                      response_mask=list(mask) if mask is not None else None, vision=vision))
    return collate(experiences, pad_token_id)


def sft_step(strategy, batch: dict[str, torch.Tensor], *, micro_batch_size: int, impl: str = "auto",
             chunk_size: int | None = None, max_tokens_per_micro_batch: int | None = None,
             pack_sequences: bool = False) -> dict[str, float]:
    """One optimizer step of token-level cross-entropy on the completion tokens.

        L = - sum_{i,t} m_{i,t} log pi(y_{i,t} | x_i, y_{i,<t}) / sum_{i,t} m_{i,t}

    ``m`` is ``batch["response_mask"]``: the completion, or a transcript's
    assistant tokens (tool results and user turns are read, never taught).

    normalised by the global token count so micro-batching and data parallelism
    give the gradient of one large batch
    (:func:`rltk.training.updates.update_loop.optimizer_step`). Returns ``sft_loss`` (that L),
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
    if pack_sequences or max_tokens_per_micro_batch is not None:
        forward = functools.partial(run_logprobs, trim=True, pack=pack_sequences, strategy=strategy)
    else:
        forward = functools.partial(_padded_logprobs, strategy=strategy)
    micro_loss = functools.partial(_micro_nll, strategy=strategy, width=T, global_tokens=global_tokens,
                                   forward=forward, impl=impl, chunk_size=chunk_size)
    # as many micro-batches as the busiest rank; padding ones have zero weight (see optimizer_step)
    micro = micro_batches(strategy, batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens_per_micro_batch,
                          packed=pack_sequences)
    sums, info = optimizer_step(strategy, micro, micro_loss)
    return {"sft_loss": sums["sft_loss"], "entropy": sums["entropy"], **info}


def _padded_logprobs(model, mb: dict[str, torch.Tensor], width: int, *, strategy,
                     **kwargs) -> tuple[torch.Tensor, ...]:
    """The micro-batch's log-probs at the batch's full widths (rows cut by count: nothing to trim), the
    strategy's pass (:meth:`~rltk.strategies.base.TrainingStrategy.logprobs`)."""
    vision = vision_inputs_of(mb)  # a VLM's rows carry their own images
    if vision is not None:
        kwargs["vision_inputs"] = vision
    return strategy.logprobs(model, mb["input_ids"], mb["attention_mask"], width, **kwargs)


def _micro_nll(mb: dict[str, torch.Tensor], micro: MicroBatch, *, strategy, width: int, global_tokens: float,
               forward, impl: str, chunk_size: int | None) -> MicroLoss:
    """One micro-batch's share of :func:`sft_step`'s loss, and its shares of the loss and the entropy."""
    # the fused kernel computes the entropy beside the log-probs anyway; the divergence
    # guard reads it (a collapse to uniform or to one token)
    logprobs, entropy = forward(strategy.model, mb, width, impl=impl, chunk_size=chunk_size, with_entropy=True)
    loss = -(logprobs * mb["response_mask"]).sum() / max(global_tokens, 1.0)

    def read_shares() -> dict[str, float]:
        return {"sft_loss": loss.item(),
                "entropy": (entropy.detach() * mb["response_mask"]).sum().item() / max(global_tokens, 1.0)}

    return MicroLoss(loss, read_shares)
