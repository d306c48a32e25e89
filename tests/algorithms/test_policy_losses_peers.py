"""The policy losses peers ship (verl's names) and ppo_clip's two-sided clipping.

Each loss is checked three ways: numbers derived by hand, a literal per-token
transcription of the published formula compared on random masked batches
(the conformance tests), and the shared contract every loss keeps (finite
with garbage padding, exact zeros for empty rows, on-policy metrics).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import rltk
from rltk.algorithms import aggregation as agg
from rltk.algorithms import policy_losses as pl

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None)

NAMES = {
    "sapo": pl.sapo, "gpg": pl.gpg, "clip_cov": pl.clip_cov, "kl_cov": pl.kl_cov, "geo_mean": pl.geo_mean,
    "dppo_tv": pl.dppo_tv, "dppo_kl": pl.dppo_kl, "dro": pl.dro,
}
REQUIRED = {"dro": {"beta": 0.1}}
AGGREGATIONS = {
    "token-mean": agg.token_mean,
    "seq-mean-token-sum": agg.seq_mean_token_sum,
    "seq-mean-token-mean": agg.seq_mean_token_mean,
    "seq-mean-token-sum-norm": agg.seq_mean_token_sum_norm,
}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_every_loss_is_registered_under_verls_name_with_a_formula_summary(name):
    entry = {e.name: e for e in rltk.list_components("policy_loss")}[name]
    assert entry.obj is NAMES[name]
    assert entry.plugin == "rltk:policy_losses"
    doc = NAMES[name].__doc__
    assert "Paper" in doc and "arXiv:" in doc and "Shape:" in doc


def f64(rows):
    return torch.tensor(rows, dtype=torch.float64)


def run(fn, logprobs, old_logprobs, advantages, mask=None, loss_agg=agg.token_mean, **kwargs):
    """(loss, gradient wrt logprobs, metrics as floats) of one call on float64 inputs."""
    logprobs = f64(logprobs).requires_grad_(True) if not isinstance(logprobs, torch.Tensor) else logprobs
    old_logprobs = f64(old_logprobs) if not isinstance(old_logprobs, torch.Tensor) else old_logprobs
    advantages = f64(advantages) if not isinstance(advantages, torch.Tensor) else advantages
    mask = torch.ones_like(old_logprobs) if mask is None else torch.as_tensor(mask, dtype=torch.float64)
    loss, metrics = fn(
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, response_mask=mask,
        loss_agg=loss_agg, **kwargs,
    )
    (gradient,) = torch.autograd.grad(loss, logprobs)
    return loss.item(), gradient, {k: float(v) for k, v in metrics.items()}


def with_ratios(log_ratios, old=-1.0):
    """(logprobs requiring grad, old_logprobs) with logprobs - old_logprobs = log_ratios."""
    old_logprobs = torch.full((len(log_ratios), len(log_ratios[0])), old, dtype=torch.float64)
    return (old_logprobs + f64(log_ratios)).requires_grad_(True), old_logprobs


# --------------------------------------------------------------------------
# ppo_clip: two-sided clipping
# --------------------------------------------------------------------------


def test_two_sided_clip_bounds_a_negative_advantage_ratio_from_above():
    # ratios 5, 3, 1.5 with A = -1, -1, +1; delta 4 (eps 0.2)
    logprobs, old = with_ratios([[math.log(5.0), math.log(3.0), math.log(1.5)]])
    loss, gradient, metrics = run(pl.ppo_clip, logprobs, old, [[-1.0, -1.0, 1.0]], clip_delta=4.0)
    # per token: max(min(5, 4), 1.2) = 4; max(3, 1.2) = 3; max(-1.5, -1.2) = -1.2 -> mean 5.8 / 3
    assert loss == pytest.approx(5.8 / 3)
    # beyond delta no gradient; below it d(-A rho)/dlogp = rho; the positive token is clipped
    assert gradient[0].tolist() == pytest.approx([0.0, 1.0, 0.0])
    assert metrics["dual_clip_frac"] == pytest.approx(1 / 3)
    # without it the first token's loss (and gradient) grow with the ratio
    loss, gradient, _ = run(pl.ppo_clip, logprobs, old, [[-1.0, -1.0, 1.0]])
    assert loss == pytest.approx(6.8 / 3) and gradient[0, 0].item() == pytest.approx(5 / 3)


@SETTINGS
@given(seed=st.integers(0, 2**30), delta=st.floats(1.3, 6.0), eps_high=st.sampled_from([0.2, 0.28]))
def test_two_sided_clip_equals_the_dual_clip_with_the_same_bound(seed, delta, eps_high):
    logprobs, old, advantages, mask = random_tokens(seed, 4, 6, spread=2.0)
    kwargs = {"clip_eps_high": eps_high, "loss_agg": agg.seq_mean_token_mean}
    a = run(pl.ppo_clip, logprobs.clone().requires_grad_(True), old, advantages, mask, clip_delta=delta, **kwargs)
    b = run(pl.ppo_clip, logprobs.clone().requires_grad_(True), old, advantages, mask, dual_clip_c=delta, **kwargs)
    assert a[0] == pytest.approx(b[0], abs=1e-12)
    torch.testing.assert_close(a[1], b[1], atol=1e-12, rtol=0)
    assert a[2] == pytest.approx(b[2])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"clip_delta": 1.2}, r"clip_delta must be > 1 \+ clip_eps_high = 1.2 .*got 1.2"),
        ({"clip_delta": 1.25, "clip_eps_high": 0.28}, r"> 1 \+ clip_eps_high = 1.28 .*got 1.25"),
        ({"clip_delta": 4.0, "dual_clip_c": 3.0}, r"set clip_delta .* or dual_clip_c, not both"),
    ],
)
def test_two_sided_clip_rejects_bounds_that_would_touch_the_trust_region(kwargs, message):
    logprobs, old = with_ratios([[0.0]])
    with pytest.raises(ValueError, match=message):
        run(pl.ppo_clip, logprobs, old, [[1.0]], **kwargs)


# --------------------------------------------------------------------------
# Hand-derived numbers
# --------------------------------------------------------------------------


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def test_sapo_by_hand():
    # On-policy the gate is (4/tau) * 1/2 = 2/tau and its gradient weight 1: the plain policy gradient.
    logprobs, old = with_ratios([[0.0, 0.0, math.log(2.0)]])
    loss, gradient, metrics = run(pl.sapo, logprobs, old, [[1.0, -2.0, -1.0]])
    # tokens: -2 * 1 / 1.0 = -2;  -2 * (-2) / 1.05;  ratio 2, A = -1, tau 1.05: (4 / 1.05) sigmoid(1.05)
    third = (4 / 1.05) * sigmoid(1.05)
    assert loss == pytest.approx((-2.0 + 4 / 1.05 + third) / 3)
    s = sigmoid(1.05)
    # d/dlogp of -A f(rho) = -A * 4 s (1 - s) * rho
    assert gradient[0].tolist() == pytest.approx([-1 / 3, 2 / 3, 4 * s * (1 - s) * 2 / 3])
    assert metrics["clip_frac"] == 0.0
    assert metrics["soft_gate_mean"] == pytest.approx((1 + 1 + 4 * s * (1 - s)) / 3)


def test_gpg_loss_is_minus_advantage_times_logprob():
    logprobs = f64([[-1.0, -2.0]]).requires_grad_(True)
    old = f64([[-0.5, -2.5]])  # ignored by the loss
    loss, gradient, metrics = run(pl.gpg, logprobs, old, [[2.0, -1.0]])
    assert loss == pytest.approx((2.0 - 2.0) / 2) and gradient[0].tolist() == pytest.approx([-1.0, 0.5])
    assert metrics["clip_frac"] == 0.0 and metrics["ratio_mean"] == pytest.approx((math.exp(-0.5) + math.exp(0.5)) / 2)


# A = 3, -1, -1, -1 (mean 0) and logprobs -1, -2, -2, -3 (mean -2): covariances 3, 0, 0, 1.
COV_ADVANTAGES = [[3.0, -1.0, -1.0, -1.0]]
COV_LOGPROBS = [-1.0, -2.0, -2.0, -3.0]
COV_LOG_RATIOS = [0.1, 0.0, 0.0, -0.1]


def cov_inputs():
    logprobs = f64([COV_LOGPROBS]).requires_grad_(True)
    old = f64([[lp - d for lp, d in zip(COV_LOGPROBS, COV_LOG_RATIOS)]])
    return logprobs, old


def test_kl_cov_by_hand():
    logprobs, old = cov_inputs()
    # k = max(1, floor(0.25 * 4)) = 1 token: the first (covariance 3), penalised by 0.1 * |0.1|
    loss, gradient, metrics = run(pl.kl_cov, logprobs, old, COV_ADVANTAGES, kl_cov_ratio=0.25)
    r0, r3 = math.exp(0.1), math.exp(-0.1)
    assert loss == pytest.approx((-3 * r0 + 0.1 * 0.1 + 1 + 1 + r3) / 4)
    # -A rho + 0.1 sign(d) on the first token; -A rho elsewhere (no clipping at all)
    assert gradient[0].tolist() == pytest.approx([(-3 * r0 + 0.1) / 4, 0.25, 0.25, r3 / 4])
    assert metrics["clip_frac"] == pytest.approx(0.25)
    # a ratio that keeps k at 1 still penalises only the largest covariance
    assert run(pl.kl_cov, logprobs, old, COV_ADVANTAGES, kl_cov_ratio=0.3)[0] == pytest.approx(loss)
    # 0.5 * 4 = 2 tokens: the first and the last (covariance 1), |-0.1| penalty
    loss2, gradient2, _ = run(pl.kl_cov, logprobs, old, COV_ADVANTAGES, kl_cov_ratio=0.5)
    assert loss2 == pytest.approx(loss + 0.1 * 0.1 / 4)
    assert gradient2[0, 3].item() == pytest.approx((r3 - 0.1) / 4)


def test_clip_cov_detaches_the_tokens_in_the_covariance_window():
    logprobs, old = cov_inputs()
    # window (1, 5) holds only the first token (covariance 3; the last has 1, not > 1)
    loss, gradient, metrics = run(pl.clip_cov, logprobs, old, COV_ADVANTAGES, clip_cov_ratio=0.25)
    r0, r3 = math.exp(0.1), math.exp(-0.1)
    # token 0 chosen: loss and gradient 0; tokens 1, 2: -A rho = 1; token 3 (ratio 0.905, in range): r3
    assert loss == pytest.approx((1 + 1 + r3) / 4)
    assert gradient[0].tolist() == pytest.approx([0.0, 0.25, 0.25, r3 / 4])
    assert metrics["cov_clip_frac"] == pytest.approx(0.25) and metrics["clip_frac"] == pytest.approx(0.25)
    # the window (0.5, 2) holds the last token instead; the first trains as PPO
    loss, gradient, metrics = run(pl.clip_cov, logprobs, old, COV_ADVANTAGES, clip_cov_lb=0.5, clip_cov_ub=2.0)
    assert gradient[0].tolist() == pytest.approx([-3 * r0 / 4, 0.25, 0.25, 0.0])
    assert metrics["cov_clip_frac"] == pytest.approx(0.25)


def test_clip_cov_never_chooses_a_token_ppo_already_clipped():
    # the first token has the largest covariance but its ratio e^0.3 > 1.2 with A > 0
    logprobs = f64([COV_LOGPROBS]).requires_grad_(True)
    old = f64([[COV_LOGPROBS[0] - 0.3, *COV_LOGPROBS[1:]]])
    _, gradient, metrics = run(pl.clip_cov, logprobs, old, COV_ADVANTAGES, clip_cov_ratio=1.0)
    assert metrics["cov_clip_frac"] == 0.0 and metrics["clip_frac_high"] == pytest.approx(0.25)
    assert gradient[0].tolist() == pytest.approx([0.0, 0.25, 0.25, 0.25])


def test_clip_cov_draws_uniformly_among_candidates_and_never_a_ppo_clipped_token():
    # eight candidates in the window (covariances 1.38 and 2.72), one PPO-clipped token with a larger one (3.16)
    A = f64([[2.0, 2.0, 2.0, 2.0, -2.0, -2.0, -2.0, -2.0, 2.0]])
    lp = [-1.0] * 4 + [-3.0] * 4 + [0.0]
    logprobs = f64([lp]).requires_grad_(True)
    old = f64([lp[:8] + [-0.5]])  # last token: ratio e^0.5 with A > 0, clipped by PPO
    counts = torch.zeros(9)
    for seed in range(200):
        _, gradient, metrics = run(pl.clip_cov, logprobs, old, A, clip_cov_ratio=0.12, clip_cov_ub=10.0, seed=seed)
        chosen = (gradient[0] == 0) & (torch.arange(9) < 8)
        assert chosen.sum() == 1  # floor(0.12 * 9) = 1
        counts += chosen.double()
    assert counts[8] == 0
    assert counts.sum() == 200 and counts[:8].min() >= 10  # every candidate gets drawn
    # the same seed draws the same token
    a = run(pl.clip_cov, logprobs, old, A, clip_cov_ratio=0.12, clip_cov_ub=10.0, seed=7)[1]
    b = run(pl.clip_cov, logprobs, old, A, clip_cov_ratio=0.12, clip_cov_ub=10.0, seed=7)[1]
    assert torch.equal(a, b)


def test_geo_mean_by_hand():
    # response 0: log-ratios 0.1, 0.5 with A = 1: 0.5 is clipped to 0.4 -> s0 = exp(0.25)
    # response 1: log-ratios -0.6, 0.2, 0.0 with A = -1: -0.6 is clipped to -0.4 -> s1 = exp(-0.2 / 3)
    logprobs, old = with_ratios([[0.1, 0.5, 0.0], [-0.6, 0.2, 0.0]])
    mask = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    advantages = [[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]]
    loss, gradient, metrics = run(pl.geo_mean, logprobs, old, advantages, mask, loss_agg=agg.seq_mean_token_mean)
    s0, s1 = math.exp(0.25), math.exp(-0.2 / 3)
    assert loss == pytest.approx((-s0 + s1) / 2)
    # gradient -A_i s_i / |y_i| / G on unclipped tokens
    expected = [[-s0 / 2 / 2, 0.0, 0.0], [0.0, s1 / 3 / 2, s1 / 3 / 2]]
    torch.testing.assert_close(gradient, f64(expected))
    assert metrics["clip_frac_high"] == pytest.approx(1 / 5) and metrics["clip_frac_low"] == pytest.approx(1 / 5)
    assert metrics["seq_ratio_mean"] == pytest.approx((s0 + s1) / 2)


def test_dppo_tv_bounds_the_probability_change_not_the_ratio():
    # p_old -> p:  0.5 -> 0.7 (A=+1: +0.2 > 0.15, masked);  0.5 -> 0.7 (A=-1: kept)
    #              0.5 -> 0.3 (A=-1: -0.2 < -0.15, masked); 0.01 -> 0.05 (A=+1: ratio 5 but +0.04, kept)
    p_old, p = [0.5, 0.5, 0.5, 0.01], [0.7, 0.7, 0.3, 0.05]
    logprobs = f64([[math.log(x) for x in p]]).requires_grad_(True)
    old = f64([[math.log(x) for x in p_old]])
    loss, gradient, metrics = run(pl.dppo_tv, logprobs, old, [[1.0, -1.0, -1.0, 1.0]])
    assert loss == pytest.approx((1.4 * math.log(0.7) - 5.0 * math.log(0.05)) / 4)
    # kept tokens: -A * w with the stop-gradient weight w = rho
    assert gradient[0].tolist() == pytest.approx([0.0, 1.4 / 4, 0.0, -5.0 / 4])
    assert metrics["clip_frac_high"] == pytest.approx(0.25) and metrics["clip_frac_low"] == pytest.approx(0.25)
    # truncating the weight at 2 caps the rare token's weight
    loss, gradient, metrics = run(pl.dppo_tv, logprobs, old, [[1.0, -1.0, -1.0, 1.0]], max_importance_weight=2.0)
    assert gradient[0, 3].item() == pytest.approx(-2.0 / 4) and metrics["truncated_frac"] == pytest.approx(0.25)


def binary_kl(p_old, p):
    return p_old * math.log(p_old / p) + (1 - p_old) * math.log((1 - p_old) / (1 - p))


def test_dppo_kl_masks_by_the_binary_kl():
    # 0.5 -> 0.7: D = 0.0872 > 0.05 (A=+1 masked); 0.5 -> 0.55: D = 0.0050 (kept);
    # 0.5 -> 0.3: D = 0.0872, p fell, A=+1: kept (moving against its advantage is always allowed)
    assert binary_kl(0.5, 0.7) == pytest.approx(0.0871773, abs=1e-6)
    assert binary_kl(0.5, 0.55) == pytest.approx(0.0050252, abs=1e-6)
    p_old, p = [0.5, 0.5, 0.5], [0.7, 0.55, 0.3]
    logprobs = f64([[math.log(x) for x in p]]).requires_grad_(True)
    old = f64([[math.log(x) for x in p_old]])
    loss, gradient, metrics = run(pl.dppo_kl, logprobs, old, [[1.0, 1.0, 1.0]])
    assert loss == pytest.approx((-1.1 * math.log(0.55) - 0.6 * math.log(0.3)) / 3)
    assert gradient[0].tolist() == pytest.approx([0.0, -1.1 / 3, -0.6 / 3])
    assert metrics["clip_frac_high"] == pytest.approx(1 / 3)


def test_dro_by_hand():
    logprobs = f64([[-1.0, -2.0]]).requires_grad_(True)
    old = f64([[-1.5, -2.0]])
    loss, gradient, _ = run(pl.dro, logprobs, old, [[2.0, -1.0]], beta=0.4)
    # -(A logp - 0.2 d^2): -(-2 - 0.2 * 0.25) = 2.05;  -(2 - 0) = -2 -> mean 0.025
    assert loss == pytest.approx(0.025)
    # -(A - beta d): -(2 - 0.4 * 0.5) = -1.8;  1 -> / 2
    assert gradient[0].tolist() == pytest.approx([-0.9, 0.5])


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("sapo", {"tau_neg": 0.0}, r"'sapo': tau_neg must be a number > 0 \(the paper uses 1.05\), got 0.0"),
        ("clip_cov", {"clip_cov_lb": 5.0}, r"clip_cov_lb must be < clip_cov_ub .*clip_cov_lb=5.0, clip_cov_ub=5.0"),
        ("clip_cov", {"clip_cov_ratio": 0}, r"'clip_cov': clip_cov_ratio must be a fraction of the tokens in \(0, 1\] .*got 0"),
        ("kl_cov", {"kl_cov_ratio": 1.5}, r"'kl_cov': kl_cov_ratio must be a fraction of the tokens in \(0, 1\] .*got 1.5"),
        ("kl_cov", {"ppo_kl_coef": -1.0}, r"'kl_cov': ppo_kl_coef must be >= 0, got -1.0"),
        ("geo_mean", {"clip_eps_low": -0.4}, r"'geo_mean': clip_eps_low must be >= 0, got -0.4"),
        ("dppo_tv", {"max_importance_weight": 0.0}, r"'dppo_tv': max_importance_weight must be a number > 0"),
        ("dro", {"beta": 0.0}, r"'dro': beta must be a number > 0 \(e.g. 0.05"),
    ],
)
def test_bad_arguments_name_the_argument_and_the_value(name, kwargs, message):
    logprobs, old = with_ratios([[0.0]])
    with pytest.raises(ValueError, match=message):
        run(NAMES[name], logprobs, old, [[1.0]], **{**REQUIRED.get(name, {}), **kwargs})


# --------------------------------------------------------------------------
# Conformance: a literal per-token transcription of each published formula
# --------------------------------------------------------------------------


def random_tokens(seed, B, T, spread=1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 4 - 0.05
    logprobs = (old + (torch.rand(B, T, generator=g, dtype=dtype) * 2 - 1) * spread).clamp(max=-1e-3)
    advantages = torch.randn(B, T, generator=g, dtype=dtype)
    advantages[torch.rand(B, T, generator=g) < 0.15] = 0.0
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).to(dtype)
    return logprobs, old, advantages, mask


def reference(name, logprobs, old, advantages, mask, **kw):
    """The published per-token (or per-sequence) loss, by plain Python loops; token-mean aggregation
    except geo_mean (mean over non-empty responses)."""
    B, T = mask.shape
    lp, ol, A, m = (x.tolist() for x in (logprobs, old, advantages, mask))
    if name == "geo_mean":
        eps = kw.get("clip_eps_low", 0.4)
        total, n_seq = 0.0, 0
        for i in range(B):
            idx = [t for t in range(T) if m[i][t]]
            if not idx:
                continue
            ds = []
            for t in idx:
                d = lp[i][t] - ol[i][t]
                dc = min(max(d, -eps), eps)
                sgn = (A[i][t] > 0) - (A[i][t] < 0)
                ds.append(sgn * min(sgn * d, sgn * dc))
            s = math.exp(sum(ds) / len(idx))
            total += -(sum(A[i][t] for t in idx) / len(idx)) * s
            n_seq += 1
        return total / max(n_seq, 1)
    losses = []
    for i in range(B):
        for t in range(T):
            if not m[i][t]:
                continue
            a, logp, logp_old = A[i][t], lp[i][t], ol[i][t]
            r = math.exp(logp - logp_old)
            if name == "sapo":
                tau = kw.get("tau_pos", 1.0) if a > 0 else kw.get("tau_neg", 1.05)
                losses.append(-(4 / tau) * sigmoid(tau * (r - 1)) * a)
            elif name == "gpg":
                losses.append(-a * logp)
            elif name == "dro":
                losses.append(-(a * logp - 0.5 * kw["beta"] * (logp - logp_old) ** 2))
            elif name in ("dppo_tv", "dppo_kl"):
                delta = kw.get("clip_eps_low", 0.15 if name == "dppo_tv" else 0.05)
                p, p_old = math.exp(logp), math.exp(logp_old)
                if name == "dppo_tv":
                    keep = (p - p_old <= delta) if a > 0 else (p - p_old >= -delta)
                else:
                    d = binary_kl(p_old, p)
                    keep = (d <= delta or p <= p_old) if a > 0 else (d <= delta or p >= p_old)
                losses.append(-a * min(r, 20.0) * logp if keep else 0.0)
            else:
                raise AssertionError(name)
    return sum(losses) / max(len(losses), 1)


CONFORMANCE = {
    "sapo": {}, "gpg": {}, "dro": {"beta": 0.3}, "dppo_tv": {}, "dppo_kl": {}, "geo_mean": {},
}


@SETTINGS
@given(seed=st.integers(0, 2**30), B=st.integers(1, 5), T=st.integers(1, 6), name=st.sampled_from(sorted(CONFORMANCE)))
def test_losses_match_a_literal_transcription_of_the_published_formula(seed, B, T, name):
    logprobs, old, advantages, mask = random_tokens(seed, B, T)
    kwargs = CONFORMANCE[name]
    loss_agg = agg.seq_mean_token_mean if name == "geo_mean" else agg.token_mean
    loss, _, _ = run(NAMES[name], logprobs.clone().requires_grad_(True), old, advantages, mask, loss_agg, **kwargs)
    assert loss == pytest.approx(reference(name, logprobs, old, advantages, mask, **kwargs), rel=1e-9, abs=1e-12)


def reference_kl_cov(logprobs, old, advantages, mask, ratio, coef):
    """verl's KL-Cov by its loop over flat valid tokens."""
    on = mask > 0
    a, lp = advantages[on], logprobs[on]
    cov = (a - a.mean()) * (lp - lp.mean())
    k = max(1, int(len(cov) * ratio))
    top = set(torch.topk(cov, k).indices.tolist())
    d = (logprobs - old)[on]
    losses = [-a[j] * math.exp(d[j]) + (coef * abs(d[j]) if j in top else 0.0) for j in range(len(cov))]
    return float(sum(losses) / len(losses))


@SETTINGS
@given(seed=st.integers(0, 2**30), B=st.integers(1, 5), T=st.integers(1, 6), ratio=st.sampled_from([0.01, 0.2, 0.5]))
def test_kl_cov_matches_the_reference_selection(seed, B, T, ratio):
    logprobs, old, advantages, mask = random_tokens(seed, B, T)
    on = mask > 0
    a, lp = advantages[on], logprobs[on]
    cov = ((a - a.mean()) * (lp - lp.mean())).sort(descending=True).values
    k = max(1, int(len(cov) * ratio))
    # which of two tied tokens gets the penalty is arbitrary (torch.topk's choice) in both
    assume(len(cov) > 0 and (k == len(cov) or (cov[k - 1] - cov[k]).abs() > 1e-12))
    loss, _, _ = run(pl.kl_cov, logprobs.clone().requires_grad_(True), old, advantages, mask,
                     kl_cov_ratio=ratio, ppo_kl_coef=0.7)
    assert loss == pytest.approx(reference_kl_cov(logprobs, old, advantages, mask, ratio, 0.7), rel=1e-9, abs=1e-12)


@SETTINGS
@given(seed=st.integers(0, 2**30), B=st.integers(1, 5), T=st.integers(1, 6))
def test_clip_cov_with_every_candidate_chosen_detaches_exactly_the_window(seed, B, T):
    logprobs, old, advantages, mask = random_tokens(seed, B, T)
    x = logprobs.clone().requires_grad_(True)
    _, gradient, _ = run(pl.clip_cov, x, old, advantages, mask, clip_cov_ratio=1.0, clip_cov_lb=0.1, clip_cov_ub=2.0)
    on = mask > 0
    a, lp = advantages[on], logprobs[on]
    cov = torch.zeros_like(mask)
    cov[on] = (a - a.mean()) * (lp - lp.mean())
    ratio = (logprobs - old).exp()
    ppo_clipped = ((advantages > 0) & (ratio > 1.2)) | ((advantages < 0) & (ratio < 0.8))
    window = on & ~ppo_clipped & (cov > 0.1) & (cov < 2.0)
    expected = torch.where(~on | ppo_clipped | window, 0.0, -advantages * ratio / on.sum().clamp(min=1))
    torch.testing.assert_close(gradient, expected, atol=1e-12, rtol=1e-9)


# --------------------------------------------------------------------------
# Gradient properties
# --------------------------------------------------------------------------


@SETTINGS
@given(seed=st.integers(0, 2**30), tau_pos=st.floats(0.5, 3.0), tau_neg=st.floats(0.5, 3.0))
def test_sapo_gradient_is_the_soft_weighted_policy_gradient(seed, tau_pos, tau_neg):
    logprobs, old, advantages, mask = random_tokens(seed, 3, 5, spread=1.5)
    x = logprobs.clone().requires_grad_(True)
    _, gradient, _ = run(pl.sapo, x, old, advantages, mask, tau_pos=tau_pos, tau_neg=tau_neg)
    ratio = (logprobs - old).exp()
    tau = torch.full_like(advantages, tau_neg).masked_fill(advantages > 0, tau_pos)
    s = torch.sigmoid(tau * (ratio - 1))
    expected = torch.where(mask > 0, -advantages * 4 * s * (1 - s) * ratio / mask.sum().clamp(min=1), 0.0)
    torch.testing.assert_close(gradient, expected, atol=1e-12, rtol=1e-9)
    # never a hard zero: every policy token with A != 0 keeps a gradient
    assert (gradient[(mask > 0) & (advantages != 0)] != 0).all()


@SETTINGS
@given(seed=st.integers(0, 2**30), name=st.sampled_from(["dppo_tv", "dppo_kl"]))
def test_dppo_gradient_is_zero_exactly_on_masked_tokens_and_the_weighted_gradient_elsewhere(seed, name):
    logprobs, old, advantages, mask = random_tokens(seed, 4, 5, spread=1.5)
    _, gradient, _ = run(NAMES[name], logprobs.clone().requires_grad_(True), old, advantages, mask)
    n = mask.sum().clamp(min=1)
    ratio = (logprobs - old).exp()
    p, p_old = logprobs.exp(), old.exp()
    for i, t in zip(*torch.nonzero(mask > 0, as_tuple=True)):
        a, pi, po = advantages[i, t].item(), p[i, t].item(), p_old[i, t].item()
        if name == "dppo_tv":
            keep = (pi - po <= 0.15) if a > 0 else (pi - po >= -0.15)
        else:
            d = binary_kl(po, pi)
            keep = (d <= 0.05 or pi <= po) if a > 0 else (d <= 0.05 or pi >= po)
        expected = -a * min(ratio[i, t].item(), 20.0) / n.item() if keep else 0.0
        assert gradient[i, t].item() == pytest.approx(expected, abs=1e-12)


@SETTINGS
@given(seed=st.integers(0, 2**30))
def test_geo_mean_gradient_is_the_sequence_objectives_gradient(seed):
    """Without clipping, the per-token form under seq-mean-token-mean has exactly the gradient of
    -(1/G) sum_i A_i exp(mean_t log-ratio) with one advantage per response."""
    logprobs, old, advantages, mask = random_tokens(seed, 4, 5, spread=0.3)
    per_response = advantages[:, :1].expand_as(advantages).contiguous()
    x = logprobs.clone().requires_grad_(True)
    _, gradient, _ = run(pl.geo_mean, x, old, per_response, mask, loss_agg=agg.seq_mean_token_mean, clip_eps_low=10.0)
    y = logprobs.clone().requires_grad_(True)
    lengths = mask.sum(-1)
    s = torch.exp(((y - old) * mask).sum(-1) / lengths.clamp(min=1))
    nonempty = lengths > 0
    objective = -(per_response[:, 0] * s)[nonempty].sum() / nonempty.sum().clamp(min=1)
    (expected,) = torch.autograd.grad(objective, y)
    torch.testing.assert_close(gradient, expected, atol=1e-12, rtol=1e-9)


ROW_LOCAL = ["sapo", "gpg", "geo_mean", "dppo_tv", "dppo_kl", "dro"]


@SETTINGS
@given(seed=st.integers(0, 2**30), B=st.integers(2, 6), cut_seed=st.integers(0, 1000))
def test_row_local_losses_accumulate_exactly_over_micro_batches(seed, B, cut_seed):
    logprobs, old, advantages, mask = random_tokens(seed, B, 5)
    cut = int(torch.randint(1, B, (1,), generator=torch.Generator().manual_seed(cut_seed)))
    totals = agg.loss_agg_normalisers(mask)
    for name in ROW_LOCAL:
        for agg_name, fn in AGGREGATIONS.items():
            kwargs = REQUIRED.get(name, {})
            whole_x = logprobs.clone().requires_grad_(True)
            whole, _ = NAMES[name](logprobs=whole_x, old_logprobs=old, advantages=advantages, response_mask=mask,
                                   loss_agg=fn, **kwargs)
            whole.backward()
            micro_x = logprobs.clone().requires_grad_(True)
            bound = functools.partial(fn, **totals)
            summed = 0.0
            for rows in (slice(0, cut), slice(cut, B)):
                micro, _ = NAMES[name](logprobs=micro_x[rows], old_logprobs=old[rows], advantages=advantages[rows],
                                       response_mask=mask[rows], loss_agg=bound, **kwargs)
                micro.backward()
                summed += micro.item()
            assert summed == pytest.approx(whole.item(), abs=1e-12), (name, agg_name)
            torch.testing.assert_close(micro_x.grad, whole_x.grad, atol=1e-12, rtol=0, msg=f"{name} {agg_name}")


# --------------------------------------------------------------------------
# The shared contract of every policy loss
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(NAMES))
@pytest.mark.parametrize("agg_name", sorted(AGGREGATIONS))
def test_empty_rows_and_garbage_padding_give_finite_zero_contributions(name, agg_name):
    logprobs = torch.tensor([[-1.0, -0.5, float("-inf")], [float("nan"), float("-inf"), 0.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -0.4, float("-inf")], [-1.0, float("nan"), 0.0]])
    advantages = torch.tensor([[1.0, -1.0, float("nan")], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    kwargs = REQUIRED.get(name, {})
    loss, metrics = NAMES[name](logprobs=logprobs, old_logprobs=old, advantages=advantages, response_mask=mask,
                                loss_agg=AGGREGATIONS[agg_name], **kwargs)
    (gradient,) = torch.autograd.grad(loss, logprobs)
    assert torch.isfinite(loss) and torch.isfinite(gradient).all()
    assert gradient[0, 2] == 0 and (gradient[1] == 0).all()
    for key, value in metrics.items():
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad, key
        assert math.isfinite(float(value)), key

    loss, metrics = NAMES[name](logprobs=logprobs, old_logprobs=old, advantages=advantages,
                                response_mask=torch.zeros(2, 3), loss_agg=AGGREGATIONS[agg_name], **kwargs)
    (gradient,) = torch.autograd.grad(loss, logprobs)
    assert loss.item() == 0.0 and (gradient == 0).all()
    assert all(math.isfinite(float(v)) for v in metrics.values())


@pytest.mark.parametrize("name", sorted(NAMES))
def test_every_loss_returns_the_shared_metrics_and_on_policy_values(name):
    logprobs, old = with_ratios([[0.0, 0.0, 0.0]])
    _, gradient, metrics = run(NAMES[name], logprobs, old, [[1.0, -1.0, 0.5]], **REQUIRED.get(name, {}))
    assert {"approx_kl", "ratio_mean", "clip_frac"} <= set(metrics)
    assert metrics["approx_kl"] == pytest.approx(0.0, abs=1e-12)
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    if name not in ("kl_cov", "clip_cov"):  # their covariance rules pick tokens whatever the ratio
        assert metrics["clip_frac"] == 0.0
    if name in ("sapo", "dppo_tv", "dppo_kl", "dro", "geo_mean"):
        # on-policy each is the plain policy gradient -A grad logp (geo_mean: per response of one... here
        # one response of 3 tokens with mean advantage 1/6, so -1/6 * 1/3 on each token)
        expected = [-1 / 18] * 3 if name == "geo_mean" else [-1 / 3, 1 / 3, -0.5 / 3]
        assert gradient[0].tolist() == pytest.approx(expected)
    with pytest.raises(TypeError, match=r"loss_agg must be a callable .*got str 'token-mean'"):
        run(NAMES[name], logprobs, old, [[1.0, -1.0, 0.5]], loss_agg="token-mean", **REQUIRED.get(name, {}))


def test_mismatched_shapes_list_every_input():
    logprobs, old = with_ratios([[0.0, 0.0]])
    with pytest.raises(ValueError, match=r"'geo_mean': every input must be the same \[B, T\]; .*advantages \(1, 3\)"):
        run(pl.geo_mean, logprobs, old, [[1.0, 1.0, 1.0]])
