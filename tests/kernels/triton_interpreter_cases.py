"""Triton kernel cases, run by test_triton_logprobs.py in a subprocess under TRITON_INTERPRET=1.

Not collected by the main test run (the file name does not start with test_):
the interpreter has to be switched on before triton is first imported and the
kernels are decorated, which a process that already imported triton cannot do.
Shapes are tiny because the interpreter runs ~1e4x slower than torch; block
sizes of 16 still give several token blocks, vocab tiles, vocab splits and
hidden chunks, with vocab sizes and hidden sizes that are no multiple of them.
"""

from __future__ import annotations

import math
import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/kernels/test_triton_logprobs.py with TRITON_INTERPRET=1", allow_module_level=True)

import torch  # noqa: E402

from rltk.kernels import naive_token_logprobs_and_entropy, token_logprobs_and_entropy  # noqa: E402
from rltk.kernels.logprobs import triton_token_logprobs_and_entropy  # noqa: E402
from rltk.kernels.triton_logprobs import TritonConfig, triton_backward, triton_forward  # noqa: E402

IGNORE = -100


def reference64(hidden, weight, labels, bias=None, temperature=1.0):
    """Independent float64 log-softmax reference: (logprobs [N], entropy [N])."""
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    log_p = torch.log_softmax(logits / temperature, dim=-1)
    lp = log_p.gather(1, labels.clamp(min=0)[:, None]).squeeze(1).masked_fill(labels == IGNORE, 0.0)
    return lp, -(log_p.exp() * log_p).sum(-1)


def make_inputs(n, d, v, *, seed=0, with_bias=False, dtype=torch.float32, logit_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen) * logit_scale
    weight = torch.randn(v, d, generator=gen) * d**-0.5 * 2.0
    bias = torch.randn(v, generator=gen) if with_bias else None
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[1::4] = IGNORE
    cast = lambda t: None if t is None else t.to(dtype).requires_grad_()  # noqa: E731
    return cast(hidden), cast(weight), cast(bias), labels


def grads(outputs, inputs, upstream):
    loss = sum((o * u).sum() for o, u in zip(outputs, upstream))
    return torch.autograd.grad(loss, [x for x in inputs if x is not None])


def assert_rel_close(actual, expected, rel, what):
    err = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert err <= rel * max(scale, 1e-12), f"{what}: max abs error {err:.3e} vs scale {scale:.3e} (rel {rel})"


SMALL = dict(block_n=16, block_v=16, block_d=16)

CASES = [  # (N, D, V, num_splits)
    (5, 8, 17, 1),    # one partial token block, two vocab tiles (17 = 16 + 1)
    (16, 24, 50, 2),  # D not a multiple of block_d; 4 vocab tiles in 2 splits
    (21, 40, 97, 3),  # two token blocks, 7 vocab tiles in 3 splits (3 + 3 + 1)
    (13, 16, 100, None),  # automatic split count
]


@pytest.mark.parametrize("n,d,v,splits", CASES)
@pytest.mark.parametrize("with_bias,temperature", [(False, 1.0), (True, 0.6)])
def test_fp32_values_and_both_gradients_match_naive_and_float64(n, d, v, splits, with_bias, temperature):
    hidden, weight, bias, labels = make_inputs(n, d, v, seed=n * v, with_bias=with_bias)
    config = TritonConfig(**SMALL, num_splits=splits)
    ours = triton_token_logprobs_and_entropy(
        hidden, weight, labels, bias=bias, temperature=temperature, config=config
    )
    naive = naive_token_logprobs_and_entropy(hidden, weight, labels, bias=bias, temperature=temperature)
    ref = reference64(hidden, weight, labels, bias, temperature)
    for name, a, b, c in zip(("logprobs", "entropy"), ours, naive, ref):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=f"{name} vs naive")
        torch.testing.assert_close(a.double(), c, atol=1e-5, rtol=0, msg=f"{name} vs float64")
    assert (ours[0][1::4] == 0).all(), "ignored labels must give log-prob 0"
    gen = torch.Generator().manual_seed(7)
    upstream = (torch.randn(n, generator=gen), torch.randn(n, generator=gen))
    inputs = (hidden, weight, bias)
    for name, g_ours, g_naive, g_ref in zip(
        ("hidden", "weight", "bias"), grads(ours, inputs, upstream), grads(naive, inputs, upstream),
        grads(ref, inputs, upstream),
    ):
        assert_rel_close(g_ours, g_naive, 1e-5, f"grad {name} vs naive")
        assert_rel_close(g_ours, g_ref, 1e-5, f"grad {name} vs float64")


@pytest.mark.parametrize("which", [0, 1])
def test_gradient_of_one_output_alone(which):
    hidden, weight, bias, labels = make_inputs(11, 20, 45, with_bias=True, seed=which)
    ours = triton_token_logprobs_and_entropy(hidden, weight, labels, bias=bias, config=TritonConfig(**SMALL))
    ref = reference64(hidden, weight, labels, bias)
    for a, b in zip(torch.autograd.grad(ours[which].sum(), [hidden, weight, bias]),
                    torch.autograd.grad(ref[which].sum(), [hidden, weight, bias])):
        assert_rel_close(a, b, 1e-5, f"gradient of output {which}")


def test_ignored_labels_send_no_gradient_through_the_logprob():
    hidden, weight, _, labels = make_inputs(9, 16, 33)
    logprobs, _ = triton_token_logprobs_and_entropy(hidden, weight, labels, config=TritonConfig(**SMALL))
    (grad_hidden,) = torch.autograd.grad(logprobs.sum(), [hidden])
    assert grad_hidden[1::4].abs().max() == 0
    assert grad_hidden[0].abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_are_upcast_before_the_dot(dtype):
    # The interpreter's bf16 tl.dot returns wrong numbers: these cases pass only
    # because every tile is upcast to fp32 first, in forward and backward.
    n, d, v = 14, 24, 61
    hidden, weight, bias, labels = make_inputs(n, d, v, with_bias=True, dtype=dtype, seed=3)
    config = TritonConfig(**SMALL, num_splits=2)
    ours = triton_token_logprobs_and_entropy(hidden, weight, labels, bias=bias, temperature=0.8, config=config)
    ref = reference64(hidden, weight, labels, bias, 0.8)  # fp64 math on the same half values
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=0)
    # The fp32 gradients before the final cast, straight from the kernels.
    lse = torch.logsumexp((hidden.double() @ weight.double().T + bias.double()) / 0.8, dim=-1).float()
    probs = torch.softmax((hidden.double() @ weight.double().T + bias.double()) / 0.8, dim=-1)
    expected_logit = (probs * (hidden.double() @ weight.double().T + bias.double()) / 0.8).sum(-1).float()
    g_lp = torch.linspace(-1, 1, n).masked_fill(labels == IGNORE, 0.0)
    g_ent = torch.linspace(0.5, 2, n)
    fp32_grads = triton_backward(
        hidden.detach(), weight.detach(), bias.detach(), labels, lse, expected_logit, g_lp / 0.8, g_ent / 0.8,
        1 / 0.8, config, need_hidden=True, need_weight=True, need_bias=True,
    )
    leaves64 = [x.detach().double().requires_grad_() for x in (hidden, weight, bias)]
    ref_grads = grads(reference64(*leaves64[:2], labels, leaves64[2], 0.8), leaves64, (g_lp.double(), g_ent.double()))
    for name, a, b in zip(("hidden", "weight", "bias"), fp32_grads, ref_grads):
        assert a.dtype == torch.float32
        assert_rel_close(a, b, 1e-5, f"fp32 grad {name} from {dtype} inputs")
    # Through autograd the gradients come back in the input dtype.
    op_grads = grads(ours, (hidden, weight, bias), (g_lp, g_ent))
    for a, b, x in zip(op_grads, ref_grads, (hidden, weight, bias)):
        assert a.dtype == dtype and a.shape == x.shape
        assert_rel_close(a, b, 2 * torch.finfo(dtype).eps, "gradient rounded to the input dtype")


def test_split_merge_gives_the_same_statistics_as_one_split():
    hidden, weight, bias, labels = make_inputs(16, 16, 80, with_bias=True, logit_scale=20.0, seed=5)
    args = (hidden.detach(), weight.detach(), bias.detach(), labels, 1.0)
    one = triton_forward(*args, TritonConfig(**SMALL, num_splits=1), IGNORE)
    five = triton_forward(*args, TritonConfig(**SMALL, num_splits=5), IGNORE)
    assert one[4] is None and five[4] is None  # sum_pi_squared only when asked for
    for a, b in zip(one[:4], five[:4]):  # logprobs, entropy, lse, E_p[z]
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-6)
    ref = reference64(hidden, weight, labels, bias)
    scale = (hidden.double() @ weight.double().T).abs().max().item()  # logits in the hundreds
    torch.testing.assert_close(five[0].double(), ref[0], atol=2e-7 * scale, rtol=0)


def test_public_op_dispatches_to_triton_with_chunk_size_as_block_sizes():
    hidden, weight, _, labels = make_inputs(18, 12, 70, seed=11)
    ours = token_logprobs_and_entropy(hidden, weight, labels, impl="triton", chunk_size=(16, 32))
    ref = reference64(hidden, weight, labels)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=0)
    assert ours[0].grad_fn is not None and "TokenLogprobsEntropy" in type(ours[0].grad_fn).__name__
    with pytest.raises(ValueError, match="power of two >= 16"):
        token_logprobs_and_entropy(hidden, weight, labels, impl="triton", chunk_size=(16, 24))


def test_non_contiguous_hidden_uses_its_strides():
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(20, 10, generator=gen).T  # [10, 20], column-major
    weight = torch.randn(19, 20, generator=gen)
    labels = torch.randint(0, 19, (10,), generator=gen)
    ours = triton_token_logprobs_and_entropy(hidden, weight, labels, config=TritonConfig(**SMALL))
    for a, b in zip(ours, reference64(hidden, weight, labels)):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=0)


def test_explicit_config_entry_point_computes_afresh_on_every_call():
    # A cache on the entry point once returned the previous call's tensors for the same input objects,
    # even after they were changed in place.
    hidden, weight, _, labels = make_inputs(7, 16, 20, seed=4)
    hidden, weight = hidden.detach(), weight.detach()
    first, _ = triton_token_logprobs_and_entropy(hidden, weight, labels, config=TritonConfig(**SMALL))
    weight.mul_(2.0)
    second, _ = triton_token_logprobs_and_entropy(hidden, weight, labels, config=TritonConfig(**SMALL))
    assert second is not first
    torch.testing.assert_close(second.double(), reference64(hidden, weight, labels)[0], atol=1e-5, rtol=0)
    assert (second - first).abs().max() > 0.1


def tiled_hand_inputs():
    """Three rows over V = 48 (three vocab tiles of 16) whose sum_v p_v^2 is known by hand:

    * logits 0, ln 2, ln 3 on tiles 1, 2, 3: p = (1, 2, 3) / 96 per column, 16 (1 + 4 + 9) / 96^2 = 14 / 576;
      the running max moves up at every tile;
    * 1000 everywhere: 1 / 48, where exp(2 z) alone would overflow;
    * 1000 and 999 alternating: p = (e, 1) / (24 (e + 1)), (e^2 + 1) / (24 (e + 1)^2).
    """
    rising = torch.cat([torch.full((16,), math.log(k)) for k in (1, 2, 3)])
    alternating = torch.tensor([1000.0, 999.0] * 24)
    hidden = torch.stack([rising, torch.full((48,), 1000.0), alternating])
    expected = torch.tensor([14 / 576, 1 / 48, (math.e**2 + 1) / (24 * (math.e + 1) ** 2)], dtype=torch.float64)
    return hidden, torch.eye(48), torch.tensor([0, 17, IGNORE]), expected


@pytest.mark.parametrize("splits", [1, 3])
def test_sum_pi_squared_by_hand_over_tiles_and_splits(splits):
    hidden, weight, labels, expected = tiled_hand_inputs()
    out = triton_token_logprobs_and_entropy(hidden, weight, labels, config=TritonConfig(**SMALL, num_splits=splits),
                                            with_sum_pi_squared=True)
    assert len(out) == 3 and out[2].dtype == torch.float32
    torch.testing.assert_close(out[2].double(), expected, atol=0, rtol=2e-6)


def test_sum_pi_squared_matches_naive_and_leaves_the_rest_unchanged():
    hidden, weight, bias, labels = make_inputs(21, 24, 61, seed=9, with_bias=True)
    config = TritonConfig(**SMALL, num_splits=3)
    plain = triton_token_logprobs_and_entropy(hidden, weight, labels, bias=bias, temperature=0.7, config=config)
    extra = triton_token_logprobs_and_entropy(hidden, weight, labels, bias=bias, temperature=0.7, config=config,
                                              with_sum_pi_squared=True)
    *_, naive = naive_token_logprobs_and_entropy(hidden, weight, labels, bias=bias, temperature=0.7,
                                                 with_sum_pi_squared=True)
    logits = (hidden.double() @ weight.double().T + bias.double()) / 0.7
    torch.testing.assert_close(extra[2].double(), logits.softmax(-1).square().sum(-1), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(extra[2], naive, atol=1e-6, rtol=1e-5)
    assert not extra[2].requires_grad
    for a, b in zip(plain, extra[:2]):
        assert torch.equal(a, b)
