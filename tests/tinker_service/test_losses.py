"""Tinker's loss names on rltk's registered policy losses: values and gradients computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rltk.tinker_service.losses import LossError, compute_loss, plan_loss


def _run(name, config, lp, inputs):
    logprobs = torch.tensor(lp, requires_grad=True)
    mask = torch.ones_like(logprobs)
    loss, metrics = compute_loss(plan_loss(name, config), logprobs, mask,
                                 {k: torch.tensor(v) for k, v in inputs.items()})
    loss.backward()
    return float(loss.detach()), logprobs.grad, metrics


def test_cross_entropy_is_the_weighted_sum_of_negative_logprobs():
    loss, grad, metrics = _run("cross_entropy", {}, [[-1.0, -2.0]], {"weights": [[1.0, 0.5]]})
    assert loss == pytest.approx(2.0)  # 1 * 1 + 0.5 * 2
    assert grad.tolist() == [[-1.0, -0.5]]
    assert metrics == {"loss:sum": pytest.approx(2.0)}


def test_importance_sampling_has_the_gradient_of_minus_rho_times_advantage():
    # rho = exp(-1 - (-1.5)) = e^0.5; d(-rho A)/d lp = -rho A
    _, grad, metrics = _run("importance_sampling", {}, [[-1.0, -3.0]],
                            {"logprobs": [[-1.5, -3.0]], "advantages": [[2.0, -1.0]]})
    assert grad[0, 0] == pytest.approx(-2.0 * math.exp(0.5), rel=1e-6)
    assert grad[0, 1] == pytest.approx(1.0, rel=1e-6)  # rho = 1
    assert metrics["ratio_mean:mean"] == pytest.approx((math.exp(0.5) + 1) / 2, rel=1e-6)


def test_ppo_clips_at_tinkers_thresholds():
    # rho = 1.5 with A = 1: clipped to 1.3 with clip_high_threshold 1.3 -> loss -1.3, no gradient
    loss, grad, _ = _run("ppo", {"clip_high_threshold": 1.3}, [[math.log(1.5)]],
                         {"logprobs": [[0.0]], "advantages": [[1.0]]})
    assert loss == pytest.approx(-1.3, rel=1e-6)
    assert grad.tolist() == [[0.0]]
    # inside the range the gradient is -rho A
    loss, grad, _ = _run("ppo", {}, [[math.log(1.1)]], {"logprobs": [[0.0]], "advantages": [[1.0]]})
    assert loss == pytest.approx(-1.1, rel=1e-6)
    assert grad[0, 0] == pytest.approx(-1.1, rel=1e-6)


def test_a_registered_policy_loss_is_reachable_by_name_with_its_own_arguments():
    plan = plan_loss("gspo", {"clip_eps_low": 0.3})
    assert (plan.component, plan.args) == ("gspo", {"clip_eps_low": 0.3})
    with pytest.raises(LossError, match=r"loss_fn_config\.temperature: policy_loss 'gspo' takes"):
        plan_loss("gspo", {"temperature": 1.0})


def test_unknown_names_and_bad_config_name_the_field():
    with pytest.raises(LossError, match=r"loss_fn: 'nope' is neither .* ppo_clip"):
        plan_loss("nope", {})
    with pytest.raises(LossError, match=r"loss_fn_config\.clip_eps"):
        plan_loss("ppo", {"clip_eps": 0.2})
    with pytest.raises(LossError, match=r"loss_fn_config\.x: loss_fn 'cross_entropy' takes no configuration"):
        plan_loss("cross_entropy", {"x": 1.0})


def _grad_of(formula, lp, q, a):
    """The gradient of a loss written as Tinker documents it, by autograd."""
    logprobs = torch.tensor(lp, requires_grad=True)
    formula(logprobs, torch.tensor(q), torch.tensor(a)).backward()
    return logprobs.grad


LP, Q, A = [[-1.0, -2.0, -0.5]], [[-1.5, -1.0, -0.5]], [[2.0, -1.0, 0.5]]


def test_importance_sampling_reports_tinkers_value_minus_sum_rho_a():
    # the case: ratio 1, advantage 1 on two tokens -> -2.0 (not -sum A lp)
    loss, _, metrics = _run("importance_sampling", {}, [[-2.0, -2.1558]],
                            {"logprobs": [[-2.0, -2.1558]], "advantages": [[1.0, 1.0]]})
    assert loss == pytest.approx(-2.0, rel=1e-6)
    assert metrics["loss:sum"] == pytest.approx(-2.0, rel=1e-6)
    loss, grad, _ = _run("importance_sampling", {}, LP, {"logprobs": Q, "advantages": A})
    rho = [math.exp(l - q) for l, q in zip(LP[0], Q[0])]
    assert loss == pytest.approx(-sum(r * a for r, a in zip(rho, A[0])), rel=1e-6)
    torch.testing.assert_close(grad, _grad_of(lambda lp, q, a: -(torch.exp(lp - q) * a).sum(), LP, Q, A))


def test_ppo_value_and_gradient_are_tinkers():
    def tinker_ppo(lp, q, a):
        rho = torch.exp(lp - q)
        return -torch.minimum(rho * a, rho.clamp(0.8, 1.2) * a).sum()

    loss, grad, _ = _run("ppo", {}, LP, {"logprobs": Q, "advantages": A})
    assert loss == pytest.approx(float(tinker_ppo(*(torch.tensor(x) for x in (LP, Q, A)))), rel=1e-6)
    torch.testing.assert_close(grad, _grad_of(tinker_ppo, LP, Q, A))


def test_cispo_takes_tinkers_thresholds_and_reports_tinkers_value():
    def tinker_cispo(lp, q, a, low=0.9, high=1.1):
        return -(torch.exp(lp - q).clamp(low, high).detach() * lp * a).sum()

    loss, grad, _ = _run("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, LP,
                         {"logprobs": Q, "advantages": A})
    # rho = e^0.5 -> 1.1, e^-1 -> 0.9, 1: -(1.1 * -1 * 2 + 0.9 * -2 * -1 + 1 * -0.5 * 0.5)
    assert loss == pytest.approx(2.2 - 1.8 + 0.25, rel=1e-6)
    torch.testing.assert_close(grad, _grad_of(tinker_cispo, LP, Q, A))
    with pytest.raises(LossError, match=r"loss_fn_config\.clip_eps_high: loss_fn 'cispo' takes"):
        plan_loss("cispo", {"clip_eps_high": 0.3})


def test_dro_reports_tinkers_value_with_beta():
    def tinker_dro(lp, q, a, beta=0.5):
        return -(lp * a - 0.5 * beta * (lp - q) ** 2).sum()

    loss, grad, _ = _run("dro", {"beta": 0.5}, LP, {"logprobs": Q, "advantages": A})
    # -(-2 - 0.25 * 0.25) - (2 - 0.25 * 1) - (-0.25 - 0)
    assert loss == pytest.approx(2.0625 - 1.75 + 0.25, rel=1e-6)
    torch.testing.assert_close(grad, _grad_of(tinker_dro, LP, Q, A))
    with pytest.raises(LossError, match=r"loss_fn_config\.beta: loss_fn 'dro' takes beta"):
        plan_loss("dro", {})


def test_stable_reinforce_is_refused_as_a_tinker_loss_with_the_reason():
    with pytest.raises(LossError, match=r"loss_fn: 'stable_reinforce' is a Tinker loss this service does not run"):
        plan_loss("stable_reinforce", {})


def test_metrics_count_only_positions_that_carry_a_sample():
    # a prompt position (sampler log-prob 0, advantage 0) beside two sampled tokens with ratio 1:
    # the sampler and the trainer agree exactly, so approx_kl is 0 and ratio_mean 1
    loss, _, metrics = _run("importance_sampling", {}, [[-3.0, -1.0, -2.0]],
                            {"logprobs": [[0.0, -1.0, -2.0]], "advantages": [[0.0, 1.0, 1.0]]})
    assert metrics["approx_kl:mean"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["ratio_mean:mean"] == pytest.approx(1.0, rel=1e-6)
    assert loss == pytest.approx(-2.0, rel=1e-6)
