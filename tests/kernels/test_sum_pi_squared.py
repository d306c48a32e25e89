"""``sum_v p_v^2`` of each token's softmax, the optional third output of the log-prob op (torch and naive).

The optimal-token-baseline estimator weights tokens by ``1 - 2 p_token + sum_v p_v^2``; the
old-log-prob pass computes it in the same online pass as the log-probs. Checked here against
numbers worked out by hand, a float64 reference, and the inequalities any distribution obeys.
The Triton kernels get the same hand-made cases under the interpreter
(triton_interpreter_cases.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rltk.kernels import naive_token_logprobs_and_entropy, token_logprobs_and_entropy

IGNORE = -100
E = math.e

# (logits of one token, temperature, sum_v p_v^2 by hand)
HAND = [
    # p = (1, 2, 3) / 6: (1 + 4 + 9) / 36
    ([0.0, math.log(2), math.log(3), -math.inf], 1.0, 14 / 36),
    # at t = 1/2 the logits double: p = (1, 4, 9) / 14, (1 + 16 + 81) / 196 = 1/2
    ([0.0, math.log(2), math.log(3), -math.inf], 0.5, 0.5),
    # the largest logit first: the running max never moves after the first tile
    ([math.log(3), math.log(2), 0.0, -math.inf], 1.0, 14 / 36),
    # uniform over 4 at logit 1000: exp(2 z) alone would overflow
    ([1000.0, 1000.0, 1000.0, 1000.0], 1.0, 0.25),
    # p = (e, e, 1, 1) / (2e + 2): (2 e^2 + 2) / (2e + 2)^2, exact inputs far from 0
    ([999.0, 1000.0, 999.0, 1000.0], 1.0, (2 * E**2 + 2) / (2 * E + 2) ** 2),
    # one token takes all but 2 e^-200 of the mass
    ([0.0, -200.0, -200.0, -200.0], 1.0, 1.0),
]


def hand_inputs():
    """Each row of HAND as hidden states of an identity head (logits = hidden); -inf as a very negative
    finite logit, which gives the same fp32 probabilities."""
    hidden = torch.tensor([[max(z, -1e4) for z in row] for row, _, _ in HAND])
    return hidden, torch.eye(4), torch.tensor([0, 1, IGNORE, 3, 2, 0])


def reference64(hidden, weight, bias=None, temperature=1.0):
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    return torch.softmax(logits / temperature, dim=-1).square().sum(-1)


# chunk sizes of the torch backend: vocab tiles of 1 and 3 columns make the running max move
# between tiles (the rescaling of the accumulator), one tile of all 4 never does.
TILINGS = [("naive", None), ("torch", None), ("torch", (1, 1)), ("torch", (2, 3)), ("torch", (4, 2))]


@pytest.mark.parametrize("impl,chunk_size", TILINGS)
def test_hand_computed_values_on_a_tiny_vocabulary(impl, chunk_size):
    hidden, weight, labels = hand_inputs()
    for row, (_, temperature, expected) in enumerate(HAND):
        out = token_logprobs_and_entropy(hidden[row : row + 1], weight, labels[row : row + 1],
                                         temperature=temperature, impl=impl, chunk_size=chunk_size,
                                         with_sum_pi_squared=True)
        assert len(out) == 3 and out[2].dtype == torch.float32
        assert out[2].item() == pytest.approx(expected, rel=1e-6), f"row {row}"


@pytest.mark.parametrize("impl,chunk_size", TILINGS)
@pytest.mark.parametrize("with_bias,temperature", [(False, 1.0), (True, 0.7)])
def test_matches_float64_on_random_logits(impl, chunk_size, with_bias, temperature):
    gen = torch.Generator().manual_seed(3)
    n, d, v = 13, 8, 37
    hidden = torch.randn(n, d, generator=gen) * 2
    weight = torch.randn(v, d, generator=gen)
    bias = torch.randn(v, generator=gen) if with_bias else None
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[::4] = IGNORE  # an ignored label has no log-prob, but its distribution still has a sum_pi_squared
    chunk = None if chunk_size is None else (chunk_size[0], chunk_size[1] * 5)
    *_, ours = token_logprobs_and_entropy(hidden, weight, labels, bias=bias, temperature=temperature, impl=impl,
                                          chunk_size=chunk, with_sum_pi_squared=True)
    torch.testing.assert_close(ours.double(), reference64(hidden, weight, bias, temperature), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("impl", ["naive", "torch"])
def test_a_detached_extra_that_leaves_the_other_outputs_and_their_gradients_unchanged(impl):
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 6, generator=gen, requires_grad=True)
    weight = torch.randn(21, 6, generator=gen, requires_grad=True)
    labels = torch.randint(0, 21, (9,), generator=gen)
    plain = token_logprobs_and_entropy(hidden, weight, labels, impl=impl, chunk_size=(4, 8))
    extra = token_logprobs_and_entropy(hidden, weight, labels, impl=impl, chunk_size=(4, 8), with_sum_pi_squared=True)
    assert len(plain) == 2 and len(extra) == 3
    assert not extra[2].requires_grad and extra[2].grad_fn is None
    for a, b in zip(plain, extra[:2]):
        assert torch.equal(a, b)
    upstream = torch.linspace(-1, 1, 9)
    grads_plain = torch.autograd.grad(((plain[0] + plain[1]) * upstream).sum(), [hidden, weight])
    grads_extra = torch.autograd.grad(((extra[0] + extra[1]) * upstream).sum(), [hidden, weight])
    for a, b in zip(grads_plain, grads_extra):
        assert torch.equal(a, b)


def test_naive_reference_is_the_logsumexp_formula():
    hidden, weight, labels = hand_inputs()
    *_, ours = naive_token_logprobs_and_entropy(hidden, weight, labels, temperature=0.5, with_sum_pi_squared=True)
    z = (hidden.double() @ weight.double().T) / 0.5
    torch.testing.assert_close(ours.double(), torch.exp(z.mul(2).logsumexp(-1) - 2 * z.logsumexp(-1)), atol=1e-7,
                               rtol=1e-6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    v=st.integers(1, 40),
    scale=st.sampled_from([0.0, 0.1, 1.0, 10.0, 100.0]),
    offset=st.sampled_from([0.0, -500.0, 500.0]),
    vocab_chunk=st.integers(1, 16),
    seed=st.integers(0, 2**16),
)
def test_bounds_every_distribution_obeys(v, scale, offset, vocab_chunk, seed):
    # 1/V <= exp(-H) <= sum p^2 <= max p <= 1: sum p^2 = exp(-H_2) (collision entropy), and
    # H_2 <= H (Shannon) since E[p] >= exp(E[log p]) (Jensen). Logits far from 0 (offset) check that
    # the accumulator is taken relative to the running max.
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(5, v, generator=gen) * scale + offset
    labels = torch.randint(0, v, (5,), generator=gen)
    _, entropy, sq = token_logprobs_and_entropy(hidden, torch.eye(v), labels, impl="torch",
                                                chunk_size=(2, vocab_chunk), with_sum_pi_squared=True)
    tol = 1e-5
    assert (sq >= 1 / v - tol).all() and (sq <= 1 + tol).all()
    assert (sq >= torch.exp(-entropy) * (1 - tol) - tol).all(), (sq, entropy)
    top = torch.softmax(hidden.double() @ torch.eye(v).double(), -1).amax(-1)
    assert (sq.double() <= top + tol).all()
