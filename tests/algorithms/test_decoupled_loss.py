"""The decoupled PPO objective (AReaL): hand-derived numbers, the published formula, properties, and
that it is the loop's rollout correction applied to the proximal policy, not a second mechanism."""

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
from rltk.algorithms.mismatch import rollout_correction, weighted_loss_agg

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True, database=None)

# every registered builtin loss but the decoupled one itself, with its required arguments
BASE_LOSSES = {
    "ppo_clip": (pl.ppo_clip, {}), "gspo": (pl.gspo, {}), "cispo": (pl.cispo, {}),
    "reinforce": (pl.reinforce, {}), "sapo": (pl.sapo, {}), "gpg": (pl.gpg, {}),
    "clip_cov": (pl.clip_cov, {"seed": 0}), "kl_cov": (pl.kl_cov, {}), "geo_mean": (pl.geo_mean, {}),
    "dppo_tv": (pl.dppo_tv, {}), "dppo_kl": (pl.dppo_kl, {}), "dro": (pl.dro, {"beta": 0.1}),
}
AGGREGATIONS = {
    "token-mean": agg.token_mean,
    "seq-mean-token-sum": agg.seq_mean_token_sum,
    "seq-mean-token-mean": agg.seq_mean_token_mean,
    "seq-mean-token-sum-norm": agg.seq_mean_token_sum_norm,
}


def f64(rows):
    return torch.tensor(rows, dtype=torch.float64)


def three_policies(r, w, prox=-1.0):
    """(logprobs with grad, proximal, behaviour) with pi/pi_prox = r and pi_prox/pi_behav = w per token."""
    proximal = torch.full((1, len(r)), prox, dtype=torch.float64)
    logprobs = (proximal + f64([r]).log()).requires_grad_(True)
    behaviour = proximal - f64([w]).log()
    return logprobs, proximal, behaviour


def run(fn, logprobs, proximal, behaviour, advantages, mask=None, loss_agg=agg.token_mean, **kwargs):
    mask = torch.ones_like(proximal) if mask is None else mask
    loss, metrics = fn(logprobs=logprobs, old_logprobs=proximal, behaviour_logprobs=behaviour,
                       advantages=f64(advantages), response_mask=mask, loss_agg=loss_agg, **kwargs)
    (gradient,) = torch.autograd.grad(loss, logprobs)
    return loss.item(), gradient[0].tolist(), {k: float(v) for k, v in metrics.items()}


def test_registered_with_formula_and_paper():
    entry = {e.name: e for e in rltk.list_components("policy_loss")}["decoupled_ppo"]
    assert entry.obj is pl.decoupled_ppo and entry.plugin == "rltk:policy_losses"
    assert "arXiv:2505.24298" in pl.decoupled_ppo.__doc__ and "Shape:" in pl.decoupled_ppo.__doc__
    assert "arXiv:2505.24298" in pl.decoupled_loss.__doc__


# --------------------------------------------------------------------------
# Hand-derived values
# --------------------------------------------------------------------------

# token          t1     t2     t3     t4
# r = pi/prox    1.1    1.5    0.5    0.9
# w = prox/behav 2.0    0.5    1.0    4.0
# A              +1     +1     -1     -1
# eps = 0.2, so clip(r) = 1.1, 1.2, 0.8, 0.9
#   t1: max(-1.1, -1.1) = -1.1 (inside)        l = 2.0 * -1.1 = -2.2
#   t2: max(-1.5, -1.2) = -1.2 (clipped high)  l = 0.5 * -1.2 = -0.6
#   t3: max( 0.5,  0.8) =  0.8 (clipped low)   l = 1.0 *  0.8 =  0.8
#   t4: max( 0.9,  0.9) =  0.9 (inside)        l = 4.0 *  0.9 =  3.6
# token-mean: (-2.2 - 0.6 + 0.8 + 3.6) / 4 = 1.6 / 4 = 0.4
# d l_t / d logp_t = -A w r inside the clip (d r / d logp = r), 0 where clipped:
#   t1: -1 * 2 * 1.1 / 4 = -0.55;  t4: +1 * 4 * 0.9 / 4 = 0.9
# standard PPO on the behaviour ratio r * w = 2.2, 0.75, 0.5, 3.6 would clip t1 and keep t2 instead.
R, W, A = [1.1, 1.5, 0.5, 0.9], [2.0, 0.5, 1.0, 4.0], [[1.0, 1.0, -1.0, -1.0]]


def test_decoupled_ppo_hand_derived_value_gradient_and_metrics():
    loss, gradient, metrics = run(pl.decoupled_ppo, *three_policies(R, W), A)
    assert loss == pytest.approx(0.4)
    assert gradient == pytest.approx([-0.55, 0.0, 0.0, 0.9])
    assert metrics["clip_frac"] == pytest.approx(0.5)  # t2 high, t3 low
    assert metrics["behaviour_weight_mean"] == pytest.approx((2.0 + 0.5 + 1.0 + 4.0) / 4)
    # k3 of the weights: w - 1 - log w per token
    k3 = [(w - 1 - math.log(w)) for w in W]
    assert metrics["behaviour_kl"] == pytest.approx(sum(k3) / 4)
    assert metrics["behaviour_dropped_frac"] == 0.0 and metrics["behaviour_truncated_frac"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx(sum(R) / 4)  # ppo_clip's metrics are against the proximal


def test_areal_weight_cap_masks_tokens_above_it():
    # AReaL's behav_imp_weight_cap = 3: t4 (w = 4) gets weight 0 and leaves the mask.
    # Normalised by the kept tokens (rltk's batch-level choice): (-2.2 - 0.6 + 0.8) / 3 = -2/3;
    # by every sampled token (AReaL's loss_mask_count): -2 / 4 = -0.5.
    cap = {"mis": "token", "mis_low": 0.0, "mis_high": 3.0}
    loss, gradient, metrics = run(pl.decoupled_ppo, *three_policies(R, W), A, behaviour_correction=cap)
    assert loss == pytest.approx(-2.0 / 3)
    assert gradient == pytest.approx([-2.2 / 3, 0.0, 0.0, 0.0])
    assert metrics["behaviour_dropped_frac"] == pytest.approx(0.25)
    assert metrics["behaviour_weight_mean"] == pytest.approx((2.0 + 0.5 + 1.0) / 3)
    sampled = functools.partial(agg.token_mean, global_tokens=4)
    loss, gradient, _ = run(pl.decoupled_ppo, *three_policies(R, W), A, loss_agg=sampled, behaviour_correction=cap)
    assert loss == pytest.approx(-0.5)
    assert gradient == pytest.approx([-2.2 / 4, 0.0, 0.0, 0.0])


def test_tis_truncates_the_behaviour_weight():
    # tis=token with cap 2.5: t4's weight 4 -> 2.5: (-2.2 - 0.6 + 0.8 + 0.9 * 2.5) / 4 = 0.25 / 4;
    # t4's gradient 0.9 * 2.5 / 4
    loss, gradient, metrics = run(pl.decoupled_ppo, *three_policies(R, W), A,
                                  behaviour_correction={"tis": "token", "tis_cap": 2.5})
    assert loss == pytest.approx(0.0625)
    assert gradient == pytest.approx([-0.55, 0.0, 0.0, 0.5625])
    assert metrics["behaviour_truncated_frac"] == pytest.approx(0.25)


def test_sequence_rejection_drops_the_whole_response():
    # prod w = 2 * 0.5 * 1 * 4 = 4 > 2: the response is rejected, nothing is trained
    loss, gradient, metrics = run(pl.decoupled_ppo, *three_policies(R, W), A,
                                  behaviour_correction={"rejection": "sequence"})
    assert loss == 0.0 and gradient == [0.0] * 4
    assert metrics["behaviour_dropped_frac"] == 1.0


def matches_the_published_formula(logprobs, proximal, behaviour, advantages, mask, eps, cap):
    """AReaL's decoupled objective, token by token, as written in the paper (sec. 5.2), normalised by the
    sampled tokens: sum_t mask * w_t * max(-A r, -A clip(r)) / n, w_t = 0 where it exceeds the cap."""
    total, n = 0.0, 0
    for b in range(logprobs.shape[0]):
        for t in range(logprobs.shape[1]):
            if mask[b, t] == 0:
                continue
            n += 1
            r = math.exp(float(logprobs[b, t]) - float(proximal[b, t]))
            w = math.exp(float(proximal[b, t]) - float(behaviour[b, t]))
            if cap is not None and w > cap:
                w = 0.0
            a = float(advantages[b, t])
            total += w * max(-a * r, -a * min(max(r, 1 - eps), 1 + eps))
    return total / max(n, 1)


@SETTINGS
@given(seed=st.integers(0, 2**16), cap=st.sampled_from([None, 1.5, 3.0]))
def test_conforms_to_the_published_formula_on_random_batches(seed, cap):
    g = torch.Generator().manual_seed(seed)
    shape = (3, 5)
    proximal = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    behaviour = proximal + torch.randn(shape, generator=g, dtype=torch.float64) * 0.7
    logprobs = proximal + torch.randn(shape, generator=g, dtype=torch.float64) * 0.3
    advantages = torch.randn(shape, generator=g, dtype=torch.float64)
    mask = (torch.rand(shape, generator=g) < 0.8).double()
    n = int(mask.sum())
    correction = None if cap is None else {"mis": "token", "mis_low": 0.0, "mis_high": cap}
    loss, _ = pl.decoupled_ppo(
        logprobs=logprobs, old_logprobs=proximal, behaviour_logprobs=behaviour, advantages=advantages,
        response_mask=mask, loss_agg=functools.partial(agg.token_mean, global_tokens=max(n, 1)),
        behaviour_correction=correction)
    assert float(loss) == pytest.approx(
        matches_the_published_formula(logprobs, proximal, behaviour, advantages, mask, 0.2, cap), abs=1e-9)


# --------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------


def random_batch(seed, shape=(4, 6)):
    g = torch.Generator().manual_seed(seed)
    proximal = -torch.rand(shape, generator=g, dtype=torch.float64) * 4
    logprobs = (proximal + torch.randn(shape, generator=g, dtype=torch.float64) * 0.4).requires_grad_(True)
    behaviour = proximal + torch.randn(shape, generator=g, dtype=torch.float64) * 0.5
    advantages = torch.randn(shape, generator=g, dtype=torch.float64)
    mask = (torch.rand(shape, generator=g) < 0.75).double()
    mask[0, 0] = 1.0
    return logprobs, proximal, behaviour, advantages, mask


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
@pytest.mark.parametrize("name", sorted(BASE_LOSSES))
def test_with_behaviour_equal_to_proximal_every_loss_is_unchanged(name, aggregation):
    fn, required = BASE_LOSSES[name]
    logprobs, proximal, _, advantages, mask = random_batch(7)
    common = dict(logprobs=logprobs, old_logprobs=proximal, advantages=advantages, response_mask=mask,
                  loss_agg=AGGREGATIONS[aggregation], **required)
    base_loss, base_metrics = fn(**common)
    loss, metrics = pl.decoupled_loss(fn, behaviour_logprobs=proximal.clone(), **common)
    (base_grad,) = torch.autograd.grad(base_loss, logprobs)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert loss.item() == base_loss.item()
    assert torch.equal(grad, base_grad)
    assert {k: float(v) for k, v in metrics.items() if k in base_metrics} == {
        k: float(v) for k, v in base_metrics.items()}
    assert float(metrics["behaviour_weight_mean"]) == 1.0 and float(metrics["behaviour_kl"]) == 0.0


@SETTINGS
@given(seed=st.integers(0, 2**16), eps_high=st.sampled_from([None, 0.28]))
def test_equals_ppo_clip_when_behaviour_is_the_proximal_policy(seed, eps_high):
    logprobs, proximal, _, advantages, mask = random_batch(seed)
    common = dict(logprobs=logprobs, old_logprobs=proximal, advantages=advantages, response_mask=mask,
                  loss_agg=agg.token_mean, clip_eps_high=eps_high)
    a, _ = pl.ppo_clip(**common)
    b, _ = pl.decoupled_ppo(behaviour_logprobs=proximal, **common)
    assert torch.equal(a, b)
    assert torch.equal(torch.autograd.grad(a, logprobs)[0], torch.autograd.grad(b, logprobs)[0])


@SETTINGS
@given(seed=st.integers(0, 2**16))
def test_gradient_is_zero_where_the_proximal_ratio_is_clipped_whatever_the_behaviour_weight(seed):
    logprobs, proximal, behaviour, advantages, mask = random_batch(seed)
    loss, _ = pl.decoupled_ppo(logprobs=logprobs, old_logprobs=proximal, behaviour_logprobs=behaviour,
                               advantages=advantages, response_mask=mask, loss_agg=agg.token_mean)
    (grad,) = torch.autograd.grad(loss, logprobs)
    r = torch.exp(logprobs.detach() - proximal)
    clipped = ((advantages > 0) & (r > 1.2)) | ((advantages < 0) & (r < 0.8))
    assert torch.all(grad[clipped.bool() | (mask == 0)] == 0)
    # and elsewhere it is the importance-weighted on-policy gradient -A w r / n
    w = torch.exp(proximal - behaviour)
    inside = ~clipped & (mask > 0)
    expected = (-advantages * w * r / mask.sum())[inside]
    assert torch.allclose(grad[inside], expected, rtol=1e-12, atol=0)


CORRECTIONS = [
    {"tis": "token", "tis_cap": None},  # the decoupled objective's default, AReaL's without a cap
    {"tis": "token", "tis_cap": 2.0},
    {"tis": "sequence", "tis_cap": 3.0},
    {"mis": "token", "mis_low": 0.5, "mis_high": 2.0},
    {"mis": "token", "mis_low": 0.0, "mis_high": 1.5, "rejection": "geometric", "rejection_low": 0.8,
     "rejection_high": 1.25},
    {"rejection": "token", "rejection_low": 0.3, "rejection_high": 3.0},
]


@pytest.mark.parametrize("correction", CORRECTIONS, ids=lambda c: "+".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo", "geo_mean", "dppo_tv"])
def test_is_the_loops_batch_level_rollout_correction_not_a_second_mechanism(name, correction):
    """The loop's path today (rltk.training.step.rollout_correction: old log-probs recomputed, rollout log-probs
    as the behaviour) and the decoupled loss give one loss and one gradient for every correction mode."""
    from rltk.training.step.rollout_correction import apply_rollout_correction

    fn, required = BASE_LOSSES[name]
    logprobs, proximal, behaviour, advantages, mask = random_batch(11)
    batch = {"old_logprobs": proximal, "rollout_logprobs": behaviour, "response_mask": mask}
    corrected, _ = apply_rollout_correction(batch, correction)
    loop_loss, _ = fn(logprobs=logprobs, old_logprobs=proximal, advantages=advantages,
                      response_mask=corrected["response_mask"],
                      loss_agg=weighted_loss_agg(agg.seq_mean_token_mean, corrected["rollout_is_weights"]), **required)
    loss, _ = pl.decoupled_loss(fn, logprobs=logprobs, old_logprobs=proximal, behaviour_logprobs=behaviour,
                                advantages=advantages, response_mask=mask, loss_agg=agg.seq_mean_token_mean,
                                behaviour_correction=correction, **required)
    assert loss.item() == pytest.approx(loop_loss.item(), rel=1e-6, abs=1e-12)
    g1 = torch.autograd.grad(loop_loss, logprobs)[0]
    g2 = torch.autograd.grad(loss, logprobs)[0]
    assert torch.allclose(g1, g2, rtol=1e-5, atol=1e-12)


def test_plain_weight_is_the_untruncated_ratio():
    proximal = f64([[-1.0, -2.0, -0.5]])
    behaviour = f64([[-1.0 - math.log(5.0), -2.0, -0.5 + math.log(2.0)]])  # w = 5, 1, 0.5
    c = rollout_correction(proximal, behaviour, torch.ones(1, 3), tis="token", tis_cap=None)
    assert c.weights[0].tolist() == pytest.approx([5.0, 1.0, 0.5])
    assert not c.truncated.any() and not c.dropped.any()


def test_bad_settings_and_shapes_are_named():
    logprobs, proximal, behaviour = three_policies(R, W)
    with pytest.raises(ValueError, match=r"behaviour_correction\.tis_cap"):
        run(pl.decoupled_ppo, logprobs, proximal, behaviour, A, behaviour_correction={"tis": "token", "tis_cap": 0.5})
    with pytest.raises(ValueError, match=r"behaviour_correction\.bogus: no such setting"):
        run(pl.decoupled_ppo, logprobs, proximal, behaviour, A, behaviour_correction={"bogus": 1})
    with pytest.raises(ValueError, match=r"behaviour_logprobs \(1, 3\) must match old_logprobs \(1, 4\)"):
        run(pl.decoupled_ppo, logprobs, proximal, behaviour[:, :3], A)
