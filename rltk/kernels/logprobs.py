"""Per-token log-probabilities and entropy straight from hidden states and the LM head.

The usual way to get the log-probability of each sampled token materialises
the logits ``[N, V]`` (tokens times vocabulary), their log-softmax, the
softmax and their product for the entropy: at N = 8192 and V = 152k that is
about 5 GB per copy in fp32, and it is the memory peak of every RL step.
:func:`token_logprobs_and_entropy` computes both quantities from ``hidden``
and the LM-head ``weight`` while holding at most one tile of logits at a time.

Math (one token; ``z = (h W^T + b) / t`` are its logits at temperature ``t``)::

    lse      = log sum_v exp(z_v)                 (online: running max m,
    p_v      = exp(z_v - lse)                      s = sum exp(z - m),
    logprob  = z_label - lse                       w = sum exp(z - m) (z - m))
    entropy  = lse - E_p[z] = log s - w / s

On request (``with_sum_pi_squared``) the same pass also sums ``q = sum exp(2 (z - m))``,
one more running accumulator, and returns ``sum_v p_v^2 = q / s^2`` (the collision
probability, which the optimal-token-baseline estimator weights tokens by); in log
space that is ``exp(logsumexp(2 z) - 2 lse)``, and with every ``exp(z - m) <= 1`` and
``s >= 1`` no term can overflow. It is a detached statistic: no gradient flows through it.

and the gradients, with ``g_lp`` and ``g_ent`` the upstream gradients::

    dL/dz_v  = g_lp (1[v = label] - p_v) + g_ent p_v (E_p[z] - z_v)
    dL/d(hW^T + b) = dL/dz / t

The forward pass keeps, per token, only ``lse`` and ``E_p[z]``; the backward
pass recomputes each tile of logits from them (the recomputation trick of
FlashAttention, Dao et al. 2022, https://arxiv.org/abs/2205.14135, applied to
the LM head as in Cut Cross-Entropy, Wijmans et al. 2024,
https://arxiv.org/abs/2411.09009). The online softmax is Milakov & Gimelshein
2018, https://arxiv.org/abs/1805.02867.

Backends (``impl``):

* ``"triton"``: fused GPU kernels (:mod:`rltk.kernels.triton_logprobs`).
* ``"triton-hopper"``: the kernels rebuilt for Hopper (:mod:`rltk.kernels.triton_hopper`: dots in the
  input dtype, one backward kernel, autotuned tiles); opt-in, not yet measured on a GPU.
* ``"torch"``: tiles of ``chunk_size`` tokens by vocabulary, pre-allocated
  buffers, ``torch.mm(out=...)`` and in-place ops; the CPU path and the
  fallback where Triton is missing.
* ``"naive"``: full logits and ``log_softmax``; the reference the others are
  tested against, and the right choice when memory is no concern.
* ``"auto"``: ``"triton"`` for CUDA tensors when Triton imports, else ``"torch"``.

For a head split by vocabulary rows over ranks, :func:`shard_softmax_partials` gives one shard's online-softmax
statistics (torch or Triton) and :func:`backward_from_stats` its part of the backward from the whole
vocabulary's ``lse`` and ``E_p[z]``; ``rltk.models.parallel.vocab_parallel`` combines them across ranks.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache
from typing import Sequence

import torch

from rltk.kernels.chunks import parse_chunk_size
from rltk.kernels.softmax_stats import finish_softmax_stats

IMPLS = ("auto", "triton", "triton-hopper", "torch", "naive")
TRITON_IMPLS = ("triton", "triton-hopper")
IGNORE_INDEX = -100

# Elements in one tile of logits for the torch backend. Two tiles of fp32 are
# live at a time (logits and exp), so the default costs 2 * 2**25 * 4 B = 256 MiB
# whatever N and V are; on the benchmark shape a 1024 x 32000 tile runs within a
# few percent of the bare matmul, while tiles of a few hundred rows lose time
# to the re-read of the weight for every chunk.
DEFAULT_TILE_ELEMENTS = 2**25
DEFAULT_MAX_VOCAB_CHUNK = 32768

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def token_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    impl: str = "auto",
    chunk_size: int | Sequence[int] | None = None,
    ignore_index: int = IGNORE_INDEX,
    with_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Log-probability of ``labels`` and entropy of the softmax of ``(hidden @ weight.T + bias) / temperature``.

    Never holds the ``[N, V]`` logits (except with ``impl="naive"``): the
    forward pass runs an online softmax over vocabulary tiles and saves only
    two fp32 numbers per token; the backward pass recomputes the logits tile by
    tile. See the module docstring for the formulas.

    Args:
        hidden: last hidden states. Shape: (N, D); fp32, bf16 or fp16.
        weight: LM-head weight (the embedding matrix when tied). Shape: (V, D);
            same dtype as ``hidden``.
        labels: token ids to score. Shape: (N,); integer. Positions equal to
            ``ignore_index`` get log-prob 0 and send no gradient through it;
            their entropy is still computed (and differentiable), so mask it
            yourself if those positions must not count.
        bias: optional LM-head bias. Shape: (V,).
        temperature: logits are divided by it before the softmax (> 0); the
            sampling temperature of the rollout, so that log-probs match it.
        impl: ``"auto"``, ``"triton"``, ``"triton-hopper"``, ``"torch"`` or ``"naive"`` (see module).
        chunk_size: tile size: tokens per tile, or ``(tokens, vocab)``. For the
            torch backend the default keeps a tile at about 2**25 logits
            (1048 x 32000 at V = 32000) and vocab tiles at most 32768 wide, so
            memory does not grow with V. For Triton both numbers must be powers
            of two (block sizes); the default is tuned for GPUs. Ignored by naive.
        ignore_index: label value that marks positions without a target.
        with_sum_pi_squared: also return ``sum_v p_v^2`` of each token's
            softmax, computed in the same pass (one more running sum; nothing is
            computed when False).

    Returns:
        ``(logprobs, entropy)``, both fp32. Shape: (N,) each. Differentiable
        with respect to ``hidden``, ``weight`` and ``bias`` (gradients come back
        in their dtypes); the upstream gradients of both outputs are used.
        With ``with_sum_pi_squared`` a third fp32 tensor ``sum_pi_squared``
        (N,) follows, in (0, 1], without gradient (also at ignored labels).

    Raises:
        ValueError: bad shapes, dtypes, devices, temperature, labels, impl or
            chunk size; the message names the argument and what is valid.
    """
    backend = _checked_backend(impl, hidden, weight, labels, bias, temperature, ignore_index)
    if backend == "naive":
        return naive_token_logprobs_and_entropy(
            hidden, weight, labels, bias=bias, temperature=temperature, ignore_index=ignore_index,
            with_sum_pi_squared=with_sum_pi_squared,
        )
    if backend == "torch":
        tiling = torch_tiling(hidden.shape[0], weight.shape[0], chunk_size)
    elif backend == "triton-hopper":
        from rltk.kernels import triton_hopper

        tiling = triton_hopper.plan_for(hidden, weight, chunk_size)
    else:
        from rltk.kernels import triton_logprobs

        tiling = triton_logprobs.config_for(hidden, weight, chunk_size)
    return _apply_op(hidden, weight, bias, labels, temperature, backend, tiling, ignore_index, with_sum_pi_squared)


def _apply_op(hidden, weight, bias, labels, temperature, backend, tiling, ignore_index,
              with_sum_pi_squared) -> tuple[torch.Tensor, ...]:
    """Run the autograd op of the torch or triton ``backend``: 2 outputs, or 3 with ``with_sum_pi_squared``."""
    logprobs, entropy, sum_pi_squared = _TokenLogprobsEntropy.apply(
        hidden, weight, bias, labels, float(temperature), backend, tiling, int(ignore_index),
        bool(with_sum_pi_squared),
    )
    return (logprobs, entropy, sum_pi_squared) if with_sum_pi_squared else (logprobs, entropy)


# --------------------------------------------------------------------------
# Dispatch and argument checks
# --------------------------------------------------------------------------


def triton_token_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    config=None,
    ignore_index: int = IGNORE_INDEX,
    with_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, ...]:
    """:func:`token_logprobs_and_entropy` on a Triton backend with an explicit ``config``:
    a :class:`rltk.kernels.triton_logprobs.TritonConfig` (``impl="triton"``) or a
    :class:`rltk.kernels.triton_hopper.HopperConfig` (``impl="triton-hopper"``, no autotune).

    For tuning and tests (every block size and split count); the public op is
    the normal entry point. Shapes as there: hidden (N, D), weight (V, D),
    labels (N,) -> logprobs (N,), entropy (N,) (and sum_pi_squared (N,) with
    ``with_sum_pi_squared``).
    """
    _checked_backend("triton", hidden, weight, labels, bias, temperature, ignore_index)
    from rltk.kernels import triton_hopper, triton_logprobs

    if isinstance(config, triton_hopper.HopperConfig):
        return _apply_op(hidden, weight, bias, labels, temperature, "triton-hopper", (config,), ignore_index,
                         with_sum_pi_squared)
    config = config or triton_logprobs.config_for(hidden, weight, None)
    return _apply_op(hidden, weight, bias, labels, temperature, "triton", config, ignore_index, with_sum_pi_squared)


#: backends of the vocabulary-shard entry points (:func:`shard_backend_and_tiling`); the Hopper kernels
#: merge their splits inside their own forward and have no shard form yet
SHARD_IMPLS = ("auto", "triton", "torch")


def shard_backend_and_tiling(impl: str, hidden: torch.Tensor, weight_shard: torch.Tensor,
                             chunk_size: int | Sequence[int] | None):
    """``(backend, tiling)`` for :func:`shard_softmax_partials` and :func:`backward_from_stats` on one shard
    of the head's rows ``weight_shard`` (V/TP, D); ValueError for an ``impl`` without a shard form."""
    if impl not in SHARD_IMPLS:
        raise ValueError(f"impl={impl!r} has no vocabulary-shard form; valid: {', '.join(map(repr, SHARD_IMPLS))}")
    backend = resolve_impl(impl, hidden)
    if backend == "torch":
        return backend, torch_tiling(hidden.shape[0], weight_shard.shape[0], chunk_size)
    from rltk.kernels import triton_logprobs

    return backend, triton_logprobs.config_for(hidden, weight_shard, chunk_size)


def shard_softmax_partials(backend, tiling, hidden, weight_shard, bias_shard, shard_labels, inv_temperature, *,
                           with_sum_pi_squared=False) -> tuple[torch.Tensor | None, ...]:
    """Online-softmax stats of each token over one shard of the vocabulary, for a combine across shards:
    ``(m, s, w, label logit, q or None)`` with ``s = sum e^(z-m)``, ``w = sum e^(z-m) (z-m)`` and
    ``q = sum e^(2(z-m))`` over the shard's logits ``z = (h W_shard^T + b_shard) / t``. ``shard_labels`` index
    the shard's rows; a label outside them (-1) gives a label logit of 0. fp32, shape (N,) each."""
    with _fp32_math(hidden):
        if backend == "torch":
            return _torch_partials(hidden, weight_shard, bias_shard, shard_labels, inv_temperature, tiling,
                                   with_sum_pi_squared=with_sum_pi_squared)
        from rltk.kernels import triton_logprobs

        return triton_logprobs.triton_partials(hidden, weight_shard, bias_shard, shard_labels, inv_temperature,
                                               tiling, with_sum_pi_squared=with_sum_pi_squared)


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether ``import triton`` works in this process."""
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install is as unusable as a missing one
        return False
    return True


def triton_interpreter_enabled() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``).

    Triton reads the variable when it is imported, so this only tells the truth
    if nothing changed it since.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_impl(impl: str, hidden: torch.Tensor) -> str:
    """The concrete backend (``"triton"``, ``"triton-hopper"``, ``"torch"`` or ``"naive"``) ``impl`` means for ``hidden``.

    Raises ValueError for an unknown name and RuntimeError when ``"triton"`` is
    asked for but cannot run here.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not a logprob backend; valid: {', '.join(map(repr, IMPLS))}")
    if impl == "auto":
        return "triton" if hidden.is_cuda and triton_available() else "torch"
    if impl in TRITON_IMPLS:
        if not triton_available():
            raise RuntimeError(
                f"impl={impl!r} but `import triton` fails in this environment; install it "
                "(pip install 'rltk[triton]') or use impl='torch'."
            )
        if not hidden.is_cuda and not triton_interpreter_enabled():
            raise RuntimeError(
                f"impl={impl!r} needs CUDA tensors, got tensors on '{hidden.device}'. Use impl='torch' "
                "on CPU, or set TRITON_INTERPRET=1 before triton is imported to run the kernels in "
                "Triton's (very slow) CPU interpreter for testing."
            )
    return impl


def _checked_backend(impl, hidden, weight, labels, bias, temperature, ignore_index) -> str:
    """The input check of every public entry point, in the order its errors are raised: shapes, dtypes,
    devices and temperature, then the backend ``impl`` resolves to here (returned), then the label range."""
    _check_inputs(hidden, weight, labels, bias, temperature)
    backend = resolve_impl(impl, hidden)
    _check_label_range(labels, weight.shape[0], ignore_index)
    return backend


def _check_inputs(hidden, weight, labels, bias, temperature) -> None:
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be [N, D] and weight [V, D]; got hidden {tuple(hidden.shape)} and weight "
            f"{tuple(weight.shape)}. Flatten batch and time first: hidden.reshape(-1, D)."
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden size mismatch: hidden is {tuple(hidden.shape)} and weight {tuple(weight.shape)}; "
            "both need the same D (hidden [N, D], weight [V, D])."
        )
    if labels.shape != (hidden.shape[0],):
        raise ValueError(f"labels must have shape [N] = ({hidden.shape[0]},); got {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must hold integer token ids; got dtype {labels.dtype}")
    if hidden.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"hidden dtype {hidden.dtype} is not supported; valid: float32, bfloat16, float16")
    if weight.dtype != hidden.dtype:
        raise ValueError(
            f"hidden is {hidden.dtype} but weight is {weight.dtype}; cast one so they match "
            "(the op upcasts to fp32 inside)."
        )
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape [V] = ({weight.shape[0]},); got {tuple(bias.shape)}")
        if bias.device != weight.device:
            raise ValueError(f"bias is on {bias.device} but weight on {weight.device}; move them together")
    for name, t in (("weight", weight), ("labels", labels)):
        if t.device != hidden.device:
            raise ValueError(f"hidden is on {hidden.device} but {name} on {t.device}; move them together")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0; got {temperature!r}")
    if weight.shape[0] == 0:
        raise ValueError("weight has V = 0 rows: a softmax over an empty vocabulary is undefined")


def _check_label_range(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    # One host sync per call; worth it, since an out-of-range id would otherwise
    # read past the weight in a kernel or give a silently wrong log-prob.
    if labels.numel() == 0:
        return
    bad = ((labels < 0) | (labels >= vocab_size)) & (labels != ignore_index)
    if bool(bad.any()):
        first = int(labels[bad][0])
        raise ValueError(
            f"labels contain id {first} outside the vocabulary [0, {vocab_size}) "
            f"({int(bad.sum())} such positions); use ignore_index={ignore_index} for positions without "
            "a target, or check that weight is the LM head of the model that produced the tokens."
        )


def torch_tiling(num_tokens: int, vocab_size: int, chunk_size: int | Sequence[int] | None) -> tuple[int, int]:
    """``(token_chunk, vocab_chunk)`` the torch backend uses for ``chunk_size`` (see the op)."""
    if chunk_size is None:
        vocab_chunk = min(vocab_size, DEFAULT_MAX_VOCAB_CHUNK)
        token_chunk = max(16, DEFAULT_TILE_ELEMENTS // vocab_chunk)
    else:
        token_chunk, vocab_chunk = parse_chunk_size(chunk_size, default_vocab=vocab_size)
    return max(1, min(token_chunk, num_tokens)), min(vocab_chunk, vocab_size)


# --------------------------------------------------------------------------
# The reference: full logits
# --------------------------------------------------------------------------


def naive_token_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    with_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Reference implementation through the full fp32 logits (plain autograd).

    Same contract as :func:`token_logprobs_and_entropy`; costs several ``[N, V]``
    fp32 tensors. Inputs are upcast to fp32 before the matmul, as in the fused
    backends, so all backends compute the same function of the given values.
    ``sum_pi_squared`` is ``exp(logsumexp(2 z) - 2 logsumexp(z))`` (z shifted by its max), detached.
    """
    with _fp32_math(hidden):
        logits = hidden.float() @ weight.float().T  # [N, V]
        if bias is not None:
            logits = logits + bias.float()
        logits = logits / temperature
        log_probs = torch.log_softmax(logits, dim=-1)  # [N, V]
        ignored = labels == ignore_index
        safe_labels = labels.masked_fill(ignored, 0).long()
        token_logprobs = log_probs.gather(1, safe_labels[:, None]).squeeze(1).masked_fill(ignored, 0.0)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        if with_sum_pi_squared:
            # log sum_v p_v^2 = logsumexp(2 z) - 2 logsumexp(z), with z shifted by its max first: the
            # difference of two numbers near 2 max(z) would lose the digits that matter in fp32
            shifted = logits.detach() - logits.detach().amax(dim=-1, keepdim=True)
            sum_pi_squared = torch.exp(torch.logsumexp(2.0 * shifted, dim=-1) - 2.0 * torch.logsumexp(shifted, dim=-1))
            return token_logprobs, entropy, sum_pi_squared
    return token_logprobs, entropy


def _fp32_math(tensor: torch.Tensor):
    """Autocast off: the op's matmuls must stay fp32 even inside a caller's bf16 autocast region."""
    return torch.autocast(device_type=tensor.device.type, enabled=False)


# --------------------------------------------------------------------------
# The autograd op shared by the torch and triton backends
# --------------------------------------------------------------------------


class _TokenLogprobsEntropy(torch.autograd.Function):
    """(logprobs, entropy, sum_pi_squared or None) with a backward that recomputes logits from per-token
    (lse, E_p[z]); sum_pi_squared is non-differentiable."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, backend, tiling, ignore_index, with_sum_pi_squared):
        forward_fn, _ = _backend_fns(backend)
        with _fp32_math(hidden):
            logprobs, entropy, lse, expected_logit, sum_pi_squared = forward_fn(
                hidden, weight, bias, labels, 1.0 / temperature, tiling, ignore_index,
                with_sum_pi_squared=with_sum_pi_squared,
            )
        if sum_pi_squared is not None:
            ctx.mark_non_differentiable(sum_pi_squared)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, expected_logit)
        ctx.inv_temperature = 1.0 / temperature
        ctx.backend, ctx.tiling, ctx.ignore_index = backend, tiling, ignore_index
        # None for an output nobody differentiates, so backward skips its terms.
        ctx.set_materialize_grads(False)
        return logprobs, entropy, sum_pi_squared

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy, _grad_sum_pi_squared):
        hidden, weight, bias, labels, lse, expected_logit = ctx.saved_tensors
        grads = backward_from_stats(
            ctx.backend, ctx.tiling, hidden, weight, bias, labels, lse, expected_logit, grad_logprobs, grad_entropy,
            inv_temperature=ctx.inv_temperature, ignored=labels == ctx.ignore_index, needs=ctx.needs_input_grad[:3])
        return (*grads, None, None, None, None, None, None)


def backward_from_stats(backend, tiling, hidden, weight, bias, labels, lse, expected_logit, grad_logprobs,
                        grad_entropy, *, inv_temperature, ignored, needs):
    """Gradients ``(hidden, weight, bias)`` of the op (each None where not needed or not reached, in the
    inputs' dtypes) from the saved per-token ``lse`` and ``E_p[z]``, the logits recomputed tile by tile.

    ``labels`` index the rows of ``weight`` (a label outside them, e.g. -1, adds no one-hot term), ``ignored``
    marks the tokens whose log-prob sends no gradient, and ``needs`` is ``needs_input_grad`` of
    (hidden, weight, bias). Shared by the single-device op and the vocabulary-parallel one, where ``lse`` and
    ``E_p[z]`` are those of the whole vocabulary and ``weight`` one shard of its rows.
    """
    if grad_logprobs is None and grad_entropy is None:
        return None, None, None
    needs_hidden, needs_weight, needs_bias = needs
    # Fold 1/t and the ignore mask into per-token scales once, so the tiles
    # produce the gradient with respect to the raw logits h W^T + b.
    grad_lp = None
    if grad_logprobs is not None:
        grad_lp = (grad_logprobs.float() * inv_temperature).masked_fill_(ignored, 0.0)
    grad_ent = None if grad_entropy is None else grad_entropy.float() * inv_temperature
    _, backward_fn = _backend_fns(backend)
    with _fp32_math(hidden):
        grad_hidden, grad_weight, grad_bias = backward_fn(
            hidden, weight, bias, labels, lse, expected_logit, grad_lp, grad_ent, inv_temperature, tiling,
            need_hidden=needs_hidden, need_weight=needs_weight, need_bias=bias is not None and needs_bias,
        )
    return (
        None if grad_hidden is None else grad_hidden.to(hidden.dtype),
        None if grad_weight is None else grad_weight.to(weight.dtype),
        None if grad_bias is None else grad_bias.to(bias.dtype),
    )


def _backend_fns(backend: str):
    if backend == "torch":
        return _torch_forward, _torch_backward
    if backend == "triton-hopper":
        from rltk.kernels import triton_hopper

        return triton_hopper.hopper_forward, triton_hopper.hopper_backward
    from rltk.kernels import triton_logprobs

    return triton_logprobs.triton_forward, triton_logprobs.triton_backward


# --------------------------------------------------------------------------
# Torch backend: tiles, pre-allocated buffers, in-place ops
# --------------------------------------------------------------------------


class _Tiles:
    """Reusable fp32 buffers for one call, and the fp32 view of each vocab tile of the weight.

    Tiles narrower than the buffer are carved from the front of its flat storage,
    so every tile is contiguous (``torch.mm(out=...)`` writes in place only then).
    """

    def __init__(self, weight, bias, token_chunk, vocab_chunk, inv_temperature, n_buffers):
        self.weight, self.bias = weight, bias
        self.vocab_size, self.vocab_chunk = weight.shape[0], vocab_chunk
        self.inv_t = inv_temperature
        device = weight.device
        self.buffers = [
            torch.empty(token_chunk * vocab_chunk, dtype=torch.float32, device=device) for _ in range(n_buffers)
        ]
        self.single_tile = vocab_chunk >= self.vocab_size
        # Half-precision weights are upcast per tile (a [vocab_chunk, D] fp32 copy),
        # or once when one tile covers the vocabulary.
        self.weight_fp32 = None
        if weight.dtype != torch.float32:
            self.weight_fp32 = (
                weight.float() if self.single_tile
                else torch.empty(vocab_chunk, weight.shape[1], dtype=torch.float32, device=device)
            )
        self.scaled_bias = None if bias is None else bias.float() * inv_temperature

    def ranges(self):
        for start in range(0, self.vocab_size, self.vocab_chunk):
            yield start, min(self.vocab_chunk, self.vocab_size - start)

    def weight_tile(self, start: int, width: int) -> torch.Tensor:
        """Rows ``start : start + width`` of the weight in fp32. Shape: (width, D)."""
        if self.weight_fp32 is None:
            return self.weight[start : start + width]
        if self.single_tile:
            return self.weight_fp32
        tile = self.weight_fp32[:width]
        tile.copy_(self.weight[start : start + width])
        return tile

    def buffer(self, index: int, rows: int, width: int) -> torch.Tensor:
        return self.buffers[index][: rows * width].view(rows, width)

    def logits(self, scaled_hidden, w_tile, start, width, out) -> torch.Tensor:
        """``out = scaled_hidden @ w_tile.T + bias[start:start+width] / t``: a tile of z. Shape: (n, width)."""
        if self.scaled_bias is None:
            return torch.mm(scaled_hidden, w_tile.T, out=out)
        return torch.addmm(self.scaled_bias[start : start + width], scaled_hidden, w_tile.T, out=out)


def _hidden_chunk(hidden, start, rows, inv_t):
    """``(h, h / t)`` for rows ``start : start + rows`` in fp32 (the second is ``h`` itself when t = 1)."""
    h = hidden[start : start + rows].float()
    return h, (h if inv_t == 1.0 else h * inv_t)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(1)`` without the ``[n, V]`` temporary (a batched 1 x V by V x 1 product)."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _torch_forward(hidden, weight, bias, labels, inv_temperature, tiling, ignore_index, *,
                   with_sum_pi_squared=False):
    """Chunked forward: per-token log-prob, entropy, lse, E_p[z] and sum_v p_v^2 (None unless
    ``with_sum_pi_squared``), all fp32. Shape: (N,) each."""
    run_max, run_sum, run_wsum, label_logit, run_sq = _torch_partials(
        hidden, weight, bias, labels, inv_temperature, tiling, with_sum_pi_squared=with_sum_pi_squared)
    lse, expected_logit, entropy = finish_softmax_stats(run_max, run_sum, run_wsum)
    logprobs = (label_logit - lse).masked_fill_(labels == ignore_index, 0.0)
    sum_pi_squared = run_sq / run_sum.square() if with_sum_pi_squared else None  # q / s^2 at the common max
    return logprobs, entropy, lse, expected_logit, sum_pi_squared


def _torch_partials(hidden, weight, bias, labels, inv_temperature, tiling, *, with_sum_pi_squared=False):
    """Online-softmax stats of each token over the vocabulary rows of ``weight``: ``(m, s, w, label logit,
    q or None)`` with ``s = sum e^(z-m)``, ``w = sum e^(z-m)(z-m)``, ``q = sum e^(2(z-m))``; the label logit
    is 0 where the label is not one of these rows. fp32, shape (N,) each."""
    num_tokens = hidden.shape[0]
    token_chunk, vocab_chunk = tiling
    device = hidden.device
    stats = torch.empty(5 if with_sum_pi_squared else 4, num_tokens, dtype=torch.float32, device=device)
    tiles = _Tiles(weight, bias, token_chunk, vocab_chunk, inv_temperature, n_buffers=2)
    labels = labels.long()
    for row in range(0, num_tokens, token_chunk):
        rows = min(token_chunk, num_tokens - row)
        _, scaled_h = _hidden_chunk(hidden, row, rows, inv_temperature)
        chunk_labels = labels[row : row + rows]
        label_logit = torch.zeros(rows, dtype=torch.float32, device=device)
        # online stats: m, s = sum e^(z-m), w = sum e^(z-m)(z-m), q = sum e^(2(z-m)) (on request)
        run_max = run_sum = run_wsum = run_sq = None
        for start, width in tiles.ranges():
            z = tiles.logits(scaled_h, tiles.weight_tile(start, width), start, width,
                             out=tiles.buffer(0, rows, width))  # [n, v]
            in_tile = (chunk_labels >= start) & (chunk_labels < start + width)
            picked = z.gather(1, (chunk_labels - start).clamp_(0, width - 1)[:, None]).squeeze(1)
            label_logit = torch.where(in_tile, picked, label_logit)
            tile_max = z.amax(dim=1)
            new_max = tile_max if run_max is None else torch.maximum(run_max, tile_max)
            z.sub_(new_max[:, None])  # z - m: every exp below is <= 1
            e = torch.exp(z, out=tiles.buffer(1, rows, width))
            tile_sum, tile_wsum = e.sum(dim=1), _row_dot(e, z)
            tile_sq = _row_dot(e, e) if with_sum_pi_squared else None
            if run_max is None:
                run_max, run_sum, run_wsum, run_sq = new_max, tile_sum, tile_wsum, tile_sq
            else:
                # Move the old stats to the new max: w' = (w + (m - m') s) e^(m - m'), q' = q e^(2(m - m')).
                shift = run_max - new_max
                scale = shift.exp()
                run_wsum = (run_wsum + shift * run_sum) * scale + tile_wsum
                run_sum = run_sum * scale + tile_sum
                if with_sum_pi_squared:
                    run_sq = run_sq * scale.square() + tile_sq
                run_max = new_max
        chunk = stats[:, row : row + rows]
        chunk[0], chunk[1], chunk[2], chunk[3] = run_max, run_sum, run_wsum, label_logit
        if with_sum_pi_squared:
            chunk[4] = run_sq
    return stats[0], stats[1], stats[2], stats[3], (stats[4] if with_sum_pi_squared else None)


def _torch_backward(hidden, weight, bias, labels, lse, expected_logit, grad_lp, grad_ent, inv_temperature,
                    tiling, *, need_hidden, need_weight, need_bias):
    """Chunked backward from the saved per-token stats; logits are recomputed tile by tile.

    ``grad_lp`` and ``grad_ent`` are already scaled by 1/t (and zero at ignored
    labels), so each tile below is the gradient with respect to the raw logits
    ``h W^T + b``. Returns fp32 ``(grad_hidden [N, D], grad_weight [V, D], grad_bias [V])``
    (None where not needed).
    """
    num_tokens, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    token_chunk, vocab_chunk = tiling
    device = hidden.device
    tiles = _Tiles(weight, bias, token_chunk, vocab_chunk, inv_temperature, n_buffers=2)
    grad_hidden = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=device) if need_hidden else None
    grad_weight = torch.zeros(vocab_size, hidden_size, dtype=torch.float32, device=device) if need_weight else None
    grad_bias = torch.zeros(vocab_size, dtype=torch.float32, device=device) if need_bias else None
    labels = labels.long()
    for row in range(0, num_tokens, token_chunk):
        rows = min(token_chunk, num_tokens - row)
        h, scaled_h = _hidden_chunk(hidden, row, rows, inv_temperature)
        chunk_labels = labels[row : row + rows]
        chunk_lse = lse[row : row + rows, None]
        g_lp = None if grad_lp is None else grad_lp[row : row + rows]
        g_ent = None if grad_ent is None else grad_ent[row : row + rows]
        if g_ent is not None:
            # dz = p * (g_ent (E - z) - g_lp) + g_lp onehot = p * (offset - g_ent z) + g_lp onehot
            offset = g_ent * expected_logit[row : row + rows]
            if g_lp is not None:
                offset = offset - g_lp
        for start, width in tiles.ranges():
            w_tile = tiles.weight_tile(start, width)
            z = tiles.logits(scaled_h, w_tile, start, width, out=tiles.buffer(0, rows, width))  # [n, v]
            p = torch.sub(z, chunk_lse, out=tiles.buffer(1, rows, width)).exp_()  # softmax tile
            if g_ent is not None:
                dz = z.mul_(-g_ent[:, None]).add_(offset[:, None]).mul_(p)
            else:
                dz = torch.mul(p, -g_lp[:, None], out=z)
            if g_lp is not None:
                in_tile = (chunk_labels >= start) & (chunk_labels < start + width)
                local = (chunk_labels - start).clamp_(0, width - 1)[:, None]
                dz.scatter_add_(1, local, torch.where(in_tile, g_lp, 0.0)[:, None])
            if grad_hidden is not None:
                grad_hidden[row : row + rows].addmm_(dz, w_tile)
            if grad_weight is not None:
                grad_weight[start : start + width].addmm_(dz.T, h)
            if grad_bias is not None:
                grad_bias[start : start + width] += dz.sum(dim=0)
    return grad_hidden, grad_weight, grad_bias
