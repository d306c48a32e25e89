"""KL estimators, straight-through gradients, controllers and the reward penalty."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rltk
from rltk.algorithms import kl
from rltk.algorithms.aggregation import token_mean

SETTINGS = settings(max_examples=50, deadline=None, derandomize=True, database=None)

NAMES = {
    "k1": kl.kl_k1,
    "k2": kl.kl_k2,
    "k3": kl.kl_k3,
    "low_var_kl": kl.kl_k3,
    "abs": kl.kl_abs,
    "k1+": kl.kl_k1_straight_through,
    "k3+": kl.kl_k3_straight_through,
    "low_var_kl+": kl.kl_k3_straight_through,
    "abs+": kl.kl_abs_straight_through,
}
STRAIGHT_THROUGH = {"k1+": kl.kl_k1, "k3+": kl.kl_k3, "low_var_kl+": kl.kl_k3, "abs+": kl.kl_abs}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_every_estimator_is_registered_under_its_name(name):
    assert rltk.get_component("kl_penalty_fn", name) is NAMES[name]


# logprobs and ref_logprobs of three tokens; r = ref - logprobs = -0.5, 0, -3.5
LOGPROBS = torch.tensor([[-1.0, -2.0, -0.5]])
REF = torch.tensor([[-1.5, -2.0, -4.0]])


def test_estimators_by_hand():
    assert kl.kl_k1(LOGPROBS, REF).tolist() == [[0.5, 0.0, 3.5]]
    assert kl.kl_k2(LOGPROBS, REF).tolist() == [[0.125, 0.0, 6.125]]
    assert kl.kl_abs(LOGPROBS, REF).tolist() == [[0.5, 0.0, 3.5]]
    # k3 = exp(r) - r - 1: exp(-0.5) + 0.5 - 1 = 0.1065307, exp(-3.5) + 3.5 - 1 = 2.5301974
    assert kl.kl_k3(LOGPROBS, REF)[0].tolist() == pytest.approx([0.1065307, 0.0, 2.5301974], abs=1e-6)


def test_k3_is_capped_and_never_overflows():
    logprobs = torch.tensor([[-4.0, -200.0, 0.0]])
    ref = torch.tensor([[-1.0, 0.0, -200.0]])
    # r = 3: exp(3) - 4 = 16.0855 > 10 -> 10; r = 200 -> clamped to 20 first, then capped
    assert kl.kl_k3(logprobs, ref).tolist() == [[10.0, 10.0, 10.0]]
    uncapped = kl.kl_k3(logprobs, ref, max_value=None)
    assert uncapped[0, 0].item() == pytest.approx(math.exp(3) - 4, rel=1e-6)
    assert uncapped[0, 1].item() == pytest.approx(math.exp(20) - 21, rel=1e-6)
    assert uncapped[0, 2].item() == pytest.approx(19.0, rel=1e-6)  # r = -20: exp(-20) + 20 - 1
    assert torch.isfinite(uncapped).all()


def test_k3_rejects_a_non_positive_cap():
    with pytest.raises(ValueError, match=r"max_value must be > 0 or None.*got 0"):
        kl.kl_k3(LOGPROBS, REF, max_value=0)


def test_mismatched_shapes_are_rejected():
    with pytest.raises(ValueError, match=r"logprobs has shape \(1, 3\) but ref_logprobs has \(1, 2\)"):
        kl.kl_k1(LOGPROBS, REF[:, :2])


log_prob_pairs = st.builds(
    lambda seed, B, T: (
        -torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) * 6,
        -torch.rand(B, T, generator=torch.Generator().manual_seed(seed + 1)) * 6,
    ),
    seed=st.integers(0, 2**30),
    B=st.integers(1, 4),
    T=st.integers(1, 8),
)


@SETTINGS
@given(pair=log_prob_pairs)
def test_estimators_vanish_when_the_policies_agree_and_k2_k3_are_non_negative(pair):
    logprobs, ref = pair
    for name, fn in NAMES.items():
        assert (fn(logprobs, logprobs) == 0).all(), name
    assert (kl.kl_k2(logprobs, ref) >= 0).all()
    assert (kl.kl_k3(logprobs, ref) >= 0).all()
    assert (kl.kl_k3(logprobs, ref, max_value=None) >= 0).all()


@SETTINGS
@given(pair=log_prob_pairs)
def test_straight_through_value_is_the_estimator_and_gradient_is_k2s(pair):
    logprobs, ref = pair
    for name, base in STRAIGHT_THROUGH.items():
        x = logprobs.clone().requires_grad_(True)
        value = NAMES[name](x, ref)
        torch.testing.assert_close(value.detach(), base(logprobs, ref), msg=name)
        (gradient,) = torch.autograd.grad(value.sum(), x)
        x2 = logprobs.clone().requires_grad_(True)
        (k2_gradient,) = torch.autograd.grad(kl.kl_k2(x2, ref).sum(), x2)
        torch.testing.assert_close(gradient, k2_gradient, msg=name)
        torch.testing.assert_close(gradient, logprobs - ref, msg=name)


def test_k3_plus_keeps_the_gradient_where_the_value_is_capped():
    x = torch.tensor([[-4.0]], requires_grad=True)
    ref = torch.tensor([[-1.0]])  # k3 = 16.09, capped at 10
    value = kl.kl_k3_straight_through(x, ref)
    value.sum().backward()
    assert value.item() == 10.0
    assert x.grad.item() == pytest.approx(-3.0)


def test_estimators_do_not_send_gradient_into_the_reference():
    ref = REF.clone().requires_grad_(True)
    for name, fn in NAMES.items():
        out = fn(LOGPROBS.clone().requires_grad_(True), ref)
        assert not out.requires_grad or torch.autograd.grad(out.sum(), ref, allow_unused=True)[0] is None, name


@SETTINGS
@given(seed=st.integers(0, 2**30), vocab=st.integers(2, 9))
def test_exact_expectations_over_a_vocabulary(seed, vocab):
    """Weighted by pi over every token: E[k1] = E[k3] = KL(pi || ref); the expected
    gradient of k2 (and so of k3+) is grad KL(pi || ref), that of k3 is grad KL(ref || pi)."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(vocab, generator=g, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(vocab, generator=g, dtype=torch.float64), -1)
    logprobs = torch.log_softmax(theta, -1)
    pi = logprobs.exp().detach()
    reverse_kl = (logprobs.exp() * (logprobs - ref)).sum()
    forward_kl = (ref.exp() * (ref - logprobs)).sum()
    assert (pi * kl.kl_k1(logprobs, ref)).sum().item() == pytest.approx(reverse_kl.item(), abs=1e-10)
    k3 = kl.kl_k3(logprobs[None], ref[None], max_value=None)[0]
    assert (pi * k3).sum().item() == pytest.approx(reverse_kl.item(), abs=1e-10)

    def expected_gradient(fn):
        (gradient,) = torch.autograd.grad((pi * fn(logprobs[None], ref[None])[0]).sum(), theta, retain_graph=True)
        return gradient

    (true_reverse,) = torch.autograd.grad(reverse_kl, theta, retain_graph=True)
    (true_forward,) = torch.autograd.grad(forward_kl, theta, retain_graph=True)
    torch.testing.assert_close(expected_gradient(kl.kl_k2), true_reverse)
    torch.testing.assert_close(expected_gradient(lambda a, b: kl.kl_k3_straight_through(a, b, max_value=None)), true_reverse)
    torch.testing.assert_close(expected_gradient(lambda a, b: kl.kl_k3(a, b, max_value=None)), true_forward)


def test_kl_as_a_loss_term_through_a_loss_agg():
    # token-mean over the 2 policy tokens of k3+: gradient (logprobs - ref) / 2 there, 0 on padding
    logprobs = torch.tensor([[-1.0, -2.0, -7.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss = token_mean(kl.kl_k3_straight_through(logprobs, ref), mask)
    loss.backward()
    # k3 values: r = -0.5 -> 0.1065307; r = 1 -> e - 2 = 0.7182818; mean = 0.4124063
    assert loss.item() == pytest.approx(0.4124063, abs=1e-6)
    assert logprobs.grad[0].tolist() == pytest.approx([0.25, -0.5, 0.0])


# --------------------------------------------------------------------------
# Controllers and the reward penalty
# --------------------------------------------------------------------------


def test_fixed_controller_never_moves():
    controller = kl.FixedKLController(0.05)
    controller.update(current_kl=100.0, n_steps=1000)
    assert controller.value == 0.05


def test_adaptive_controller_follows_ziegler_et_al():
    controller = kl.AdaptiveKLController(init_coef=0.1, target_kl=6.0, horizon=10000)
    # KL 9 is 50% above target: error clipped to +0.2 -> 0.1 * (1 + 0.2 * 256 / 10000) = 0.100512
    controller.update(current_kl=9.0, n_steps=256)
    assert controller.value == pytest.approx(0.100512)
    # KL 6.6 is 10% above: 0.100512 * (1 + 0.1 * 256 / 10000)
    controller.update(current_kl=6.6, n_steps=256)
    assert controller.value == pytest.approx(0.100512 * 1.00256)
    # KL 0 is 100% below: error clipped to -0.2
    before = controller.value
    controller.update(current_kl=0.0, n_steps=10000)
    assert controller.value == pytest.approx(before * 0.8)


def test_adaptive_controller_holds_at_the_target():
    controller = kl.AdaptiveKLController(init_coef=0.2, target_kl=1.0, horizon=100)
    controller.update(current_kl=1.0, n_steps=50)
    assert controller.value == 0.2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"init_coef": -1, "target_kl": 1, "horizon": 1}, r"init_coef must be a finite number >= 0, got -1"),
        ({"init_coef": 0.1, "target_kl": 0, "horizon": 1}, r"target_kl must be > 0 .*got 0"),
        ({"init_coef": 0.1, "target_kl": 1, "horizon": 0}, r"horizon must be > 0 .*got 0"),
    ],
)
def test_adaptive_controller_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        kl.AdaptiveKLController(**kwargs)


def test_adaptive_controller_refuses_a_nan_kl():
    controller = kl.AdaptiveKLController(0.1, 1.0, 100)
    with pytest.raises(ValueError, match=r"current_kl is nan"):
        controller.update(float("nan"), 10)
    assert controller.value == 0.1


def test_fixed_controller_rejects_a_negative_coefficient():
    with pytest.raises(ValueError, match=r"coef must be a finite number >= 0, got -0.5"):
        kl.FixedKLController(-0.5)


def test_apply_kl_penalty_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    kl_values = torch.tensor([[0.5, -0.2, 0.1, float("nan")]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    shaped = kl.apply_kl_penalty(rewards, kl_values, 0.1, mask)
    assert shaped[0].tolist() == pytest.approx([-0.05, 0.02, 0.99, 0.0])
    assert not shaped.requires_grad  # rewards are targets, the KL is detached


def test_apply_kl_penalty_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"apply_kl_penalty: token_rewards \(1, 4\), kl \(1, 3\)"):
        kl.apply_kl_penalty(torch.zeros(1, 4), torch.zeros(1, 3), 0.1, torch.ones(1, 4))


# --------------------------------------------------------------------------
# k3_unbiased (DeepSeek-V3.2)
# --------------------------------------------------------------------------


def test_k3_unbiased_is_registered_and_its_old_logprobs_are_a_batch_field():
    from rltk.registry import KINDS

    entry = {e.name: e for e in rltk.list_components("kl_penalty_fn")}["k3_unbiased"]
    assert entry.obj is kl.kl_k3_unbiased and "DeepSeek-V3.2" in entry.summary
    # a config may not set it: the caller passes the batch's old log-probs
    assert "old_logprobs" in KINDS["kl_penalty_fn"].provided


def test_k3_unbiased_by_hand():
    x = LOGPROBS.double().clone().requires_grad_(True)
    ref = REF.double()
    k3 = [math.exp(-0.5) + 0.5 - 1, 0.0, math.exp(-3.5) + 3.5 - 1]
    # on-policy (old = None): the value is k3, the gradient k3 * 1 + dk3/dlogp = k3 + 1 - exp(r)
    value = kl.kl_k3_unbiased(x, ref)
    assert value[0].tolist() == pytest.approx(k3)
    (gradient,) = torch.autograd.grad(value.sum(), x)
    r = [-0.5, 0.0, -3.5]
    assert gradient[0].tolist() == pytest.approx([k + 1 - math.exp(ri) for k, ri in zip(k3, r)])
    # sampled by an older policy with log-ratios 0.2, 0, -0.3: each k3 weighted by exp(log-ratio)
    old = x.detach() - torch.tensor([[0.2, 0.0, -0.3]], dtype=torch.float64)
    value = kl.kl_k3_unbiased(x, ref, old_logprobs=old)
    assert value[0].tolist() == pytest.approx([math.exp(0.2) * k3[0], 0.0, math.exp(-0.3) * k3[2]])
    (gradient,) = torch.autograd.grad(value.sum(), x)
    weights = [math.exp(0.2), 1.0, math.exp(-0.3)]
    assert gradient[0].tolist() == pytest.approx(
        [w * (k + 1 - math.exp(ri)) for w, k, ri in zip(weights, k3, r)]
    )


def test_k3_unbiased_rejects_old_logprobs_of_another_shape():
    with pytest.raises(ValueError, match=r"k3_unbiased: old_logprobs has shape \(1, 2\) but logprobs has \(1, 3\)"):
        kl.kl_k3_unbiased(LOGPROBS, REF, old_logprobs=LOGPROBS[:, :2])


@SETTINGS
@given(seed=st.integers(0, 2**30), V=st.integers(2, 6), spread=st.floats(0.1, 2.0))
def test_k3_unbiased_value_and_gradient_are_exactly_unbiased_off_policy(seed, V, spread):
    """Over a categorical distribution the expectation is a finite sum: with tokens drawn from pi_old,
    E[(pi / pi_old) k3] is KL(pi || pi_ref) and its gradient in pi's logits is KL's gradient; plain k3
    is neither."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(V, generator=g, dtype=torch.float64) * spread).requires_grad_(True)
    old = torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64) * spread, -1)
    ref = torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64) * spread, -1)
    logp = torch.log_softmax(logits, -1)
    true_kl = (logp.exp() * (logp - ref)).sum()
    (true_gradient,) = torch.autograd.grad(true_kl, logits, retain_graph=True)

    def expectation(fn, **kwargs):
        # every token of the vocabulary as a [1, V] batch, weighted by the probability pi_old gives it
        return (old.exp() * fn(logp[None], ref[None], max_value=None, **kwargs)[0]).sum()

    estimate = expectation(kl.kl_k3_unbiased, old_logprobs=old[None])
    assert estimate.item() == pytest.approx(true_kl.item(), rel=1e-9, abs=1e-12)
    (gradient,) = torch.autograd.grad(estimate, logits, retain_graph=True)
    torch.testing.assert_close(gradient, true_gradient, atol=1e-10, rtol=1e-8)


def test_plain_k3_is_biased_off_policy_where_k3_unbiased_is_not():
    # pi = (0.7, 0.3), pi_old = (0.3, 0.7), pi_ref = (0.5, 0.5): KL(pi || pi_ref) = 0.0822829
    logp = torch.log(torch.tensor([[0.7, 0.3]], dtype=torch.float64))
    old = torch.log(torch.tensor([[0.3, 0.7]], dtype=torch.float64))
    ref = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    weights = old.exp()[0]
    true_kl = 0.7 * math.log(1.4) + 0.3 * math.log(0.6)
    assert true_kl == pytest.approx(0.0822829, abs=1e-7)
    assert (weights * kl.kl_k3_unbiased(logp, ref, old_logprobs=old)[0]).sum().item() == pytest.approx(true_kl)
    # k3 alone, averaged over pi_old's samples: 0.3 (5/7 + ln 1.4 - 1) + 0.7 (5/3 + ln 0.6 - 1) = 0.1243
    plain = (weights * kl.kl_k3(logp, ref)[0]).sum().item()
    assert plain == pytest.approx(0.3 * (5 / 7 + math.log(1.4) - 1) + 0.7 * (5 / 3 + math.log(0.6) - 1))
    assert plain > 1.4 * true_kl
