"""Triton kernels rebuilt for Hopper (``impl="triton-hopper"``; opt-in, NOT YET MEASURED on a GPU).

The same op as :mod:`rltk.kernels.triton_logprobs` (math in :mod:`rltk.kernels.logprobs`), with the three
changes issue 59 asks for. Until a GPU has timed them, ``impl="auto"`` and ``impl="triton"`` keep the shipped
kernels; ``benchmarks/gpu_check.sh`` (part ``peers``) puts both side by side with verl, CCE and Liger.

* **Dots in the input dtype.** Tiles of bf16/fp16 inputs go to ``tl.dot`` as they are (tensor cores,
  fp32 accumulation). fp32 inputs use ``tf32x3`` on a GPU (three TF32 tensor-core dots, about fp32's
  accuracy): Triton's IEEE fp32 dot, compiled for sm_90 at these tiles, needed 6-20 KB of stack per thread
  and up to 4 minutes of compile. Only under Triton's CPU interpreter are bf16 tiles upcast to fp32 first,
  since its bf16 ``tl.dot`` returns wrong numbers; fp16 runs as on a GPU there, fp32 as IEEE.
* **One backward kernel.** Grid: one program per ``[BLOCK_N, BLOCK_V]`` logit tile. Each recomputes its
  logits once, turns them into d-logits once, and adds both products, ``d_logits @ W[cols]`` into
  d-hidden and ``d_logits^T @ h[rows]`` into d-weight, with fp32 atomics (the old backward recomputed every
  tile twice, once per gradient). The d-logits enter those dots in the input dtype; for bf16 that
  rounding alone costs ~1.6e-3 relative error on the gradients (a CPU simulation at 1024 x 896 x 32768),
  too much for the 2e-3 bar once the result is rounded to bf16 too, so by default they are split into
  ``hi + lo`` (two dots each, ~16 significant bits: ``HopperConfig.split_dlogits``). fp16 d-logits of a
  tile are scaled by a power of two first so that tiny probabilities do not flush to zero.
  Atomics make the sum order vary from run to run: with ``torch.use_deterministic_algorithms(True)`` (or
  ``HopperConfig(deterministic=True)``) the backward instead runs two kernels whose programs own the rows
  they write (d-hidden per token block and vocab split, d-weight per vocab block), as the old one did.
* **Tiles and launch order for Hopper.** Programs walk the tiles in grouped order (``group_size`` token
  blocks share each vocab range in turn, so its weight rows stay in L2); block shapes, warps and stages
  come from a per-process autotune over :data:`CANDIDATES` (verl's 128 x 256 x 32, 3 stages, 8 warps
  among them), keyed on (token-count bucket, H, V, dtype, kernel flags); hidden and weight are read
  through TMA tensor descriptors where this Triton has them, the device is Hopper or newer and the
  strides allow it (:func:`tma_usable`), with pointer loads otherwise.

Memory: the forward holds per-token statistics; the atomic backward holds fp32 d-hidden ``[N, D]`` and
d-weight ``[V, D]`` accumulators (the old backward's ``[splits, N, D]`` partials are gone).

Imports Triton at import time; set ``TRITON_INTERPRET=1`` before that to run the kernels on a CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
import triton
import triton.language as tl

from rltk.kernels.chunks import parse_chunk_size
from rltk.kernels.triton_logprobs import (
    _device_guard,
    _dlogits,
    _merge_partials,
    _merge_sum_pi_squared,
    _split_vocab_range,
    _splits,
    _tile_indices,
)

try:  # host-side TMA descriptors: Triton >= 3.3 (the lent GPU image has 3.6)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    TensorDescriptor = None


@dataclass(frozen=True)
class HopperConfig:
    """One launch configuration of the Hopper kernels.

    ``group_size``: token blocks that walk the vocabulary together (grouped order). ``num_splits``:
    vocabulary splits of the forward grid and the deterministic d-hidden grid (None: about two programs
    per SM). ``split_dlogits``: half-precision d-logits as ``hi + lo`` (two dots each; see the module).
    ``use_tma``: None uses TMA descriptors where :func:`tma_usable`, False never.
    """

    block_n: int = 128
    block_v: int = 256
    block_d: int = 32
    num_warps: int = 8
    num_stages: int = 3
    group_size: int = 8
    num_splits: int | None = None
    split_dlogits: bool = True
    deterministic: bool = False
    use_tma: bool | None = None

    def __post_init__(self):
        for name in ("block_n", "block_v", "block_d"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"HopperConfig.{name} must be a power of two >= 16 (tl.dot); got {value!r}")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"HopperConfig.group_size must be an int >= 1; got {self.group_size!r}")
        if self.num_splits is not None and (not isinstance(self.num_splits, int) or self.num_splits < 1):
            raise ValueError(f"HopperConfig.num_splits must be None or an int >= 1; got {self.num_splits!r}")


# The autotune's list (Hopper: 227 KiB of shared memory a block). The first is verl's (its fused entropy
# kernel, PR #4576). Compiled for sm_90 without a GPU (Triton 3.9, bf16, TMA; registers / spill stack /
# shared memory of forward; backward): 128x256x32 255/0/72K; 255/192/184K. 128x256x64 and 256x128x64:
# 255/0/144K; backward over 227K (the autotune skips them there: forward only). 128x128x64, 4 stages:
# 160/0/128K; 248/0/160K, and 3 stages 166/0/96K; 252/0/144K. 128x128x32, 4 stages: 160/0/64K; 255/8/112K.
# (64x256x64 with 4 warps spilled 1.3 KB in the backward and was dropped.)
CANDIDATES = (
    HopperConfig(block_n=128, block_v=256, block_d=32, num_warps=8, num_stages=3),
    HopperConfig(block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=3),
    HopperConfig(block_n=256, block_v=128, block_d=64, num_warps=8, num_stages=3),
    HopperConfig(block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=4),
    HopperConfig(block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=3),
    HopperConfig(block_n=128, block_v=128, block_d=32, num_warps=8, num_stages=4),
)


def plan_for(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int | Sequence[int] | None
             ) -> tuple[HopperConfig, ...]:
    """The candidate configs the public op tries: all of :data:`CANDIDATES` (tuned on the first call per
    shape key), or the one ``chunk_size`` fixes as ``(block_n, block_v)``. Deterministic when torch is
    (``torch.use_deterministic_algorithms``)."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    candidates = tuple(replace(c, deterministic=deterministic) for c in CANDIDATES)
    if chunk_size is None:
        return candidates
    block_n, block_v = parse_chunk_size(chunk_size, default_vocab=candidates[0].block_v)
    for name, value in (("tokens", block_n), ("vocab", block_v)):
        if value < 16 or value & (value - 1):
            raise ValueError(
                f"chunk_size {chunk_size!r}: with impl='triton-hopper' the {name} tile is a block size and must "
                f"be a power of two >= 16; got {value}"
            )
    return (replace(candidates[0], block_n=block_n, block_v=block_v),)


def tma_usable(tensor: torch.Tensor, config: HopperConfig) -> bool:
    """Whether ``tensor`` ([*, D]) can be read through a TMA descriptor with ``config``'s blocks: this Triton
    has descriptors, the device is Hopper (sm_90) or newer, or the interpreter runs; the last dim is
    contiguous, the other stride and the base 16-byte aligned (TMA's rules)."""
    if config.use_tma is False or TensorDescriptor is None:
        return False
    if tensor.is_cuda:
        if torch.cuda.get_device_capability(tensor.device)[0] < 9:
            return False
    elif os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return False
    size = tensor.element_size()
    return (tensor.stride(1) == 1 and (tensor.stride(0) * size) % 16 == 0 and tensor.data_ptr() % 16 == 0
            and tensor.shape[1] * size >= 16)


# --------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------


@triton.jit
def _grouped_tile(pid, num_row_blocks, num_col_blocks, GROUP: tl.constexpr):
    """(row block, col block) of program ``pid`` in grouped order: ``GROUP`` row blocks take each col block
    in turn, so consecutive programs share a col block (its weight rows stay in L2)."""
    in_group = GROUP * num_col_blocks
    first_row = (pid // in_group) * GROUP
    group_rows = tl.minimum(num_row_blocks - first_row, GROUP)
    local = pid % in_group
    return first_row + local % group_rows, local // group_rows


@triton.jit
def _load_block(ptr, desc, start, row_limit, d_start, hidden_size, stride_row, stride_dim,
                BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr):
    """``x[start : start + BLOCK, d_start : d_start + BLOCK_D]`` of a ``[*, D]`` matrix in its dtype (fp32 when
    ``UPCAST``), 0 outside it: through the TMA descriptor ``desc`` or masked pointer loads. Shape: (BLOCK, BLOCK_D)."""
    if USE_TMA:
        block = desc.load([start, d_start])
    else:
        rows, row_mask = _tile_indices(start, BLOCK, row_limit)
        dims, dim_mask = _tile_indices(d_start, BLOCK_D, hidden_size)
        # int64 row offsets: a 256k x 8192 weight has more elements than int32 can index
        block = tl.load(ptr + rows[:, None].to(tl.int64) * stride_row + dims[None, :] * stride_dim,
                        mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if UPCAST:
        block = block.to(tl.float32)
    return block


@triton.jit
def _logits(hidden_ptr, weight_ptr, h_desc, w_desc, bias_ptr, row0, col0, num_tokens, vocab_size, hidden_size,
            stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature,
            HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
            USE_TMA: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """z = (h[rows] @ W[cols]^T + b[cols]) / t, dots in the input dtype, fp32 result. Shape: (BLOCK_N, BLOCK_V)."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for d_start in range(0, hidden_size, BLOCK_D):
        h = _load_block(hidden_ptr, h_desc, row0, num_tokens, d_start, hidden_size, stride_hn, stride_hd,
                        BLOCK_N, BLOCK_D, USE_TMA, UPCAST)
        w = _load_block(weight_ptr, w_desc, col0, vocab_size, d_start, hidden_size, stride_wv, stride_wd,
                        BLOCK_V, BLOCK_D, USE_TMA, UPCAST)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        cols, col_mask = _tile_indices(col0, BLOCK_V, vocab_size)
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return acc * inv_temperature


@triton.jit
def _forward_kernel(
    hidden_ptr, weight_ptr, h_desc, w_desc, bias_ptr, labels_ptr,
    part_max_ptr, part_sum_ptr, part_wsum_ptr, part_label_ptr, part_sq_ptr,  # [num_splits, N] fp32 each
    num_tokens, vocab_size, hidden_size, num_splits, tiles_per_split,
    stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature,
    HAS_BIAS: tl.constexpr, WITH_SQ: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr, GROUP: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax of one token block over one vocab split (1-D grid in grouped order); writes the split's
    partial stats as :func:`rltk.kernels.triton_logprobs._forward_kernel` does."""
    pid_n, split = _grouped_tile(tl.program_id(0), tl.cdiv(num_tokens, BLOCK_N), num_splits, GROUP)
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
        z = _logits(hidden_ptr, weight_ptr, h_desc, w_desc, bias_ptr, pid_n * BLOCK_N, v_start, num_tokens,
                    vocab_size, hidden_size, stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature,
                    HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D, USE_TMA, UPCAST, DOT_PRECISION)
        z = tl.where(col_mask[None, :], z, float("-inf"))
        label_logit += tl.sum(tl.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
        new_max = tl.maximum(run_max, tl.max(z, axis=1))
        shifted = z - new_max[:, None]
        e = tl.exp(shifted)
        tile_sum = tl.sum(e, axis=1)
        tile_wsum = tl.sum(e * tl.where(e > 0.0, shifted, 0.0), axis=1)  # 0 * -inf would be nan
        shift = run_max - new_max
        scale = tl.exp(shift)
        run_wsum = (run_wsum + tl.where(run_sum > 0.0, shift, 0.0) * run_sum) * scale + tile_wsum
        run_sum = run_sum * scale + tile_sum
        if WITH_SQ:
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
def _dot_operands(dz, DOT_DTYPE: tl.constexpr, SPLIT: tl.constexpr, SCALE_FP16: tl.constexpr):
    """``(hi, lo, unscale)``: the fp32 d-logits tile as dot operands, ``dz ~ (hi + lo) * unscale``.

    ``lo`` is the rounding error of ``hi`` (used only when ``SPLIT``). For fp16 the tile is first scaled by
    a power of two that puts its largest entry near 2^14: without it probabilities times small upstream
    gradients (token-mean losses give ~1/N) fall below fp16's normal range and flush to zero.
    """
    unscale = 1.0
    if SCALE_FP16:
        top = tl.max(tl.max(tl.abs(dz), axis=1), axis=0)
        exponent = tl.where(top > 0.0, tl.floor(tl.log2(tl.maximum(top, 1e-30))), 0.0)
        dz = dz * tl.exp2(14.0 - exponent)
        unscale = tl.exp2(exponent - 14.0)
    hi = dz.to(DOT_DTYPE)
    lo = hi
    if SPLIT:
        lo = (dz - hi.to(tl.float32)).to(DOT_DTYPE)
    return hi, lo, unscale


@triton.jit
def _add_products(out_ptr, out_start, out_limit, hi, lo, unscale, src_ptr, src_desc, src_start, src_limit,
                  hidden_size, stride_src_row, stride_src_dim,
                  BLOCK_OUT: tl.constexpr, BLOCK_SRC: tl.constexpr, BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr,
                  UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr, ATOMIC: tl.constexpr):
    """out[out rows] += (hi + lo) @ src[src rows] * unscale, hidden chunk by hidden chunk, into the contiguous
    fp32 ``[*, D]`` matrix ``out``: by fp32 atomics (``ATOMIC``), or a plain read-add-write where the calling
    program owns those rows."""
    out_rows, out_row_mask = _tile_indices(out_start, BLOCK_OUT, out_limit)
    for d_start in range(0, hidden_size, BLOCK_D):
        src = _load_block(src_ptr, src_desc, src_start, src_limit, d_start, hidden_size, stride_src_row,
                          stride_src_dim, BLOCK_SRC, BLOCK_D, USE_TMA, UPCAST)
        product = tl.dot(hi, src, input_precision=DOT_PRECISION)
        if SPLIT:
            product = tl.dot(lo, src, product, input_precision=DOT_PRECISION)
        dims, dim_mask = _tile_indices(d_start, BLOCK_D, hidden_size)
        out = out_ptr + out_rows[:, None].to(tl.int64) * hidden_size + dims[None, :]
        out_mask = out_row_mask[:, None] & dim_mask[None, :]
        if ATOMIC:
            tl.atomic_add(out, product * unscale, mask=out_mask, sem="relaxed")
        else:
            tl.store(out, tl.load(out, mask=out_mask, other=0.0) + product * unscale, mask=out_mask)


@triton.jit
def _tile_dlogits(
    hidden_ptr, weight_ptr, h_desc, w_desc, bias_ptr, labels_ptr, lse_ptr, expected_ptr, grad_lp_ptr, grad_ent_ptr,
    row0, col0, num_tokens, vocab_size, hidden_size, stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature,
    HAS_BIAS: tl.constexpr, HAS_GRAD_LP: tl.constexpr, HAS_GRAD_ENT: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """fp32 d-logits of the tile at (row0, col0), its logits recomputed once. Shape: (BLOCK_N, BLOCK_V)."""
    z = _logits(hidden_ptr, weight_ptr, h_desc, w_desc, bias_ptr, row0, col0, num_tokens, vocab_size, hidden_size,
                stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature,
                HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D, USE_TMA, UPCAST, DOT_PRECISION)
    rows, row_mask = _tile_indices(row0, BLOCK_N, num_tokens)
    cols, col_mask = _tile_indices(col0, BLOCK_V, vocab_size)
    return _dlogits(z, labels_ptr, lse_ptr, expected_ptr, grad_lp_ptr, grad_ent_ptr, rows, cols, row_mask, col_mask,
                    HAS_GRAD_LP, HAS_GRAD_ENT)


@triton.jit
def _backward_kernel(
    hidden_ptr, weight_ptr, h_desc, w_desc, bias_ptr, labels_ptr, lse_ptr, expected_ptr, grad_lp_ptr, grad_ent_ptr,
    grad_hidden_ptr, grad_weight_ptr, grad_bias_ptr,  # [N, D], [V, D], [V] fp32, zero-initialised
    num_tokens, vocab_size, hidden_size, num_row_blocks, num_col_blocks, tile_offset,
    stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature,
    HAS_BIAS: tl.constexpr, HAS_GRAD_LP: tl.constexpr, HAS_GRAD_ENT: tl.constexpr, NEED_HIDDEN: tl.constexpr,
    NEED_WEIGHT: tl.constexpr, NEED_BIAS: tl.constexpr, ATOMIC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
    USE_TMA: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
    SPLIT: tl.constexpr, SCALE_FP16: tl.constexpr,
):
    """The backward of one logit tile (atomic mode) or of one owned stripe of tiles (deterministic mode).

    Atomic (``ATOMIC``): a 1-D grid over all tiles in grouped order; each program computes its tile's
    d-logits once and adds both gradient products (and the bias's column sums) with fp32 atomics.
    Deterministic: launched twice. With ``NEED_HIDDEN`` the grid is (token block, vocab split) in grouped
    order, ``num_col_blocks`` the split count and ``tile_offset`` the tiles per split; the program walks its
    split's tiles and writes its rows of its split's partial (``grad_hidden_ptr`` is ``[splits, N, D]``).
    With ``NEED_WEIGHT``/``NEED_BIAS`` the grid is the vocab blocks; each walks every token block.
    """
    pid = tl.program_id(0)
    if ATOMIC:
        pid_n, pid_v = _grouped_tile(pid, num_row_blocks, num_col_blocks, GROUP)
        first_n, end_n, first_v, end_v = pid_n, pid_n + 1, pid_v, pid_v + 1
    elif NEED_HIDDEN:
        pid_n, split = _grouped_tile(pid, num_row_blocks, num_col_blocks, GROUP)
        first_n, end_n = pid_n, pid_n + 1
        first_v = split * tile_offset
        end_v = tl.minimum(first_v + tile_offset, tl.cdiv(vocab_size, BLOCK_V))
        grad_hidden_ptr += split.to(tl.int64) * num_tokens * hidden_size
    else:
        first_n, end_n, first_v, end_v = 0, num_row_blocks, pid, pid + 1
    bias_acc = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for block_v in range(first_v, end_v):
        for block_n in range(first_n, end_n):
            row0, col0 = block_n * BLOCK_N, block_v * BLOCK_V
            dz = _tile_dlogits(
                hidden_ptr, weight_ptr, h_desc, w_desc, bias_ptr, labels_ptr, lse_ptr, expected_ptr, grad_lp_ptr,
                grad_ent_ptr, row0, col0, num_tokens, vocab_size, hidden_size,
                stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature, HAS_BIAS, HAS_GRAD_LP, HAS_GRAD_ENT,
                BLOCK_N, BLOCK_V, BLOCK_D, USE_TMA, UPCAST, DOT_PRECISION,
            )
            if NEED_BIAS:
                bias_acc += tl.sum(dz, axis=0)
            if NEED_HIDDEN or NEED_WEIGHT:
                hi, lo, unscale = _dot_operands(dz, DOT_DTYPE, SPLIT, SCALE_FP16)
                if NEED_HIDDEN:
                    _add_products(grad_hidden_ptr, row0, num_tokens, hi, lo, unscale, weight_ptr, w_desc, col0,
                                  vocab_size, hidden_size, stride_wv, stride_wd, BLOCK_N, BLOCK_V, BLOCK_D,
                                  USE_TMA, UPCAST, DOT_PRECISION, SPLIT, ATOMIC)
                if NEED_WEIGHT:
                    _add_products(grad_weight_ptr, col0, vocab_size, tl.trans(hi), tl.trans(lo), unscale,
                                  hidden_ptr, h_desc, row0, num_tokens, hidden_size, stride_hn, stride_hd,
                                  BLOCK_V, BLOCK_N, BLOCK_D, USE_TMA, UPCAST, DOT_PRECISION, SPLIT, ATOMIC)
    if NEED_BIAS:
        cols, col_mask = _tile_indices(first_v * BLOCK_V, BLOCK_V, vocab_size)
        if ATOMIC:
            tl.atomic_add(grad_bias_ptr + cols, bias_acc, mask=col_mask, sem="relaxed")
        else:
            tl.store(grad_bias_ptr + cols, bias_acc, mask=col_mask)


# --------------------------------------------------------------------------
# Host side: dtypes, descriptors, the per-process autotune, launches
# --------------------------------------------------------------------------


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _dot_flags(dtype: torch.dtype, config: HopperConfig) -> dict:
    """The dtype constexprs: where tiles are upcast (bf16 in the interpreter only), what the d-logits are cast to
    for their dots, whether they are split in two and scaled (fp16)."""
    upcast = dtype == torch.bfloat16 and _interpreted()
    half = dtype != torch.float32 and not upcast
    dot_dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype] if half else tl.float32
    fp32_precision = "ieee" if _interpreted() else "tf32x3"
    return dict(UPCAST=upcast, DOT_PRECISION="tf32" if half else fp32_precision, DOT_DTYPE=dot_dtype,
                SPLIT=half and config.split_dlogits, SCALE_FP16=dtype == torch.float16 and half)


def _descriptors(hidden, weight, config: HopperConfig):
    """``(h_desc, w_desc, use_tma)``: TMA descriptors for both operands, or the tensors themselves (unread)."""
    if tma_usable(hidden, config) and tma_usable(weight, config):
        return (TensorDescriptor.from_tensor(hidden, [config.block_n, config.block_d]),
                TensorDescriptor.from_tensor(weight, [config.block_v, config.block_d]), True)
    return hidden, weight, False


def tune_key(kind: str, hidden: torch.Tensor, weight: torch.Tensor, flags: tuple) -> tuple:
    """The autotune's cache key: (kernel kind, token-count bucket (next power of two), H, V, dtype, flags)."""
    return (kind, triton.next_power_of_2(max(1, hidden.shape[0])), hidden.shape[1], weight.shape[0],
            str(hidden.dtype), flags)


_TUNED: dict[tuple, HopperConfig] = {}


def tuned_configs() -> dict[tuple, HopperConfig]:
    """What the autotune chose in this process so far: ``{tune_key(...): config}``."""
    return dict(_TUNED)


def pick_config(key: tuple, candidates: Sequence[HopperConfig], launch: Callable[[HopperConfig], object],
                timer: Callable[[Callable[[], object]], float] | None = None) -> HopperConfig:
    """The fastest of ``candidates`` for ``key``, timed once per process and cached (``_TUNED``).

    ``launch(config)`` runs the kernel with ``config`` on scratch outputs. With one candidate, or off a GPU (the
    interpreter: timing there says nothing), the first candidate is returned untimed. A candidate that fails to
    compile or launch (too much shared memory on this GPU) is skipped. ``timer`` defaults to
    ``triton.testing.do_bench`` (ms).
    """
    if len(candidates) == 1:
        return candidates[0]
    if key in _TUNED:
        return _TUNED[key]
    if timer is None:
        if not torch.cuda.is_available() or _interpreted():
            return candidates[0]
        from triton.testing import do_bench

        timer = lambda fn: do_bench(fn, warmup=5, rep=20)  # noqa: E731
    times = {}
    for config in candidates:
        try:
            times[config] = timer(lambda: launch(config))
        except Exception:  # noqa: BLE001 - an unusable candidate (out of resources) is simply not chosen
            continue
    if not times:
        raise RuntimeError(f"no Hopper kernel config could run for {key}; tried {list(candidates)}")
    _TUNED[key] = best = min(times, key=times.get)
    return best


def _forward_launch(hidden, weight, bias, labels, inv_temperature, with_sq, partials_for):
    """``launch(config)`` for the forward kernel: allocates the partials for ``config`` (``partials_for``)."""
    num_tokens, hidden_size = hidden.shape
    vocab_size = weight.shape[0]

    def launch(config: HopperConfig):
        num_splits, tiles_per_split = _splits(config, num_tokens, vocab_size, hidden.device)
        partials = partials_for(num_splits)
        h_desc, w_desc, use_tma = _descriptors(hidden, weight, config)
        grid = (triton.cdiv(num_tokens, config.block_n) * num_splits,)
        _forward_kernel[grid](
            hidden, weight, h_desc, w_desc, bias if bias is not None else weight, labels,
            partials[0], partials[1], partials[2], partials[3], partials[-1],
            num_tokens, vocab_size, hidden_size, num_splits, tiles_per_split,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), inv_temperature,
            HAS_BIAS=bias is not None, WITH_SQ=with_sq, BLOCK_N=config.block_n, BLOCK_V=config.block_v,
            BLOCK_D=config.block_d, GROUP=config.group_size, USE_TMA=use_tma,
            **{k: v for k, v in _dot_flags(hidden.dtype, config).items() if k in ("UPCAST", "DOT_PRECISION")},
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        return partials

    return launch


def hopper_forward(hidden, weight, bias, labels, inv_temperature, configs: Sequence[HopperConfig], ignore_index, *,
                   with_sum_pi_squared=False):
    """Forward: ``(logprobs, entropy, lse, E_p[z], sum_v p_v^2 or None)``, fp32, (N,) each (as
    :func:`rltk.kernels.triton_logprobs.triton_forward`); ``configs`` are the autotune's candidates."""
    num_tokens = hidden.shape[0]
    device = hidden.device
    if num_tokens == 0:
        empty = torch.empty(0, dtype=torch.float32, device=device)
        return empty, empty.clone(), empty.clone(), empty.clone(), (empty.clone() if with_sum_pi_squared else None)
    labels = labels.contiguous()
    rows = 5 if with_sum_pi_squared else 4

    def partials_for(num_splits):
        return torch.empty(rows, num_splits, num_tokens, dtype=torch.float32, device=device)

    launch = _forward_launch(hidden, weight, bias, labels, inv_temperature, with_sum_pi_squared, partials_for)
    key = tune_key("forward", hidden, weight, (bias is not None, with_sum_pi_squared))
    with _device_guard(hidden):
        partials = launch(pick_config(key, configs, launch))
    lse, expected_logit, entropy, label_logit = _merge_partials(*partials[:4])
    logprobs = (label_logit - lse).masked_fill_(labels == ignore_index, 0.0)
    sum_pi_squared = _merge_sum_pi_squared(partials[0], partials[1], partials[4]) if with_sum_pi_squared else None
    return logprobs, entropy, lse, expected_logit, sum_pi_squared


def hopper_backward(hidden, weight, bias, labels, lse, expected_logit, grad_lp, grad_ent, inv_temperature,
                    configs: Sequence[HopperConfig], *, need_hidden, need_weight, need_bias):
    """Backward: fp32 ``(grad_hidden [N, D], grad_weight [V, D], grad_bias [V])``, None where not needed (as
    :func:`rltk.kernels.triton_logprobs.triton_backward`): one atomic kernel, or two owning kernels when the
    configs are deterministic."""
    num_tokens, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    device = hidden.device

    def zeros(*shape, needed=True):
        return torch.zeros(*shape, dtype=torch.float32, device=device) if needed else None

    if num_tokens == 0:
        return (zeros(0, hidden_size, needed=need_hidden), zeros(vocab_size, hidden_size, needed=need_weight),
                zeros(vocab_size, needed=need_bias))
    args = _BackwardArgs(hidden, weight, bias, labels.contiguous(), lse.contiguous(), expected_logit.contiguous(),
                         grad_lp, grad_ent, inv_temperature)
    flags = (bias is not None, grad_lp is not None, grad_ent is not None, need_hidden, need_weight, need_bias)
    def atomic(config):
        outputs = (zeros(num_tokens, hidden_size, needed=need_hidden),
                   zeros(vocab_size, hidden_size, needed=need_weight), zeros(vocab_size, needed=need_bias))
        args.launch(config, outputs, flags, atomic=True)
        return outputs

    def deterministic(config):
        return args.deterministic(config, flags)

    kind, launch = ("backward-deterministic", deterministic) if configs[0].deterministic else ("backward", atomic)
    with _device_guard(hidden):
        return launch(pick_config(tune_key(kind, hidden, weight, flags), configs, launch))


@dataclass
class _BackwardArgs:
    """The backward's inputs, and its launches (atomic, or the two deterministic ones)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    labels: torch.Tensor
    lse: torch.Tensor
    expected_logit: torch.Tensor
    grad_lp: torch.Tensor | None
    grad_ent: torch.Tensor | None
    inv_temperature: float

    def launch(self, config, outputs, flags, *, atomic, grid=None, num_col_blocks=None, tile_offset=0):
        """One launch of :func:`_backward_kernel`; ``outputs`` (hidden, weight, bias) None where not written."""
        has_bias, has_lp, has_ent, need_hidden, need_weight, need_bias = flags
        hidden, weight = self.hidden, self.weight
        num_tokens, hidden_size = hidden.shape
        vocab_size = weight.shape[0]
        row_blocks, col_blocks = triton.cdiv(num_tokens, config.block_n), triton.cdiv(vocab_size, config.block_v)
        h_desc, w_desc, use_tma = _descriptors(hidden, weight, config)
        # Kernels take a pointer for every argument; the flags keep unused ones unread.
        placeholder = self.lse
        grad_hidden, grad_weight, grad_bias = (placeholder if t is None else t for t in outputs)
        _backward_kernel[grid or (row_blocks * col_blocks,)](
            hidden, weight, h_desc, w_desc, self.bias if has_bias else weight, self.labels, self.lse,
            self.expected_logit, self.grad_lp if has_lp else placeholder, self.grad_ent if has_ent else placeholder,
            grad_hidden, grad_weight, grad_bias,
            num_tokens, vocab_size, hidden_size, row_blocks, num_col_blocks or col_blocks, tile_offset,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), self.inv_temperature,
            HAS_BIAS=has_bias, HAS_GRAD_LP=has_lp, HAS_GRAD_ENT=has_ent, NEED_HIDDEN=need_hidden,
            NEED_WEIGHT=need_weight, NEED_BIAS=need_bias, ATOMIC=atomic, BLOCK_N=config.block_n,
            BLOCK_V=config.block_v, BLOCK_D=config.block_d, GROUP=config.group_size, USE_TMA=use_tma,
            **_dot_flags(hidden.dtype, config), num_warps=config.num_warps, num_stages=config.num_stages,
        )

    def deterministic(self, config, flags):
        """Two launches whose programs own what they write: d-hidden per (token block, vocab split) into
        ``[splits, N, D]`` partials summed in a fixed order, then d-weight and d-bias per vocab block."""
        has_bias, has_lp, has_ent, need_hidden, need_weight, need_bias = flags
        num_tokens, hidden_size = self.hidden.shape
        vocab_size = self.weight.shape[0]
        device = self.hidden.device
        grad_hidden = grad_weight = grad_bias = None
        if need_hidden:
            num_splits, tiles_per_split = _splits(config, num_tokens, vocab_size, device)
            partial = torch.zeros(num_splits, num_tokens, hidden_size, dtype=torch.float32, device=device)
            grid = (triton.cdiv(num_tokens, config.block_n) * num_splits,)
            self.launch(config, (partial, None, None), (has_bias, has_lp, has_ent, True, False, False),
                        atomic=False, grid=grid, num_col_blocks=num_splits, tile_offset=tiles_per_split)
            grad_hidden = partial[0] if num_splits == 1 else partial.sum(dim=0)
        if need_weight or need_bias:
            grad_weight = torch.zeros(vocab_size, hidden_size, dtype=torch.float32, device=device) if need_weight \
                else None
            grad_bias = torch.zeros(vocab_size, dtype=torch.float32, device=device) if need_bias else None
            self.launch(config, (None, grad_weight, grad_bias), (has_bias, has_lp, has_ent, False, need_weight,
                                                                 need_bias),
                        atomic=False, grid=(triton.cdiv(vocab_size, config.block_v),))
        return grad_hidden, grad_weight, grad_bias
