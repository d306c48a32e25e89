"""Loss aggregations: how a ``[B, T]`` matrix of per-token losses becomes one scalar.

A ``loss_agg`` is ``fn(loss_mat, mask, *, global_tokens=None, global_seqs=None,
**args) -> scalar``. The choice matters: it decides how much each token and
each response weighs in the gradient.

::

    token-mean               sum_{i,t} m l / N_tok                every token weighs the same (DAPO)
    seq-mean-token-sum       sum_{i,t} m l / N_seq                every response's token sum weighs the same
    seq-mean-token-mean      sum_i (sum_t m l / n_i) / N_seq      every response weighs the same whatever
                                                                  its length (original GRPO)
    seq-mean-token-sum-norm  sum_{i,t} m l / (N_seq * C)          token sums over a constant C (Dr. GRPO)

with ``m`` the mask, ``n_i`` the tokens of response ``i``, ``N_tok`` and
``N_seq`` the tokens and (non-empty) responses normalised over.

**Gradient accumulation and data parallelism.** A mini-batch is often split
into micro-batches (and across ranks) whose losses are back-propagated one by
one and summed. Normalising each micro-batch by its own counts then weighs
tokens differently from one big batch. Pass ``global_tokens`` (the number of
mask tokens) and ``global_seqs`` (the number of non-empty responses) of the
*whole* mini-batch, over all micro-batches and ranks, and the sum of the
micro-batch losses equals the loss of the whole batch exactly (every
aggregation is then linear in the rows). :func:`loss_agg_normalisers` counts
them consistently for one micro-batch; sum its results over the micro-batches
and ``all_reduce`` them over ranks. Under DDP, whose gradient all-reduce
*averages* over ranks, multiply the loss by the world size (or divide the
global counts by it) to get the same gradient as one big batch. When the
normalisers are ``None``, the local counts of ``mask`` are used.

float16 / bfloat16 losses are aggregated in float32 (the result is float32).
A response with no mask token (padding row, fully masked response) adds
nothing and is not counted in ``N_seq``; an all-zero mask gives 0, never NaN,
and so does its gradient.

Papers: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale", arXiv:2503.14476 (token-level loss); Liu et al. 2025,
"Understanding R1-Zero-Like Training: A Critical Perspective",
arXiv:2503.20783 (length bias of seq-mean-token-mean; constant normaliser).
"""

from __future__ import annotations

import numbers

import torch

import rltk

__all__ = [
    "token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_mean",
    "seq_mean_token_sum_norm",
    "loss_agg_normalisers",
    "masked_mean",
]

Count = int | float | torch.Tensor | None

#: The builtin loss aggregations by config name, filled by ``@register_loss_agg(name)`` on each definition and
#: returned by this module's ``rltk_loss_aggs`` hook (the entry point ``aggregation``).
LOSS_AGGS = rltk.ComponentTable("loss_agg")
register_loss_agg = LOSS_AGGS.register


def _check(where: str, loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Validate shapes and return the mask as a bool tensor."""
    if loss_mat.dim() != 2 or loss_mat.shape != mask.shape:
        raise ValueError(
            f"loss_agg '{where}': loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} "
            f"must both be [B, T] with the same shape"
        )
    return mask > 0


def _denominator(where: str, name: str, given: Count, local: torch.Tensor) -> torch.Tensor | float:
    """The count to divide by: the global one when given, else the local one; at least 1."""
    if given is None:
        return local.clamp(min=1)
    if isinstance(given, torch.Tensor):
        return given.clamp(min=1)
    if not isinstance(given, numbers.Real) or isinstance(given, bool) or given < 0:
        raise ValueError(
            f"loss_agg '{where}': {name} must be a count >= 0 over the whole mini-batch (all "
            f"micro-batches and ranks), or None for the local count; got {given!r}"
        )
    # An empty mini-batch has a zero numerator too: dividing by 1 gives 0, not NaN.
    return max(float(given), 1.0)


def _masked_row_sums(loss_mat: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    # Half-precision losses are summed in float32: a bf16 loss over thousands of
    # tokens keeps barely three significant digits.
    if loss_mat.dtype in (torch.float16, torch.bfloat16):
        loss_mat = loss_mat.float()
    # where, not multiply: a non-finite loss on a padding token (e.g. a -inf
    # log-prob) must not turn the sum into NaN.
    return torch.where(on, loss_mat, 0.0).sum(-1)


@register_loss_agg("token-mean")
def token_mean(
    loss_mat: torch.Tensor, mask: torch.Tensor, *, global_tokens: Count = None, global_seqs: Count = None
) -> torch.Tensor:
    """Mean over all mask tokens: ``sum_{i,t} m_it l_it / N_tok``.

    Every token weighs the same, so long responses weigh more than short ones
    (DAPO's token-level policy-gradient loss, arXiv:2503.14476). ``N_tok`` is
    ``global_tokens`` or the local mask count; ``global_seqs`` is ignored.

    Shape: (B, T), (B, T) -> ().
    """
    on = _check("token-mean", loss_mat, mask)
    return _masked_row_sums(loss_mat, on).sum() / _denominator(
        "token-mean", "global_tokens", global_tokens, on.sum()
    )


@register_loss_agg("seq-mean-token-sum")
def seq_mean_token_sum(
    loss_mat: torch.Tensor, mask: torch.Tensor, *, global_tokens: Count = None, global_seqs: Count = None
) -> torch.Tensor:
    """Mean over responses of the token sum: ``sum_{i,t} m_it l_it / N_seq``.

    ``N_seq`` is ``global_seqs`` or the local number of non-empty responses;
    ``global_tokens`` is ignored. The loss scale grows with response length.

    Shape: (B, T), (B, T) -> ().
    """
    on = _check("seq-mean-token-sum", loss_mat, mask)
    n_seqs = on.any(-1).sum()
    return _masked_row_sums(loss_mat, on).sum() / _denominator(
        "seq-mean-token-sum", "global_seqs", global_seqs, n_seqs
    )


@register_loss_agg("seq-mean-token-mean")
def seq_mean_token_mean(
    loss_mat: torch.Tensor, mask: torch.Tensor, *, global_tokens: Count = None, global_seqs: Count = None
) -> torch.Tensor:
    """Mean over responses of the per-response token mean (original GRPO).

    ``sum_i (sum_t m_it l_it / n_i) / N_seq`` with ``n_i`` the mask tokens of
    response ``i`` (a row's own length is always complete in a micro-batch,
    so only ``N_seq`` needs the global count). Every response weighs the same
    whatever its length, which Liu et al. 2025 (arXiv:2503.20783) show biases
    towards short correct and long wrong answers. ``global_tokens`` is ignored.

    Paper: Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, eq. (3).

    Shape: (B, T), (B, T) -> ().
    """
    on = _check("seq-mean-token-mean", loss_mat, mask)
    lengths = on.sum(-1)
    per_sequence = _masked_row_sums(loss_mat, on) / lengths.clamp(min=1)
    return per_sequence.sum() / _denominator(
        "seq-mean-token-mean", "global_seqs", global_seqs, (lengths > 0).sum()
    )


@register_loss_agg("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    *,
    global_tokens: Count = None,
    global_seqs: Count = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Token sums over a constant, averaged over responses (Dr. GRPO).

    ``sum_{i,t} m_it l_it / (N_seq * C)``: no division by a response's own
    length, so the length bias of ``seq-mean-token-mean`` disappears, while
    the constant ``C`` keeps the loss scale independent of the batch. ``C`` is
    ``norm_constant``: Dr. GRPO uses the generation budget, the maximum
    response length, and the recipes pass ``rollout.max_new_tokens`` unless
    ``algorithm.loss_agg_args.norm_constant`` is set. Called without it, ``C``
    is ``T``, the width of ``mask``; micro-batches padded to different widths
    then get different ``C``, so gradient accumulation is no longer exact.
    ``global_tokens`` is ignored.

    Paper: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
    Perspective", arXiv:2503.20783.

    Shape: (B, T), (B, T) -> ().
    """
    on = _check("seq-mean-token-sum-norm", loss_mat, mask)
    constant = float(mask.shape[-1] if norm_constant is None else norm_constant)
    if not constant > 0:
        raise ValueError(
            f"loss_agg 'seq-mean-token-sum-norm': norm_constant must be > 0 (e.g. the maximum "
            f"response length), got {norm_constant!r}"
        )
    n_seqs = on.any(-1).sum()
    return _masked_row_sums(loss_mat, on).sum() / (
        _denominator("seq-mean-token-sum-norm", "global_seqs", global_seqs, n_seqs) * constant
    )


def loss_agg_normalisers(mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The counts a loss aggregation normalises by, for one micro-batch.

    ``{"global_tokens": mask tokens, "global_seqs": responses with at least one
    mask token}`` as int64 tensors. Sum them over the micro-batches of a
    mini-batch (and ``all_reduce`` over ranks) before passing them to a
    ``loss_agg``; they are exactly the local counts the aggregations use when
    no normaliser is given.

    Shape: (B, T) -> {name: ()}.
    """
    on = mask > 0
    return {"global_tokens": on.sum(), "global_seqs": on.any(-1).sum()}


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1 (over ``dim``, or everything); 0 when empty.

    Shape: any, same shape -> reduced.
    """
    on = mask > 0
    total = torch.where(on, values, 0.0)
    if dim is None:
        return total.sum() / on.sum().clamp(min=1)
    return total.sum(dim) / on.sum(dim).clamp(min=1)


@rltk.hookimpl
def rltk_loss_aggs():
    """Register the builtin loss aggregations (each marked ``@register_loss_agg`` where it is defined)."""
    return LOSS_AGGS
