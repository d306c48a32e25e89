"""Per-token log-probs and entropy when each rank of a group holds one shard of the LM head's rows.

Tensor parallelism splits the head ``W [V, D]`` by vocabulary: rank ``r`` of the ``TP`` ranks holds rows
``[r V/TP, (r+1) V/TP)`` and the same (replicated) hidden states ``h [N, D]``. The ``[N, V]`` logits are never
gathered, nor even the ``[N, V/TP]`` shard held whole: each rank runs the fused op's online softmax
(:mod:`rltk.kernels.logprobs`, torch or Triton) over its rows and keeps, per token, its max ``m_r``,
``s_r = sum e^(z-m_r)``, ``w_r = sum e^(z-m_r)(z-m_r)`` and the label's logit (0 off the shard); two all-reduces
combine them, with ``M = max_r m_r`` and ``c_r = e^(m_r - M)``::

    s = sum_r s_r c_r        w = sum_r (w_r + (m_r - M) s_r) c_r        z_label = sum_r z_label,r
    lse = M + log s          E_p[z] = M + w / s        logprob = z_label - lse        entropy = log s - w / s

(and, on request, ``q = sum_r q_r c_r^2``, ``sum_v p_v^2 = q / s^2``). The backward pass is each rank's part of
the op's backward from the global ``lse`` and ``E_p[z]``: ``dL/dz_v = g_lp (1[v = label] - p_v) + g_ent p_v
(E_p[z] - z_v)`` on its own columns gives its weight (and bias) gradient with no communication, and a partial
``dL/dh``, summed over the group by one all-reduce, because every rank's ``h`` is the same replicated tensor.
This is Megatron-LM's vocab-parallel cross-entropy (Shoeybi et al. 2019, https://arxiv.org/abs/1909.08053,
section 3) extended to the entropy and fused with the head's matmul as in Cut Cross-Entropy (Wijmans et al.
2024, https://arxiv.org/abs/2411.09009).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from rltk.kernels.logprobs import (
    IGNORE_INDEX, backward_from_stats, shard_backend_and_tiling, shard_softmax_partials,
)
from rltk.kernels.softmax_stats import finish_softmax_stats


def vocab_parallel_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    bias_shard: torch.Tensor | None = None,
    temperature: float = 1.0,
    impl: str = "auto",
    chunk_size: int | Sequence[int] | None = None,
    ignore_index: int = IGNORE_INDEX,
    with_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, ...]:
    """:func:`rltk.kernels.token_logprobs_and_entropy` of the whole head from this rank's shard of its rows.

    Every rank of ``group`` must call it with the same ``hidden`` and ``labels`` and its own, equally sized,
    shard: rank ``r`` of the group holds vocabulary rows ``[r V_shard, (r+1) V_shard)``.

    Args:
        hidden: last hidden states, the same on every rank of ``group``. Shape: (N, D).
        weight_shard: this rank's rows of the LM-head weight. Shape: (V / TP, D); same dtype as ``hidden``.
        labels: global token ids in ``[0, V)``, or ``ignore_index``. Shape: (N,).
        group: the tensor-parallel process group (default: the whole world).
        bias_shard: this rank's part of the head's bias. Shape: (V / TP,).
        temperature, impl, chunk_size, ignore_index, with_sum_pi_squared: as in the single-device op;
            ``impl`` is ``"auto"``, ``"torch"`` or ``"triton"``.

    Returns:
        ``(logprobs, entropy)`` of the full vocabulary, fp32, the same on every rank. Shape: (N,) each; with
        ``with_sum_pi_squared`` a third, detached (N,) tensor. Differentiable with respect to ``hidden``
        (its gradient summed over the group), ``weight_shard`` and ``bias_shard``.
    """
    if not isinstance(temperature, (int, float)) or not temperature > 0 or temperature == float("inf"):
        raise ValueError(f"temperature must be a finite number > 0; got {temperature!r}")
    if hidden.dim() != 2 or weight_shard.dim() != 2 or hidden.shape[1] != weight_shard.shape[1]:
        raise ValueError(f"hidden must be [N, D] and weight_shard [V/TP, D] with the same D; got "
                         f"{tuple(hidden.shape)} and {tuple(weight_shard.shape)}")
    if labels.shape != (hidden.shape[0],):
        raise ValueError(f"labels must have shape [N] = ({hidden.shape[0]},); got {tuple(labels.shape)}")
    backend, tiling = shard_backend_and_tiling(impl, hidden, weight_shard, chunk_size)
    logprobs, entropy, sum_pi_squared = _VocabParallelLogprobsEntropy.apply(
        hidden, weight_shard, bias_shard, labels, float(temperature), backend, tiling, int(ignore_index),
        bool(with_sum_pi_squared), group)
    return (logprobs, entropy, sum_pi_squared) if with_sum_pi_squared else (logprobs, entropy)


def shard_labels(labels: torch.Tensor, vocab_start: int, shard_size: int, ignore_index: int) -> torch.Tensor:
    """``labels`` as row indices of the shard ``[vocab_start, vocab_start + shard_size)``; -1 where off it or
    ignored (the kernels match no row there)."""
    labels = labels.long()
    local = labels - vocab_start
    return local.masked_fill((local < 0) | (local >= shard_size) | (labels == ignore_index), -1)


def combine_shard_stats(partials, group) -> tuple[torch.Tensor, ...]:
    """Per-shard ``(m, s, w, label logit, q or None)`` -> the whole vocabulary's ``(lse, E_p[z], entropy,
    label logit, sum_v p_v^2 or None)``, by an all-reduce of the max, then one of the sums moved to it."""
    shard_max, shard_sum, shard_wsum, label_logit, shard_sq = partials
    top = shard_max.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    offset = shard_max - top  # <= 0
    scale = offset.exp()
    terms = [shard_sum * scale, (shard_wsum + offset * shard_sum) * scale, label_logit]
    if shard_sq is not None:
        terms.append(shard_sq * scale.square())
    sums = torch.stack(terms)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    lse, expected_logit, entropy = finish_softmax_stats(top, sums[0], sums[1])
    sum_pi_squared = sums[3] / sums[0].square() if shard_sq is not None else None
    return lse, expected_logit, entropy, sums[2], sum_pi_squared


def _check_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    bad = ((labels < 0) | (labels >= vocab_size)) & (labels != ignore_index)
    if bool(bad.any()):
        raise ValueError(f"labels must be token ids in [0, {vocab_size}) (the whole vocabulary over the group) or "
                         f"ignore_index={ignore_index}; got {labels[bad][:5].tolist()}")


class _VocabParallelLogprobsEntropy(torch.autograd.Function):
    """(logprobs, entropy, sum_pi_squared or None) of the whole vocabulary from this rank's rows; the backward
    all-reduces the hidden states' gradient over the group (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight_shard, bias_shard, labels, temperature, backend, tiling, ignore_index,
                with_sum_pi_squared, group):
        shard_size = weight_shard.shape[0]
        group_rank, group_size = dist.get_rank(group), dist.get_world_size(group)
        _check_labels(labels, shard_size * group_size, ignore_index)
        local = shard_labels(labels, group_rank * shard_size, shard_size, ignore_index)
        inv_t = 1.0 / temperature
        partials = shard_softmax_partials(backend, tiling, hidden, weight_shard, bias_shard, local, inv_t,
                                          with_sum_pi_squared=with_sum_pi_squared)
        lse, expected_logit, entropy, label_logit, sum_pi_squared = combine_shard_stats(partials, group)
        ignored = labels == ignore_index
        logprobs = (label_logit - lse).masked_fill_(ignored, 0.0)
        if sum_pi_squared is not None:
            ctx.mark_non_differentiable(sum_pi_squared)
        ctx.save_for_backward(hidden, weight_shard, bias_shard, local, lse, expected_logit, ignored)
        ctx.inv_temperature, ctx.backend, ctx.tiling, ctx.group = inv_t, backend, tiling, group
        ctx.set_materialize_grads(False)
        return logprobs, entropy, sum_pi_squared

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy, _grad_sum_pi_squared):
        hidden, weight_shard, bias_shard, local, lse, expected_logit, ignored = ctx.saved_tensors
        grad_hidden, grad_weight, grad_bias = backward_from_stats(
            ctx.backend, ctx.tiling, hidden, weight_shard, bias_shard, local, lse, expected_logit, grad_logprobs,
            grad_entropy, inv_temperature=ctx.inv_temperature, ignored=ignored, needs=ctx.needs_input_grad[:3])
        if grad_hidden is not None:
            # every rank's hidden is one replicated tensor: its gradient is the sum of the shards' parts
            grad_hidden = grad_hidden.contiguous()
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None
