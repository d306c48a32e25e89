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
    plan = plan_loss("cispo", {"clip_eps_high": 0.3})
    assert (plan.component, plan.args) == ("cispo", {"clip_eps_high": 0.3})
    with pytest.raises(LossError, match=r"loss_fn_config\.temperature: policy_loss 'cispo' takes"):
        plan_loss("cispo", {"temperature": 1.0})


def test_unknown_names_and_bad_config_name_the_field():
    with pytest.raises(LossError, match=r"loss_fn: 'nope' is neither .* ppo_clip"):
        plan_loss("nope", {})
    with pytest.raises(LossError, match=r"loss_fn_config\.clip_eps"):
        plan_loss("ppo", {"clip_eps": 0.2})
    with pytest.raises(LossError, match=r"loss_fn_config\.x: loss_fn 'cross_entropy' takes no configuration"):
        plan_loss("cross_entropy", {"x": 1.0})
