"""Policy losses: hand-computed values and gradients, clipping properties, accumulation."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rltk
from rltk.algorithms import aggregation as agg
from rltk.algorithms import policy_losses as pl

SETTINGS = settings(max_examples=50, deadline=None, derandomize=True, database=None)

NAMES = {"ppo_clip": pl.ppo_clip, "gspo": pl.gspo, "cispo": pl.cispo, "reinforce": pl.reinforce}
AGGREGATIONS = {
    "token-mean": agg.token_mean,
    "seq-mean-token-sum": agg.seq_mean_token_sum,
    "seq-mean-token-mean": agg.seq_mean_token_mean,
    "seq-mean-token-sum-norm": agg.seq_mean_token_sum_norm,
}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_every_loss_is_registered_under_its_name(name):
    assert rltk.get_component("policy_loss", name) is NAMES[name]


def tokens_with_ratios(ratios, old=-1.0):
    """(logprobs requiring grad, old_logprobs) in float64 with exp(logprobs - old) = ratios."""
    old_logprobs = torch.full((1, len(ratios)), old, dtype=torch.float64)
    logprobs = (old_logprobs + torch.tensor([ratios], dtype=torch.float64).log()).requires_grad_(True)
    return logprobs, old_logprobs


def run(fn, logprobs, old_logprobs, advantages, mask=None, loss_agg=agg.token_mean, **kwargs):
    mask = torch.ones_like(old_logprobs) if mask is None else mask
    loss, metrics = fn(
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=torch.as_tensor(advantages, dtype=torch.float64),
        response_mask=mask, loss_agg=loss_agg, **kwargs,
    )
    (gradient,) = torch.autograd.grad(loss, logprobs)
    return loss.item(), gradient[0].tolist(), {k: float(v) for k, v in metrics.items()}


# --------------------------------------------------------------------------
# ppo_clip
# --------------------------------------------------------------------------

# ratio   1.1   1.5   0.5   0.7   3.0
# A        1     1    -1     1    -1
#         in    high  low    in   (dual clip with c = 2)
PPO_RATIOS = [1.1, 1.5, 0.5, 0.7, 3.0]
PPO_ADVANTAGES = [[1.0, 1.0, -1.0, 1.0, -1.0]]


def test_ppo_clip_by_hand():
    logprobs, old = tokens_with_ratios(PPO_RATIOS)
    loss, gradient, metrics = run(pl.ppo_clip, logprobs, old, PPO_ADVANTAGES)
    # per token max(-A r, -A clip(r, 0.8, 1.2)): -1.1, -1.2, 0.8, -0.7, 3.0 -> mean 0.16
    assert loss == pytest.approx(0.16)
    # d/dlogp = -A r / 5 where unclipped, 0 where clipped
    assert gradient == pytest.approx([-0.22, 0.0, 0.0, -0.14, 0.6])
    assert metrics["clip_frac_high"] == pytest.approx(0.2)
    assert metrics["clip_frac_low"] == pytest.approx(0.2)
    assert metrics["clip_frac"] == pytest.approx(0.4)
    assert metrics["ratio_mean"] == pytest.approx(6.8 / 5)
    # mean of r - 1 - ln r: 0.0046898 + 0.0945349 + 0.1931472 + 0.0566749 + 0.9013877
    assert metrics["approx_kl"] == pytest.approx(1.2504345 / 5, abs=1e-6)
    assert "dual_clip_frac" not in metrics


def test_ppo_dual_clip_by_hand():
    logprobs, old = tokens_with_ratios(PPO_RATIOS)
    loss, gradient, metrics = run(pl.ppo_clip, logprobs, old, PPO_ADVANTAGES, dual_clip_c=2.0)
    # the last token's loss 3.0 is capped at c |A| = 2: mean (-1.1 - 1.2 + 0.8 - 0.7 + 2) / 5
    assert loss == pytest.approx(-0.04)
    assert gradient == pytest.approx([-0.22, 0.0, 0.0, -0.14, 0.0])
    assert metrics["dual_clip_frac"] == pytest.approx(0.2)


def test_ppo_clip_higher_lets_a_positive_token_grow_further():
    logprobs, old = tokens_with_ratios([1.25])
    symmetric = run(pl.ppo_clip, logprobs, old, [[1.0]])
    asymmetric = run(pl.ppo_clip, logprobs, old, [[1.0]], clip_eps_high=0.28)
    assert (symmetric[0], symmetric[1]) == (pytest.approx(-1.2), [0.0])
    assert (asymmetric[0], asymmetric[1]) == (pytest.approx(-1.25), pytest.approx([-1.25]))


@pytest.mark.parametrize("c", [1.0, 0.5, -3.0, float("inf")])
def test_ppo_dual_clip_constant_must_exceed_one(c):
    logprobs, old = tokens_with_ratios([1.0])
    with pytest.raises(ValueError, match=rf"dual_clip_c must be > 1 .*got {c!r}. Use None"):
        run(pl.ppo_clip, logprobs, old, [[1.0]], dual_clip_c=c)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"clip_eps_low": 1.0}, r"'ppo_clip': clip_eps_low must be in \[0, 1\), got 1.0"),
        ({"clip_eps_high": -0.1}, r"'ppo_clip': clip_eps_high must be >= 0, got -0.1"),
    ],
)
def test_ppo_clip_rejects_bad_clip_ranges(kwargs, message):
    logprobs, old = tokens_with_ratios([1.0])
    with pytest.raises(ValueError, match=message):
        run(pl.ppo_clip, logprobs, old, [[1.0]], **kwargs)


def random_tokens(seed, B, T, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 4
    logprobs = old + (torch.rand(B, T, generator=g, dtype=dtype) * 2 - 1)  # log-ratio in [-1, 1]
    advantages = torch.randn(B, T, generator=g, dtype=dtype)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).to(dtype)
    return logprobs, old, advantages, mask


token_batches = st.builds(random_tokens, seed=st.integers(0, 2**30), B=st.integers(1, 6), T=st.integers(1, 8))


def capture(store):
    """A token-mean loss_agg that also records the loss matrix it was given."""

    def loss_agg(loss_mat, mask):
        store["loss_mat"] = loss_mat
        return agg.token_mean(loss_mat, mask)

    return loss_agg


@SETTINGS
@given(
    batch=token_batches,
    eps_low=st.floats(0.05, 0.5),
    eps_high=st.floats(0.05, 0.5),
    dual=st.sampled_from([None, 1.5, 3.0]),
)
def test_ppo_clip_gradient_is_zero_exactly_where_clipped(batch, eps_low, eps_high, dual):
    logprobs, old, advantages, mask = batch
    x = logprobs.clone().requires_grad_(True)
    store = {}
    loss, _ = pl.ppo_clip(
        logprobs=x, old_logprobs=old, advantages=advantages, response_mask=mask,
        loss_agg=capture(store), clip_eps_low=eps_low, clip_eps_high=eps_high, dual_clip_c=dual,
    )
    (gradient,) = torch.autograd.grad(loss, x)
    ratio = (logprobs - old).exp()
    clipped = ((advantages > 0) & (ratio > 1 + eps_high)) | ((advantages < 0) & (ratio < 1 - eps_low))
    if dual is not None:
        clipped |= (advantages < 0) & (ratio > dual)
        on = mask > 0
        # the dual clip bounds every negative-advantage token's loss by c |A|
        bound = (dual * advantages.abs())[on & (advantages < 0)]
        assert (store["loss_mat"][on & (advantages < 0)] <= bound + 1e-12).all()
    n = mask.sum().clamp(min=1)
    expected = torch.where(clipped | (mask == 0), 0.0, -advantages * ratio / n)
    torch.testing.assert_close(gradient, expected, atol=1e-10, rtol=1e-8)


@SETTINGS
@given(batch=token_batches, n_cuts=st.integers(0, 4), cut_seed=st.integers(0, 1000))
def test_ppo_clip_accumulates_exactly_over_micro_batches(batch, n_cuts, cut_seed):
    logprobs, old, advantages, mask = batch
    B = logprobs.shape[0]
    g = torch.Generator().manual_seed(cut_seed)
    cuts = sorted(set(torch.randint(1, B, (n_cuts,), generator=g).tolist())) if B > 1 else []
    bounds = [0, *cuts, B]
    totals = agg.loss_agg_normalisers(mask)
    for name, fn in AGGREGATIONS.items():
        whole_x = logprobs.clone().requires_grad_(True)
        whole, _ = pl.ppo_clip(
            logprobs=whole_x, old_logprobs=old, advantages=advantages, response_mask=mask, loss_agg=fn,
            clip_eps_high=0.28, dual_clip_c=3.0,
        )
        whole.backward()
        micro_x = logprobs.clone().requires_grad_(True)
        bound = functools.partial(fn, **totals)
        summed = 0.0
        for a, b in zip(bounds, bounds[1:]):
            micro, _ = pl.ppo_clip(
                logprobs=micro_x[a:b], old_logprobs=old[a:b], advantages=advantages[a:b],
                response_mask=mask[a:b], loss_agg=bound, clip_eps_high=0.28, dual_clip_c=3.0,
            )
            micro.backward()
            summed += micro.item()
        assert summed == pytest.approx(whole.item(), abs=1e-12), name
        torch.testing.assert_close(micro_x.grad, whole_x.grad, atol=1e-12, rtol=0, msg=name)


# --------------------------------------------------------------------------
# gspo
# --------------------------------------------------------------------------


def test_gspo_by_hand():
    # response 0: log-ratios 0.1, 0.3 (s = e^0.2 = 1.2214 > 1.0004: clipped), A = 1
    # response 1: log-ratios 2e-4, -2e-4, 0 (s = 1: inside the range), A = -1
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    log_ratios = torch.tensor([[0.1, 0.3, 0.0], [2e-4, -2e-4, 0.0]], dtype=torch.float64)
    logprobs = (old + log_ratios).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    loss, gradient, metrics = run(
        pl.gspo, logprobs, old, advantages, mask=mask, loss_agg=agg.seq_mean_token_mean
    )
    # (mean(-1.0004, -1.0004) + mean(1, 1, 1)) / 2 = -0.0002
    assert loss == pytest.approx(-0.0002, abs=1e-9)
    # response 0 clipped: 0; response 1: -A s / (|y| G) = 1 / (3 * 2)
    (grad,) = torch.autograd.grad(
        pl.gspo(logprobs=logprobs, old_logprobs=old, advantages=advantages, response_mask=mask,
                loss_agg=agg.seq_mean_token_mean)[0],
        logprobs,
    )
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 0.0], [1 / 6] * 3], dtype=torch.float64))
    assert metrics["seq_ratio_mean"] == pytest.approx((math.exp(0.2) + 1.0) / 2)
    assert metrics["clip_frac_high"] == pytest.approx(2 / 5)  # the two tokens of response 0
    assert metrics["clip_frac_low"] == 0.0


@SETTINGS
@given(batch=token_batches)
def test_gspo_gradient_is_the_sequence_objectives_gradient(batch):
    """With one advantage per response and no clipping, the per-token form with
    seq-mean-token-mean has exactly the gradient of the paper's objective
    -(1/G) sum_i A_i s_i, s_i = exp(mean_t log-ratio)."""
    logprobs, old, advantages, mask = batch
    per_response = advantages[:, :1].expand_as(advantages)
    x = logprobs.clone().requires_grad_(True)
    loss, _ = pl.gspo(
        logprobs=x, old_logprobs=old, advantages=per_response, response_mask=mask,
        loss_agg=agg.seq_mean_token_mean, clip_eps_low=0.99, clip_eps_high=100.0,
    )
    (gradient,) = torch.autograd.grad(loss, x)

    y = logprobs.clone().requires_grad_(True)
    lengths = mask.sum(-1)
    s = torch.exp(((y - old) * mask).sum(-1) / lengths.clamp(min=1))
    nonempty = lengths > 0
    objective = -(advantages[:, 0] * s)[nonempty].sum() / nonempty.sum().clamp(min=1)
    (expected,) = torch.autograd.grad(objective, y)
    torch.testing.assert_close(gradient, expected, atol=1e-10, rtol=1e-8)


# --------------------------------------------------------------------------
# cispo and reinforce
# --------------------------------------------------------------------------


def test_cispo_by_hand():
    # ratios 1.5, 0.5; A = 1, -1; logprobs -1, -2
    old = torch.tensor([[-1.0 - math.log(1.5), -2.0 - math.log(0.5)]], dtype=torch.float64)
    logprobs = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    loss, gradient, metrics = run(pl.cispo, logprobs, old, [[1.0, -1.0]])
    # weights clip(r, -, 1.28) = 1.28, 0.5; loss -w A logp = 1.28, -1.0 -> mean 0.14
    assert loss == pytest.approx(0.14)
    # every token keeps a gradient: -w A / 2
    assert gradient == pytest.approx([-0.64, 0.25])
    assert metrics["clip_frac_high"] == pytest.approx(0.5) and metrics["clip_frac_low"] == 0.0

    loss, gradient, metrics = run(pl.cispo, logprobs, old, [[1.0, -1.0]], clip_eps_low=0.2)
    # the 0.5 weight rises to 0.8: loss -0.8 * -1 * -2 = -1.6 -> mean (1.28 - 1.6) / 2
    assert loss == pytest.approx(-0.16)
    assert gradient == pytest.approx([-0.64, 0.4])
    assert metrics["clip_frac_low"] == pytest.approx(0.5)


def test_reinforce_by_hand():
    old = torch.tensor([[-1.0 - math.log(1.5), -2.0 - math.log(0.5)]], dtype=torch.float64)
    logprobs = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    # -A logp with A = 2, -1: 2, -2 -> mean 0; gradient -A / 2
    loss, gradient, _ = run(pl.reinforce, logprobs, old, [[2.0, -1.0]])
    assert loss == pytest.approx(0.0) and gradient == pytest.approx([-1.0, 0.5])
    # importance weights 1.5, 0.5: 3, -1 -> mean 1; gradient -w A / 2
    loss, gradient, _ = run(pl.reinforce, logprobs, old, [[2.0, -1.0]], importance_weight=True)
    assert loss == pytest.approx(1.0) and gradient == pytest.approx([-1.5, 0.25])
    # truncated at 1.2: 2.4, -1 -> mean 0.7
    loss, gradient, metrics = run(
        pl.reinforce, logprobs, old, [[2.0, -1.0]], importance_weight=True, max_importance_weight=1.2
    )
    assert loss == pytest.approx(0.7) and gradient == pytest.approx([-1.2, 0.25])
    assert metrics["clip_frac"] == pytest.approx(0.5)


def test_reinforce_refuses_a_truncation_it_would_not_use():
    logprobs, old = tokens_with_ratios([1.0])
    with pytest.raises(ValueError, match=r"only used with importance_weight=True.*got 2.0"):
        run(pl.reinforce, logprobs, old, [[1.0]], max_importance_weight=2.0)


# --------------------------------------------------------------------------
# Shared contract
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(NAMES))
@pytest.mark.parametrize("agg_name", sorted(AGGREGATIONS))
def test_empty_rows_and_garbage_padding_give_finite_zero_contributions(name, agg_name):
    # row 0 has two policy tokens; row 1 is empty; padding carries -inf / nan log-probs.
    logprobs = torch.tensor([[-1.0, -0.5, float("-inf")], [float("nan"), float("-inf"), 0.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -0.4, float("-inf")], [-1.0, float("nan"), 0.0]])
    advantages = torch.tensor([[1.0, -1.0, float("nan")], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    loss, metrics = NAMES[name](
        logprobs=logprobs, old_logprobs=old, advantages=advantages, response_mask=mask,
        loss_agg=AGGREGATIONS[agg_name],
    )
    (gradient,) = torch.autograd.grad(loss, logprobs)
    assert torch.isfinite(loss)
    assert torch.isfinite(gradient).all()
    assert gradient[0, 2] == 0 and (gradient[1] == 0).all()
    for key, value in metrics.items():
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad, key
        assert math.isfinite(float(value)), key

    # an all-empty batch: loss and gradient exactly 0
    loss, metrics = NAMES[name](
        logprobs=logprobs, old_logprobs=old, advantages=advantages, response_mask=torch.zeros(2, 3),
        loss_agg=AGGREGATIONS[agg_name],
    )
    (gradient,) = torch.autograd.grad(loss, logprobs)
    assert loss.item() == 0.0 and (gradient == 0).all()
    assert all(math.isfinite(float(v)) for v in metrics.values())


@pytest.mark.parametrize("name", sorted(NAMES))
def test_on_policy_metrics_and_an_unbound_loss_agg(name):
    logprobs, old = tokens_with_ratios([1.0, 1.0, 1.0])
    _, _, metrics = run(NAMES[name], logprobs, old, [[1.0, -1.0, 0.5]])
    assert metrics["approx_kl"] == pytest.approx(0.0, abs=1e-12)
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    assert metrics["clip_frac"] == 0.0
    with pytest.raises(TypeError, match=r"loss_agg must be a callable .*got str 'token-mean'"):
        run(NAMES[name], logprobs, old, [[1.0, -1.0, 0.5]], loss_agg="token-mean")


def test_mismatched_shapes_list_every_input():
    logprobs, old = tokens_with_ratios([1.0, 1.0])
    with pytest.raises(ValueError, match=r"'ppo_clip': every input must be the same \[B, T\]; .*advantages \(1, 3\)"):
        run(pl.ppo_clip, logprobs, old, [[1.0, 1.0, 1.0]])
