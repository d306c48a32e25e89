"""exclude_tokens: the head op's outputs for the softmax without some token ids, against an independent float64
log-softmax with those ids at -inf: fp32 values within 1e-5; gradients within 5e-5 (the torch backend's, measured
2.4e-5 at temperature 0.6 with excluded masses up to 0.58, its own fp32 backward error of 2e-6 amplified through
1 / (1 - S); the naive backend's 2e-6)."""

from __future__ import annotations

import pytest
import torch

from rltk.kernels import token_logprobs_and_entropy
from rltk.kernels.excluded_tokens import exclude_tokens

IGNORE = -100
EXCLUDED = [2, 7, 11]


def _inputs(seed=0, n=12, d=8, v=40):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen, dtype=torch.float64).float().requires_grad_()
    # large logits on the excluded rows: a mass of about one half there, so the correction is far from small
    weight = torch.randn(v, d, generator=gen) * 0.7
    weight[EXCLUDED] *= 2.0
    weight.requires_grad_()
    bias = torch.randn(v, generator=gen).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[labels == 2] = 3
    labels[labels == 7] = 8
    labels[labels == 11] = 12
    labels[[1, 5]] = IGNORE
    return hidden, weight, bias, labels


def _reference(hidden, weight, bias, labels, temperature):
    logits = (hidden.double() @ weight.double().T + bias.double()) / temperature
    logits = logits.index_fill(-1, torch.tensor(EXCLUDED), float("-inf"))
    log_p = torch.log_softmax(logits, -1)
    valid = labels != IGNORE
    logprobs = torch.where(valid, log_p.gather(1, labels.clamp(min=0)[:, None]).squeeze(1), 0.0)
    p = log_p.exp()
    entropy = -(p * log_p.nan_to_num(neginf=0.0)).sum(-1)
    return logprobs, entropy, p.square().sum(-1)


@pytest.mark.parametrize("impl", ["torch", "naive"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_and_gradients_are_those_of_the_softmax_without_the_excluded_ids(impl, temperature):
    hidden, weight, bias, labels = _inputs()
    valid = labels != IGNORE
    outputs = token_logprobs_and_entropy(hidden, weight, labels, bias=bias, temperature=temperature, impl=impl,
                                         with_sum_pi_squared=True)
    got = exclude_tokens(outputs, hidden, weight, bias, labels, EXCLUDED, temperature=temperature)
    want = _reference(hidden, weight, bias, labels, temperature)
    torch.testing.assert_close(got[0].double(), want[0], atol=1e-5, rtol=0)
    for g, w in zip(got[1:], want[1:]):  # ignored labels: their entropy and sum_pi_squared are the full softmax's
        torch.testing.assert_close(g[valid].double(), w[valid], atol=1e-5, rtol=0)
    # teeth: the excluded mass is large at some positions here
    assert (got[0] - outputs[0])[valid].max() > 0.3
    coef = torch.linspace(-1.0, 1.0, labels.shape[0])
    grads = torch.autograd.grad((got[0] * coef + got[1] * valid * 0.5).sum(), (hidden, weight, bias))
    ref = torch.autograd.grad((want[0] * coef.double() + want[1] * valid * 0.5).sum(), (hidden, weight, bias))
    for g, r in zip(grads, ref):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.double(), r.double(), atol=5e-5, rtol=0)


def test_an_excluded_label_keeps_the_full_softmaxs_logprob_and_none_changes_nothing():
    hidden, weight, bias, labels = _inputs()
    labels[0] = EXCLUDED[1]  # an environment's image placeholder inside a multi-turn response
    outputs = token_logprobs_and_entropy(hidden, weight, labels, bias=bias)
    got = exclude_tokens(outputs, hidden, weight, bias, labels, EXCLUDED, temperature=1.0)
    assert got[0][0] == outputs[0][0] and torch.isfinite(got[0]).all()
    others = labels != IGNORE
    others[0] = False
    assert (got[0] != outputs[0])[others].all()  # the others are corrected
    # finite gradients under the loss's masking (a product with 0 there)
    grads = torch.autograd.grad((got[0] * (labels != EXCLUDED[1])).sum(), (hidden, weight))
    assert all(torch.isfinite(g).all() for g in grads)
    assert exclude_tokens(outputs, hidden, weight, bias, labels, [], temperature=1.0) is outputs
