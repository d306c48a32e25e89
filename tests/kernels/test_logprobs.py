"""Fused token log-probs and entropy: the torch backend and the naive reference.

Each backend is checked against an independent float64 log-softmax written
here, against ``naive``, and against numbers computed by hand. The Triton
kernels are tested under the interpreter in test_triton_logprobs.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rltk.kernels import IMPLS, naive_token_logprobs_and_entropy, resolve_impl, token_logprobs_and_entropy
from rltk.kernels.logprobs import DEFAULT_TILE_ELEMENTS, torch_tiling

IGNORE = -100


def reference64(hidden, weight, labels, bias=None, temperature=1.0):
    """log_softmax in float64: the independent reference. Returns (logprobs [N], entropy [N])."""
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    log_p = torch.log_softmax(logits / temperature, dim=-1)
    ignored = labels == IGNORE
    lp = log_p.gather(1, labels.clamp(min=0)[:, None]).squeeze(1).masked_fill(ignored, 0.0)
    return lp, -(log_p.exp() * log_p).sum(-1)


def make_inputs(n, d, v, *, seed=0, with_bias=False, ignore_every=0, logit_scale=1.0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen) * logit_scale
    weight = torch.randn(v, d, generator=gen) * d**-0.5 * 2.0  # logits of a few units: peaked, not one-hot
    bias = torch.randn(v, generator=gen) if with_bias else None
    labels = torch.randint(0, v, (n,), generator=gen)
    if ignore_every:
        labels[::ignore_every] = IGNORE
    cast = lambda t: None if t is None else t.to(dtype).requires_grad_()  # noqa: E731
    return cast(hidden), cast(weight), cast(bias), labels


def grads(outputs, inputs, upstream):
    """Gradients of sum_k <upstream_k, outputs_k> with respect to ``inputs`` (None entries skipped)."""
    loss = sum((o * u).sum() for o, u in zip(outputs, upstream) if u is not None)
    present = [x for x in inputs if x is not None]
    return torch.autograd.grad(loss, present)


def assert_rel_close(actual, expected, rel, what, atol=0.0):
    """Max abs error <= rel * max |expected| (+ atol): relative to the tensor's scale."""
    err = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert err <= rel * max(scale, 1e-12) + atol, f"{what}: max abs error {err:.3e} vs scale {scale:.3e} (rel {rel})"


# --------------------------------------------------------------------------
# Numbers by hand
# --------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["torch", "naive"])
def test_values_and_gradient_computed_by_hand(impl):
    # logits [1, 0, 0]: lse = log(e + 2); E_p[z] = e / (e + 2).
    hidden = torch.tensor([[1.0, 0.0], [1.0, 0.0]], requires_grad=True)
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], requires_grad=True)
    labels = torch.tensor([0, 2])
    logprobs, entropy = token_logprobs_and_entropy(hidden, weight, labels, impl=impl, chunk_size=(1, 2))
    lse = math.log(math.e + 2)
    expected_entropy = lse - math.e / (math.e + 2)
    torch.testing.assert_close(logprobs, torch.tensor([1 - lse, -lse]), atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, torch.tensor([expected_entropy] * 2), atol=1e-6, rtol=0)
    # d logprob_0 / d logits = onehot(0) - p; d logits / d hidden_0 = weight.
    (grad_hidden,) = torch.autograd.grad(logprobs[0], [hidden])
    p = torch.tensor([math.e, 1.0, 1.0]) / (math.e + 2)
    expected = (torch.tensor([1.0, 0.0, 0.0]) - p) @ weight.detach()
    torch.testing.assert_close(grad_hidden[0], expected, atol=1e-6, rtol=0)
    assert grad_hidden[1].abs().max() == 0


def test_temperature_divides_the_logits():
    hidden, weight, _, labels = make_inputs(9, 6, 11)
    t = 0.6
    scaled = token_logprobs_and_entropy(hidden / t, weight, labels, impl="torch")
    tempered = token_logprobs_and_entropy(hidden, weight, labels, temperature=t, impl="torch")
    for a, b in zip(tempered, scaled):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------
# Torch backend against float64 and against naive
# --------------------------------------------------------------------------

SHAPES = [  # (N, D, V, chunk_size): vocab sizes that are no multiple of the vocab tile
    (33, 24, 101, None),
    (33, 24, 101, 8),
    (33, 24, 101, (5, 13)),
    (17, 20, 50, (64, 7)),
    (40, 16, 97, (16, 97)),
    (1, 8, 5, (1, 1)),
]


@pytest.mark.parametrize("n,d,v,chunk", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_torch_backend_matches_float64_and_naive(n, d, v, chunk, with_bias, temperature):
    hidden, weight, bias, labels = make_inputs(n, d, v, with_bias=with_bias, ignore_every=4, seed=n + v)
    ours = token_logprobs_and_entropy(
        hidden, weight, labels, bias=bias, temperature=temperature, impl="torch", chunk_size=chunk
    )
    naive = naive_token_logprobs_and_entropy(hidden, weight, labels, bias=bias, temperature=temperature)
    ref = reference64(hidden, weight, labels, bias, temperature)
    for name, a, b, c in zip(("logprobs", "entropy"), ours, naive, ref):
        assert a.dtype == torch.float32 and a.shape == (n,)
        torch.testing.assert_close(a.double(), c, atol=1e-5, rtol=0, msg=f"{name} vs float64")
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=f"{name} vs naive")
    # Both outputs carry upstream gradients at once, with different weights per token.
    gen = torch.Generator().manual_seed(1)
    upstream = (torch.randn(n, generator=gen), torch.randn(n, generator=gen))
    inputs = (hidden, weight, bias)
    for g_ours, g_naive, g_ref, name in zip(
        grads(ours, inputs, upstream), grads(naive, inputs, upstream), grads(ref, inputs, upstream),
        ("hidden", "weight", "bias"),
    ):
        assert_rel_close(g_ours, g_ref, 1e-5, f"grad {name} vs float64")
        assert_rel_close(g_ours, g_naive, 1e-5, f"grad {name} vs naive")


@pytest.mark.parametrize("which", ["logprobs", "entropy"])
def test_gradient_of_one_output_alone(which):
    hidden, weight, bias, labels = make_inputs(21, 12, 37, with_bias=True, ignore_every=5)
    ours = token_logprobs_and_entropy(hidden, weight, labels, bias=bias, impl="torch", chunk_size=(4, 10))
    ref = reference64(hidden, weight, labels, bias)
    pick = 0 if which == "logprobs" else 1
    for a, b in zip(torch.autograd.grad(ours[pick].sum(), [hidden, weight, bias]),
                    torch.autograd.grad(ref[pick].sum(), [hidden, weight, bias])):
        assert_rel_close(a, b, 1e-5, f"grad of {which}")


def test_large_logits_do_not_overflow():
    # Logits in the hundreds: exp would overflow fp32 without the running max.
    hidden, weight, _, labels = make_inputs(12, 16, 300, logit_scale=60.0)
    ours = token_logprobs_and_entropy(hidden, weight, labels, impl="torch", chunk_size=(5, 64))
    ref = reference64(hidden, weight, labels)
    assert torch.isfinite(ours[0]).all() and torch.isfinite(ours[1]).all()
    scale = (hidden.double() @ weight.double().T).abs().max().item()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.double(), b, atol=2e-7 * scale, rtol=0)


def test_ignored_labels_give_zero_logprob_and_no_gradient_but_keep_entropy():
    hidden, weight, _, labels = make_inputs(10, 8, 23)
    labels[[2, 7]] = IGNORE
    logprobs, entropy = token_logprobs_and_entropy(hidden, weight, labels, impl="torch", chunk_size=(3, 5))
    assert logprobs[2] == 0 and logprobs[7] == 0
    (grad_hidden,) = torch.autograd.grad(logprobs.sum(), [hidden])
    assert grad_hidden[2].abs().max() == 0 and grad_hidden[7].abs().max() == 0
    assert grad_hidden[0].abs().max() > 0
    unmasked = reference64(hidden, weight, labels.clamp(min=0))[1]
    torch.testing.assert_close(entropy.double(), unmasked, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype,atol_vs_fp32", [(torch.bfloat16, 5e-2), (torch.float16, 1e-2)])
@pytest.mark.parametrize("chunk", [None, (4, 16)])
def test_half_precision_inputs(dtype, atol_vs_fp32, chunk):
    hidden, weight, bias, labels = make_inputs(19, 16, 45, with_bias=True, ignore_every=6, dtype=dtype)
    logprobs, entropy = token_logprobs_and_entropy(hidden, weight, labels, bias=bias, impl="torch", chunk_size=chunk)
    assert logprobs.dtype == entropy.dtype == torch.float32
    # The op computes in fp32 on the given half values: it matches fp32 math on them tightly ...
    ref = reference64(hidden, weight, labels, bias)
    torch.testing.assert_close(logprobs.double(), ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), ref[1], atol=1e-5, rtol=0)
    # ... and the unrounded fp32 inputs within what the input rounding allows.
    full = make_inputs(19, 16, 45, with_bias=True, ignore_every=6)
    exact = reference64(full[0], full[1], full[3], full[2])
    torch.testing.assert_close(logprobs.double(), exact[0], atol=atol_vs_fp32, rtol=0)
    upstream = (torch.linspace(-1, 1, 19), torch.linspace(1, 2, 19))
    g_ours = grads((logprobs, entropy), (hidden, weight, bias), upstream)
    g_ref = grads(ref, (hidden, weight, bias), upstream)
    for a, b, x in zip(g_ours, g_ref, (hidden, weight, bias)):
        assert a.dtype == dtype and a.shape == x.shape
        # Gradients come back rounded to the input dtype: one half-precision ulp.
        assert_rel_close(a, b, 2 * torch.finfo(dtype).eps, "half-precision gradient")


def test_non_contiguous_hidden_and_no_grad():
    gen = torch.Generator().manual_seed(3)
    states = torch.randn(3, 7, 20, generator=gen)  # [B, S, D]
    hidden = states[:, 2:6].reshape(-1, 20)[:, ::2]  # strided [12, 10]
    weight = torch.randn(31, 10, generator=gen)
    labels = torch.randint(0, 31, (12,), generator=gen)
    assert not hidden.is_contiguous()
    with torch.no_grad():
        ours = token_logprobs_and_entropy(hidden, weight, labels, impl="torch", chunk_size=(5, 8))
    ref = reference64(hidden, weight, labels)
    for a, b in zip(ours, ref):
        assert not a.requires_grad
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=0)


def test_autocast_does_not_lower_the_precision():
    hidden, weight, _, labels = make_inputs(8, 16, 29)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = token_logprobs_and_entropy(hidden, weight, labels, impl="torch")
        naive_inside = naive_token_logprobs_and_entropy(hidden, weight, labels)
    ref = reference64(hidden, weight, labels)
    for a, b, c in zip(inside, naive_inside, ref):
        torch.testing.assert_close(a.double(), c, atol=1e-5, rtol=0)
        torch.testing.assert_close(b.double(), c, atol=1e-5, rtol=0)


def test_empty_batch():
    hidden, weight, _, _ = make_inputs(0, 4, 9)
    labels = torch.zeros(0, dtype=torch.long)
    logprobs, entropy = token_logprobs_and_entropy(hidden, weight, labels, impl="torch")
    assert logprobs.shape == entropy.shape == (0,)
    (grad_weight,) = torch.autograd.grad(logprobs.sum() + entropy.sum(), [weight], allow_unused=True)
    assert grad_weight is None or grad_weight.abs().max() == 0


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 24),
    d=st.integers(1, 12),
    v=st.integers(1, 60),
    token_chunk=st.integers(1, 30),
    vocab_chunk=st.integers(1, 70),
    temperature=st.sampled_from([0.5, 1.0, 1.7]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_torch_backend_property_matches_float64(n, d, v, token_chunk, vocab_chunk, temperature, with_bias, seed):
    hidden, weight, bias, labels = make_inputs(n, d, v, seed=seed, with_bias=with_bias, ignore_every=3)
    ours = token_logprobs_and_entropy(
        hidden, weight, labels, bias=bias, temperature=temperature, impl="torch",
        chunk_size=(token_chunk, vocab_chunk),
    )
    ref = reference64(hidden, weight, labels, bias, temperature)
    torch.testing.assert_close(ours[0].double(), ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours[1].double(), ref[1], atol=1e-5, rtol=0)
    # Properties of any softmax: log-probs <= 0, 0 <= entropy <= log V.
    assert (ours[0] <= 1e-6).all()
    assert (ours[1] >= -1e-5).all() and (ours[1] <= math.log(v) + 1e-5).all()
    upstream = (torch.ones(n), torch.full((n,), 0.5))
    for a, b in zip(grads(ours, (hidden, weight, bias), upstream), grads(ref, (hidden, weight, bias), upstream)):
        # The two outputs' gradients can cancel to a result far smaller than its
        # O(1) terms, whose fp32 rounding (~1e-7 each) then sets the floor.
        assert_rel_close(a, b, 1e-5, "gradient", atol=2e-6)


@settings(max_examples=20, deadline=None, derandomize=True, database=None)
@given(v=st.integers(2, 40), vocab_chunk=st.integers(1, 45), seed=st.integers(0, 1000))
def test_probabilities_over_all_labels_sum_to_one(v, vocab_chunk, seed):
    # Scoring every vocabulary entry for one hidden state covers the whole softmax.
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, 6, generator=gen).expand(v, 6)
    weight = torch.randn(v, 6, generator=gen)
    logprobs, _ = token_logprobs_and_entropy(hidden, weight, torch.arange(v), impl="torch", chunk_size=(3, vocab_chunk))
    assert abs(logprobs.double().exp().sum().item() - 1.0) < 1e-5


# --------------------------------------------------------------------------
# Dispatch, tiling and errors
# --------------------------------------------------------------------------


def test_auto_picks_torch_for_cpu_tensors():
    assert resolve_impl("auto", torch.zeros(1)) == "torch"
    assert IMPLS == ("auto", "triton", "triton-hopper", "torch", "naive")


def test_the_config_accepts_exactly_the_op_s_backends():
    from rltk.config.schema import CHOICES

    assert CHOICES["model.logprob_impl"] == IMPLS


def test_unknown_impl_lists_the_valid_ones():
    hidden, weight, _, labels = make_inputs(2, 3, 4)
    with pytest.raises(ValueError, match=r"impl='cuda'.*'auto', 'triton', 'triton-hopper', 'torch', 'naive'"):
        token_logprobs_and_entropy(hidden, weight, labels, impl="cuda")


def test_triton_on_cpu_without_interpreter_says_what_to_do(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs CUDA tensors.*impl='torch'.*TRITON_INTERPRET=1"):
        resolve_impl("triton", torch.zeros(1))


def test_default_tiling_bounds_the_tile_whatever_the_vocabulary():
    assert torch_tiling(8192, 32000, None) == (2**25 // 32000, 32000)
    for vocab in (1000, 32000, 152064, 262144):
        tokens, width = torch_tiling(10**6, vocab, None)
        assert tokens * width <= DEFAULT_TILE_ELEMENTS and width <= 32768
    assert torch_tiling(10, 32000, None) == (10, 32000)  # never more rows than tokens
    assert torch_tiling(100, 50, 7) == (7, 50) and torch_tiling(100, 50, (7, 64)) == (7, 50)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(hidden=torch.zeros(3, 4), weight=torch.zeros(5, 6)), "same D"),
        (dict(hidden=torch.zeros(3, 4, 1)), r"hidden must be \[N, D\]"),
        (dict(labels=torch.zeros(2, dtype=torch.long)), r"labels must have shape \[N\] = \(3,\)"),
        (dict(labels=torch.zeros(3)), "integer token ids"),
        (dict(labels=torch.tensor([0, 5, 1])), r"id 5 outside the vocabulary \[0, 5\)"),
        (dict(labels=torch.tensor([0, -3, 1])), r"id -3 outside.*ignore_index=-100"),
        (dict(weight=torch.zeros(5, 4, dtype=torch.float16)), "hidden is torch.float32 but weight is torch.float16"),
        (dict(hidden=torch.zeros(3, 4, dtype=torch.float64), weight=torch.zeros(5, 4, dtype=torch.float64)),
         "float32, bfloat16, float16"),
        (dict(bias=torch.zeros(4)), r"bias must have shape \[V\] = \(5,\)"),
        (dict(temperature=0.0), "temperature must be a finite number > 0; got 0.0"),
        (dict(temperature=float("nan")), "temperature must be a finite number > 0"),
        (dict(chunk_size=0), "chunk_size entries must be >= 1"),
        (dict(chunk_size=(4, 5, 6)), r"\(tokens, vocab\) pair"),
        (dict(chunk_size="big"), r"\(tokens, vocab\) pair"),
    ],
)
def test_bad_arguments_name_the_argument_and_the_valid_values(kwargs, match):
    args = dict(hidden=torch.zeros(3, 4), weight=torch.zeros(5, 4), labels=torch.zeros(3, dtype=torch.long))
    args.update(kwargs)
    hidden, weight, labels = args.pop("hidden"), args.pop("weight"), args.pop("labels")
    with pytest.raises(ValueError, match=match):
        token_logprobs_and_entropy(hidden, weight, labels, impl="torch", **args)


# --------------------------------------------------------------------------
# GPU (skipped without CUDA)
# --------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is present")


@pytest.mark.gpu
@needs_cuda
def test_torch_backend_on_cuda_matches_float64_and_stays_below_the_logits_size():
    torch.manual_seed(0)
    n, d, v = 4096, 256, 32000
    hidden = torch.randn(n, d, device="cuda", requires_grad=True)
    weight = (torch.randn(v, d, device="cuda") * d**-0.5).requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ours = token_logprobs_and_entropy(hidden, weight, labels, impl="torch", chunk_size=(512, 8192))
    (ours[0].sum() + ours[1].sum()).backward()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < n * v * 4 / 2, f"peak {peak / 2**20:.0f} MiB is not below half of one [N, V] fp32 logits"
    ref = reference64(hidden.detach().cpu(), weight.detach().cpu(), labels.cpu())
    torch.testing.assert_close(ours[0].cpu().double(), ref[0], atol=1e-4, rtol=0)
