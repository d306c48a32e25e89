"""Triton kernels for :func:`rltk.kernels.token_logprobs_and_entropy` (``impl="triton"``).

Three kernels, none of which holds more than one ``[BLOCK_N, BLOCK_V]`` tile of
logits (the math is in :mod:`rltk.kernels.logprobs`):

* ``_forward_kernel``: grid ``(token blocks, vocab splits)``. Each program runs
  an online softmax over the vocabulary tiles of its split and writes partial
  statistics (max ``m``, ``s = sum e^(z-m)``, ``w = sum e^(z-m) (z-m)``, the
  label's logit and, only when asked for, ``q = sum e^(2(z-m))`` for
  ``sum_v p_v^2``); :func:`_merge_partials` and :func:`_merge_sum_pi_squared`
  combine the splits, so short batches still fill the GPU.
* ``_grad_hidden_kernel``: grid ``(token blocks, vocab splits)``; recomputes the
  logits of its tiles, turns them into ``d_logits`` and accumulates
  ``d_logits @ W`` for its token rows (one fp32 partial per split, summed after).
* ``_grad_weight_kernel``: grid ``(vocab blocks,)``; recomputes the logits of
  its vocabulary rows against every token tile and accumulates
  ``d_logits^T @ h`` (and the bias gradient).

Every program owns the output rows it writes, so the backward pass needs no
atomics and is deterministic, at the price of recomputing the logits twice
(once per gradient kernel) instead of once.

Tiles are upcast to fp32 before ``tl.dot``. For bf16/fp16 inputs the dot then
runs in TF32, which represents their values exactly, with fp32 accumulation;
fp32 inputs use IEEE fp32 so results match the fp32 reference to ~1e-6
(TF32 would cost ~1e-3 relative on fp32 inputs). Upcasting also avoids
Triton's CPU interpreter, whose bf16 ``tl.dot`` silently returns wrong numbers.

This module imports Triton at import time; :mod:`rltk.kernels.logprobs` only
imports it when the triton backend is chosen. To run the kernels on a CPU for
testing, set ``TRITON_INTERPRET=1`` before Triton is first imported.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Sequence

import torch
import triton
import triton.language as tl

from rltk.kernels.chunks import parse_chunk_size
from rltk.kernels.softmax_stats import finish_softmax_stats


@dataclass(frozen=True)
class TritonConfig:
    """Block sizes and launch parameters of the kernels.

    ``num_splits`` (vocabulary splits of the forward and grad-hidden grids) of
    None picks enough splits to give every streaming multiprocessor about two
    programs. Block sizes must be powers of two, at least 16 (``tl.dot``).
    """

    block_n: int = 64
    block_v: int = 128
    block_d: int = 64
    num_splits: int | None = None
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_n", "block_v", "block_d"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"TritonConfig.{name} must be a power of two >= 16 (tl.dot); got {value!r}")
        if self.num_splits is not None and (not isinstance(self.num_splits, int) or self.num_splits < 1):
            raise ValueError(f"TritonConfig.num_splits must be None or an int >= 1; got {self.num_splits!r}")


def config_for(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int | Sequence[int] | None) -> TritonConfig:
    """The :class:`TritonConfig` the public op uses: ``chunk_size`` sets ``(block_n, block_v)``.

    On a GPU with Hopper-class shared memory (H100: 227 KiB a block) and a hidden size of at least 32,
    128 x 256 x 32 tiles with 3 pipeline stages: on an H100 (bf16, N=16384, D=4096, V=151936) they ran
    forward+backward 1.9x faster than the 64 x 128 x 64 default, which is 1.5x slower than naive
    (``benchmarks/gpu_check.sh``'s sweep; ``docs/benchmarks.md``). Their three fp32 stages need ~144 KiB,
    more than older GPUs give, so those keep the small default.
    """
    if hidden.is_cuda and hidden.shape[1] >= 32 and _shared_memory_per_block(hidden.device) >= 200 * 1024:
        config = TritonConfig(block_n=128, block_v=256, block_d=32, num_warps=8, num_stages=3)
    else:
        config = TritonConfig(block_d=min(64, max(16, triton.next_power_of_2(hidden.shape[1]))))
    if chunk_size is None:
        return config
    block_n, block_v = parse_chunk_size(chunk_size, default_vocab=config.block_v)
    for name, value in (("tokens", block_n), ("vocab", block_v)):
        if value < 16 or value & (value - 1):
            raise ValueError(
                f"chunk_size {chunk_size!r}: with impl='triton' the {name} tile is a block size and must be a "
                f"power of two >= 16; got {value}"
            )
    return replace(config, block_n=block_n, block_v=block_v)


def _shared_memory_per_block(device: torch.device) -> int:
    """The most shared memory (bytes) one block may opt in to on ``device`` (0 where torch does not say)."""
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)


# --------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------


@triton.jit
def _tile_indices(start, BLOCK: tl.constexpr, limit):
    """``(start + [0, BLOCK), which of them are < limit)``: one tile's indices along one axis and their mask."""
    indices = start + tl.arange(0, BLOCK)
    return indices, indices < limit


@triton.jit
def _split_vocab_range(split, tiles_per_split, vocab_size, BLOCK_V: tl.constexpr):
    """``(v_begin, v_end)``: the vocabulary columns of vocab split ``split``."""
    v_begin = split * tiles_per_split * BLOCK_V
    return v_begin, tl.minimum(v_begin + tiles_per_split * BLOCK_V, vocab_size)


@triton.jit
def _load_rows(ptr, rows, row_mask, dims, dim_mask, stride_row, stride_dim):
    """``x[rows][:, dims]`` of a ``[*, D]`` matrix in fp32, 0 where masked. Shape: (len(rows), len(dims)).

    Row offsets are widened to int64 (here and in the kernels): a 256k x 8192
    weight has more elements than int32 can index.
    """
    return tl.load(
        ptr + rows[:, None].to(tl.int64) * stride_row + dims[None, :] * stride_dim,
        mask=row_mask[:, None] & dim_mask[None, :], other=0.0,
    ).to(tl.float32)


@triton.jit
def _logits_tile(
    hidden_ptr, weight_ptr, bias_ptr, rows, cols, row_mask, col_mask, hidden_size,
    stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """z = (h[rows] @ W[cols]^T + b[cols]) / t for one tile, in fp32. Shape: (BLOCK_N, BLOCK_V)."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for d_start in range(0, hidden_size, BLOCK_D):
        dims, dim_mask = _tile_indices(d_start, BLOCK_D, hidden_size)
        h = _load_rows(hidden_ptr, rows, row_mask, dims, dim_mask, stride_hn, stride_hd)  # [BLOCK_N, BLOCK_D]
        # W^T loaded as such (not transposed after the load): the dot reads it in this layout
        w_t = tl.load(
            weight_ptr + cols[None, :].to(tl.int64) * stride_wv + dims[:, None] * stride_wd,
            mask=col_mask[None, :] & dim_mask[:, None], other=0.0,
        ).to(tl.float32)  # [BLOCK_D, BLOCK_V]
        acc = tl.dot(h, w_t, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return acc * inv_temperature


@triton.jit
def _forward_kernel(
    hidden_ptr, weight_ptr, bias_ptr, labels_ptr,
    part_max_ptr, part_sum_ptr, part_wsum_ptr, part_label_ptr, part_sq_ptr,  # [num_splits, N] fp32 each
    num_tokens, vocab_size, hidden_size, tiles_per_split,
    stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature,
    HAS_BIAS: tl.constexpr, WITH_SQ: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online softmax of one token block over one vocab split; writes the split's partial stats
    (and ``q = sum e^(2(z-m))`` when ``WITH_SQ``; ``part_sq_ptr`` is unread otherwise)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows, row_mask = _tile_indices(pid_n * BLOCK_N, BLOCK_N, num_tokens)
    labels = tl.load(labels_ptr + rows, mask=row_mask, other=-1)
    run_max = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    run_wsum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    run_sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    label_logit = tl.zeros((BLOCK_N,), dtype=tl.float32)
    v_begin, v_end = _split_vocab_range(split, tiles_per_split, vocab_size, BLOCK_V)
    for v_start in range(v_begin, v_end, BLOCK_V):
        cols, col_mask = _tile_indices(v_start, BLOCK_V, vocab_size)
        z = _logits_tile(
            hidden_ptr, weight_ptr, bias_ptr, rows, cols, row_mask, col_mask, hidden_size,
            stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature,
            HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D, DOT_PRECISION,
        )
        z = tl.where(col_mask[None, :], z, float("-inf"))
        # Labels outside this tile (or ignored, or past V) match no column.
        label_logit += tl.sum(tl.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
        new_max = tl.maximum(run_max, tl.max(z, axis=1))  # finite: every tile has a valid column
        shifted = z - new_max[:, None]
        e = tl.exp(shifted)
        tile_sum = tl.sum(e, axis=1)
        # e == 0 exactly where shifted is -inf (padding columns); 0 * -inf would be nan.
        tile_wsum = tl.sum(e * tl.where(e > 0.0, shifted, 0.0), axis=1)
        shift = run_max - new_max  # -inf on the first tile, where run_sum is still 0
        scale = tl.exp(shift)
        run_wsum = (run_wsum + tl.where(run_sum > 0.0, shift, 0.0) * run_sum) * scale + tile_wsum
        run_sum = run_sum * scale + tile_sum
        if WITH_SQ:
            # Padding columns have e == 0; on the first tile scale == 0 and run_sq is still 0.
            run_sq = run_sq * (scale * scale) + tl.sum(e * e, axis=1)
        run_max = new_max
    offsets = split * num_tokens + rows
    tl.store(part_max_ptr + offsets, run_max, mask=row_mask)
    tl.store(part_sum_ptr + offsets, run_sum, mask=row_mask)
    tl.store(part_wsum_ptr + offsets, run_wsum, mask=row_mask)
    tl.store(part_label_ptr + offsets, label_logit, mask=row_mask)
    if WITH_SQ:
        tl.store(part_sq_ptr + offsets, run_sq, mask=row_mask)


@triton.jit
def _logit_grad_tile(
    hidden_ptr, weight_ptr, bias_ptr, labels_ptr, lse_ptr, expected_ptr, grad_lp_ptr, grad_ent_ptr,
    rows, cols, row_mask, col_mask, hidden_size, stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature,
    HAS_BIAS: tl.constexpr, HAS_GRAD_LP: tl.constexpr, HAS_GRAD_ENT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """d_logits of one tile, its logits recomputed (see :func:`_dlogits`). Shape: (BLOCK_N, BLOCK_V)."""
    z = _logits_tile(
        hidden_ptr, weight_ptr, bias_ptr, rows, cols, row_mask, col_mask, hidden_size,
        stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature,
        HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D, DOT_PRECISION,
    )
    return _dlogits(z, labels_ptr, lse_ptr, expected_ptr, grad_lp_ptr, grad_ent_ptr, rows, cols, row_mask, col_mask,
                    HAS_GRAD_LP, HAS_GRAD_ENT)


@triton.jit
def _dlogits(
    z, labels_ptr, lse_ptr, expected_ptr, grad_lp_ptr, grad_ent_ptr, rows, cols, row_mask, col_mask,
    HAS_GRAD_LP: tl.constexpr, HAS_GRAD_ENT: tl.constexpr,
):
    """d_logits of the fp32 logit tile ``z``: g_lp (onehot - p) + g_ent p (E_p[z] - z), g's pre-scaled by 1/t.

    Shape: (BLOCK_N, BLOCK_V); zero on padding rows and columns.
    """
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    valid = row_mask[:, None] & col_mask[None, :]
    p = tl.where(valid, tl.exp(z - lse[:, None]), 0.0)
    grad = tl.zeros(z.shape, dtype=tl.float32)
    if HAS_GRAD_ENT:
        g_ent = tl.load(grad_ent_ptr + rows, mask=row_mask, other=0.0)
        expected = tl.load(expected_ptr + rows, mask=row_mask, other=0.0)
        grad += g_ent[:, None] * p * tl.where(valid, expected[:, None] - z, 0.0)
    if HAS_GRAD_LP:
        g_lp = tl.load(grad_lp_ptr + rows, mask=row_mask, other=0.0)
        labels = tl.load(labels_ptr + rows, mask=row_mask, other=-1)
        onehot = tl.where(cols[None, :] == labels[:, None], 1.0, 0.0)
        grad += g_lp[:, None] * (onehot - p)
    return grad


@triton.jit
def _add_product_rows(
    out_ptr, out_rows, out_row_mask, grad_tile, src_ptr, src_rows, src_row_mask, stride_src_row, stride_src_dim,
    hidden_size, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """out[out_rows] += grad_tile @ src[src_rows], hidden chunk by hidden chunk; ``out`` is a contiguous
    ``[*, hidden_size]`` fp32 matrix whose ``out_rows`` only the calling program writes (no atomics)."""
    for d_start in range(0, hidden_size, BLOCK_D):
        dims, dim_mask = _tile_indices(d_start, BLOCK_D, hidden_size)
        src = _load_rows(src_ptr, src_rows, src_row_mask, dims, dim_mask, stride_src_row, stride_src_dim)
        out = out_ptr + out_rows[:, None].to(tl.int64) * hidden_size + dims[None, :]
        out_mask = out_row_mask[:, None] & dim_mask[None, :]
        acc = tl.load(out, mask=out_mask, other=0.0)
        acc = tl.dot(grad_tile, src, acc, input_precision=DOT_PRECISION)
        tl.store(out, acc, mask=out_mask)


@triton.jit
def _grad_hidden_kernel(
    hidden_ptr, weight_ptr, bias_ptr, labels_ptr, lse_ptr, expected_ptr, grad_lp_ptr, grad_ent_ptr,
    grad_hidden_ptr,  # [num_splits, N, D] fp32, zero-initialised
    num_tokens, vocab_size, hidden_size, tiles_per_split,
    stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature,
    HAS_BIAS: tl.constexpr, HAS_GRAD_LP: tl.constexpr, HAS_GRAD_ENT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """grad_hidden[rows] (this split's partial) = sum over the split's vocab tiles of d_logits @ W."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows, row_mask = _tile_indices(pid_n * BLOCK_N, BLOCK_N, num_tokens)
    out_ptr = grad_hidden_ptr + split.to(tl.int64) * num_tokens * hidden_size
    v_begin, v_end = _split_vocab_range(split, tiles_per_split, vocab_size, BLOCK_V)
    for v_start in range(v_begin, v_end, BLOCK_V):
        cols, col_mask = _tile_indices(v_start, BLOCK_V, vocab_size)
        grad_z = _logit_grad_tile(
            hidden_ptr, weight_ptr, bias_ptr, labels_ptr, lse_ptr, expected_ptr, grad_lp_ptr, grad_ent_ptr,
            rows, cols, row_mask, col_mask, hidden_size, stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature,
            HAS_BIAS, HAS_GRAD_LP, HAS_GRAD_ENT, BLOCK_N, BLOCK_V, BLOCK_D, DOT_PRECISION,
        )
        _add_product_rows(out_ptr, rows, row_mask, grad_z, weight_ptr, cols, col_mask, stride_wv, stride_wd,
                          hidden_size, BLOCK_D, DOT_PRECISION)


@triton.jit
def _grad_weight_kernel(
    hidden_ptr, weight_ptr, bias_ptr, labels_ptr, lse_ptr, expected_ptr, grad_lp_ptr, grad_ent_ptr,
    grad_weight_ptr, grad_bias_ptr,  # [V, D] and [V] fp32, zero-initialised
    num_tokens, vocab_size, hidden_size,
    stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature,
    HAS_BIAS: tl.constexpr, HAS_GRAD_LP: tl.constexpr, HAS_GRAD_ENT: tl.constexpr,
    NEED_WEIGHT: tl.constexpr, NEED_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """grad_weight[cols] = sum over all token tiles of d_logits^T @ h; grad_bias[cols] = column sums."""
    pid_v = tl.program_id(0)
    cols, col_mask = _tile_indices(pid_v * BLOCK_V, BLOCK_V, vocab_size)
    bias_acc = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for n_start in range(0, num_tokens, BLOCK_N):
        rows, row_mask = _tile_indices(n_start, BLOCK_N, num_tokens)
        grad_z = _logit_grad_tile(
            hidden_ptr, weight_ptr, bias_ptr, labels_ptr, lse_ptr, expected_ptr, grad_lp_ptr, grad_ent_ptr,
            rows, cols, row_mask, col_mask, hidden_size, stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature,
            HAS_BIAS, HAS_GRAD_LP, HAS_GRAD_ENT, BLOCK_N, BLOCK_V, BLOCK_D, DOT_PRECISION,
        )
        if NEED_BIAS:
            bias_acc += tl.sum(grad_z, axis=0)
        if NEED_WEIGHT:
            _add_product_rows(grad_weight_ptr, cols, col_mask, tl.trans(grad_z), hidden_ptr, rows, row_mask,
                              stride_hn, stride_hd, hidden_size, BLOCK_D, DOT_PRECISION)
    if NEED_BIAS:
        tl.store(grad_bias_ptr + cols, bias_acc, mask=col_mask)


# --------------------------------------------------------------------------
# Host side: launches and the merge of partial statistics
# --------------------------------------------------------------------------


def _dot_precision(dtype: torch.dtype) -> str:
    # bf16/fp16 values are exact in TF32, so tensor cores lose nothing there.
    return "ieee" if dtype == torch.float32 else "tf32"


def _splits(config: TritonConfig, num_tokens: int, vocab_size: int, device: torch.device) -> tuple[int, int]:
    """``(num_splits, tiles_per_split)`` with every split owning at least one vocab tile."""
    num_tiles = triton.cdiv(vocab_size, config.block_v)
    wanted = config.num_splits
    if wanted is None:
        programs = 2 * (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1)
        wanted = triton.cdiv(programs, max(1, triton.cdiv(num_tokens, config.block_n)))
    tiles_per_split = triton.cdiv(num_tiles, max(1, min(wanted, num_tiles)))
    return triton.cdiv(num_tiles, tiles_per_split), tiles_per_split


def _merge_partials(part_max, part_sum, part_wsum, part_label):
    """Combine per-split online-softmax stats ``[S, N]`` into per-token ``(lse, E_p[z], entropy, label logit)``
    (:func:`reduce_splits`, then ``lse = M + log s``, ``E_p[z] = M + w / s`` and entropy ``= log s - w / s``)."""
    top, total_sum, total_wsum, _ = reduce_splits(part_max, part_sum, part_wsum)
    lse, expected_logit, entropy = finish_softmax_stats(top, total_sum, total_wsum)
    return lse, expected_logit, entropy, part_label.sum(dim=0)


def reduce_splits(part_max, part_sum, part_wsum, part_sq=None):
    """Per-split online-softmax stats ``[S, N]`` moved to their common max: per-token ``(M, s, w, q or None)``.

    With ``M = max_k m_k`` and ``c_k = e^(m_k - M)``: ``s = sum_k s_k c_k``,
    ``w = sum_k (w_k + (m_k - M) s_k) c_k`` and ``q = sum_k q_k c_k^2`` (each ``q_k`` sums ``e^(2(z - m_k))``).
    """
    top = part_max.amax(dim=0)  # [N]
    offset = part_max - top  # [S, N], <= 0
    scale = offset.exp()
    total_sum = (part_sum * scale).sum(dim=0)
    total_wsum = ((part_wsum + offset * part_sum) * scale).sum(dim=0)
    total_sq = None if part_sq is None else (part_sq * scale.square()).sum(dim=0)
    return top, total_sum, total_wsum, total_sq


def _merge_sum_pi_squared(part_max, part_sum, part_sq):
    """``sum_v p_v^2`` per token from per-split ``[S, N]`` stats: ``q / s^2`` at the common max."""
    _, total_sum, _, total_sq = reduce_splits(part_max, part_sum, part_sum, part_sq)
    return total_sq / total_sum.square()


def _device_guard(tensor: torch.Tensor):
    # Launch on the tensors' GPU, not the current one.
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def triton_forward(hidden, weight, bias, labels, inv_temperature, config: TritonConfig, ignore_index, *,
                   with_sum_pi_squared=False):
    """Forward launch: ``(logprobs, entropy, lse, E_p[z], sum_v p_v^2)``, fp32. Shape: (N,) each; the last is
    None unless ``with_sum_pi_squared``."""
    device = hidden.device
    if hidden.shape[0] == 0:
        empty = torch.empty(0, dtype=torch.float32, device=device)
        return empty, empty.clone(), empty.clone(), empty.clone(), (empty.clone() if with_sum_pi_squared else None)
    partials = _split_partials(hidden, weight, bias, labels, inv_temperature, config, with_sum_pi_squared)
    lse, expected_logit, entropy, label_logit = _merge_partials(*partials[:4])
    logprobs = (label_logit - lse).masked_fill_(labels == ignore_index, 0.0)
    sum_pi_squared = _merge_sum_pi_squared(partials[0], partials[1], partials[4]) if with_sum_pi_squared else None
    return logprobs, entropy, lse, expected_logit, sum_pi_squared


def triton_partials(hidden, weight, bias, labels, inv_temperature, config: TritonConfig, *,
                    with_sum_pi_squared=False):
    """Online-softmax stats of each token over the rows of ``weight`` (one shard of a vocabulary):
    ``(m, s, w, label logit, q or None)`` as in :func:`rltk.kernels.logprobs._torch_partials`, the kernel's
    vocab splits already reduced (:func:`reduce_splits`). fp32, shape (N,) each."""
    if hidden.shape[0] == 0:
        empty = torch.empty(0, dtype=torch.float32, device=hidden.device)
        return empty, empty.clone(), empty.clone(), empty.clone(), (empty.clone() if with_sum_pi_squared else None)
    partials = _split_partials(hidden, weight, bias, labels, inv_temperature, config, with_sum_pi_squared)
    top, total_sum, total_wsum, total_sq = reduce_splits(partials[0], partials[1], partials[2],
                                                         partials[4] if with_sum_pi_squared else None)
    return top, total_sum, total_wsum, partials[3].sum(dim=0), total_sq


def _split_partials(hidden, weight, bias, labels, inv_temperature, config, with_sum_pi_squared) -> torch.Tensor:
    """The forward kernel's per-split stats ``(m, s, w, label logit[, q])``. Shape: (4 or 5, S, N)."""
    num_tokens, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    device = hidden.device
    num_splits, tiles_per_split = _splits(config, num_tokens, vocab_size, device)
    partials = torch.empty(5 if with_sum_pi_squared else 4, num_splits, num_tokens, dtype=torch.float32,
                           device=device)
    labels = labels.contiguous()
    grid = (triton.cdiv(num_tokens, config.block_n), num_splits)
    with _device_guard(hidden):
        _forward_kernel[grid](
            hidden, weight, bias if bias is not None else weight, labels,
            partials[0], partials[1], partials[2], partials[3], partials[-1],
            num_tokens, vocab_size, hidden_size, tiles_per_split,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), inv_temperature,
            HAS_BIAS=bias is not None, WITH_SQ=with_sum_pi_squared, BLOCK_N=config.block_n,
            BLOCK_V=config.block_v, BLOCK_D=config.block_d, DOT_PRECISION=_dot_precision(hidden.dtype),
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return partials


def triton_backward(hidden, weight, bias, labels, lse, expected_logit, grad_lp, grad_ent, inv_temperature,
                    config: TritonConfig, *, need_hidden, need_weight, need_bias):
    """Backward launches: fp32 ``(grad_hidden [N, D], grad_weight [V, D], grad_bias [V])``, None where not needed.

    ``grad_lp`` / ``grad_ent`` are per-token upstream gradients already scaled by
    1/t (``grad_lp`` zero at ignored labels), or None.
    """
    num_tokens, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    device = hidden.device
    grad_hidden = grad_weight = grad_bias = None
    if num_tokens == 0:
        return (
            torch.zeros(0, hidden_size, dtype=torch.float32, device=device) if need_hidden else None,
            torch.zeros(vocab_size, hidden_size, dtype=torch.float32, device=device) if need_weight else None,
            torch.zeros(vocab_size, dtype=torch.float32, device=device) if need_bias else None,
        )
    labels = labels.contiguous()
    lse, expected_logit = lse.contiguous(), expected_logit.contiguous()
    # Kernels take a pointer for every argument; the flags keep unused ones unread.
    grad_lp_arg = grad_lp.contiguous() if grad_lp is not None else lse
    grad_ent_arg = grad_ent.contiguous() if grad_ent is not None else lse
    bias_arg = bias if bias is not None else weight
    common = dict(
        HAS_BIAS=bias is not None, HAS_GRAD_LP=grad_lp is not None, HAS_GRAD_ENT=grad_ent is not None,
        BLOCK_N=config.block_n, BLOCK_V=config.block_v, BLOCK_D=config.block_d,
        DOT_PRECISION=_dot_precision(hidden.dtype), num_warps=config.num_warps, num_stages=config.num_stages,
    )
    strides = (hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), inv_temperature)
    with _device_guard(hidden):
        if need_hidden:
            num_splits, tiles_per_split = _splits(config, num_tokens, vocab_size, device)
            partial = torch.zeros(num_splits, num_tokens, hidden_size, dtype=torch.float32, device=device)
            _grad_hidden_kernel[(triton.cdiv(num_tokens, config.block_n), num_splits)](
                hidden, weight, bias_arg, labels, lse, expected_logit, grad_lp_arg, grad_ent_arg, partial,
                num_tokens, vocab_size, hidden_size, tiles_per_split, *strides, **common,
            )
            grad_hidden = partial[0] if num_splits == 1 else partial.sum(dim=0)
        if need_weight or need_bias:
            if need_weight:
                grad_weight = torch.zeros(vocab_size, hidden_size, dtype=torch.float32, device=device)
            if need_bias:
                grad_bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            _grad_weight_kernel[(triton.cdiv(vocab_size, config.block_v),)](
                hidden, weight, bias_arg, labels, lse, expected_logit, grad_lp_arg, grad_ent_arg,
                grad_weight if need_weight else grad_bias, grad_bias if need_bias else grad_weight,
                num_tokens, vocab_size, hidden_size, *strides,
                NEED_WEIGHT=need_weight, NEED_BIAS=need_bias, **common,
            )
    return grad_hidden, grad_weight, grad_bias
