"""Preference losses (DPO, cDPO, IPO, SLiC hinge): hand-derived values and gradients, and their properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rltk
from rltk.algorithms import preference_losses as prl

SETTINGS = settings(max_examples=50, deadline=None, derandomize=True, database=None)


def pair(chosen=-2.0, rejected=-4.0, ref_chosen=-3.0, ref_rejected=-3.5):
    """One pair, float64, the policy's log-probs requiring grad. Defaults: h = (-2 + 3) - (-4 + 3.5) = 1.5."""
    c = torch.tensor([chosen], dtype=torch.float64, requires_grad=True)
    r = torch.tensor([rejected], dtype=torch.float64, requires_grad=True)
    return dict(chosen_logps=c, rejected_logps=r, ref_chosen_logps=torch.tensor([ref_chosen], dtype=torch.float64),
                ref_rejected_logps=torch.tensor([ref_rejected], dtype=torch.float64))


def value_and_grads(fn, inputs, **kwargs):
    loss = fn(**inputs, **kwargs)
    loss.sum().backward()
    return loss.item(), inputs["chosen_logps"].grad.item(), inputs["rejected_logps"].grad.item()


@pytest.mark.parametrize("name", ["sigmoid", "ipo", "hinge"])
def test_registered_under_its_name(name):
    assert rltk.get_component("preference_loss", name) is getattr(prl, name)


def test_sigmoid_by_hand():
    # beta h = 0.1 * 1.5 = 0.15; -log sigmoid(0.15) = log(1 + e^-0.15) = log(1.8607079764) = 0.6209...
    # d/d chosen = -beta * sigmoid(-0.15) = -0.1 * 0.4625701 ; d/d rejected is its negative
    loss, g_c, g_r = value_and_grads(prl.sigmoid, pair(), beta=0.1)
    assert loss == pytest.approx(0.620957, abs=1e-6)
    assert g_c == pytest.approx(-0.04625701, abs=1e-7)
    assert g_r == pytest.approx(0.04625701, abs=1e-7)


def test_cdpo_by_hand():
    # beta = 1, h = 1.5, eps = 0.1: 0.9 log(1 + e^-1.5) + 0.1 log(1 + e^1.5)
    # = 0.9 * 0.20141328 + 0.1 * 1.70141328 = 0.35141328
    loss, _, _ = value_and_grads(prl.sigmoid, pair(), beta=1.0, label_smoothing=0.1)
    assert loss == pytest.approx(0.35141328, abs=1e-7)


def test_cdpo_gradient_vanishes_at_its_finite_optimum():
    # the optimum of conservative DPO: beta h = log((1 - eps) / eps) = log 9 for eps = 0.1
    h = math.log(9.0)
    _, g_c, g_r = value_and_grads(prl.sigmoid, pair(chosen=h, rejected=0.0, ref_chosen=0.0, ref_rejected=0.0),
                                  beta=1.0, label_smoothing=0.1)
    assert g_c == pytest.approx(0.0, abs=1e-12) and g_r == pytest.approx(0.0, abs=1e-12)


def test_ipo_by_hand():
    # beta = 0.25: target margin 1 / (2 beta) = 2; (1.5 - 2)^2 = 0.25; d/d chosen = 2 (1.5 - 2) = -1
    loss, g_c, g_r = value_and_grads(prl.ipo, pair(), beta=0.25)
    assert (loss, g_c, g_r) == (pytest.approx(0.25), pytest.approx(-1.0), pytest.approx(1.0))


def test_ipo_pulls_an_overshooting_margin_back():
    # beta = 1: target 0.5 < h = 1.5, so the chosen log-prob is pushed *down*: (1.5 - 0.5)^2 = 1, grad 2
    loss, g_c, g_r = value_and_grads(prl.ipo, pair(), beta=1.0)
    assert (loss, g_c, g_r) == (pytest.approx(1.0), pytest.approx(2.0), pytest.approx(-2.0))


def test_hinge_by_hand():
    # beta = 0.5: max(0, 1 - 0.75) = 0.25, d/d chosen = -beta = -0.5
    assert value_and_grads(prl.hinge, pair(), beta=0.5) == (pytest.approx(0.25), -0.5, 0.5)
    # beta = 1: 1 - 1.5 < 0, the pair is past the margin: no loss, no gradient
    assert value_and_grads(prl.hinge, pair(), beta=1.0) == (0.0, 0.0, 0.0)


margins = st.floats(-20, 20, allow_nan=False)


@SETTINGS
@given(c=margins, r=margins, rc=margins, rr=margins, beta=st.floats(0.01, 2.0),
       eps=st.floats(0.0, 0.49))
def test_sigmoid_pushes_chosen_up_and_rejected_down(c, r, rc, rr, beta, eps):
    _, g_c, g_r = value_and_grads(prl.sigmoid, pair(c, r, rc, rr), beta=beta, label_smoothing=eps)
    # descent moves chosen by -g_c and rejected by -g_r; below cDPO's optimum chosen rises, rejected falls
    h = (c - rc) - (r - rr)
    if beta * h < math.log((1 - eps) / eps) - 1e-9 if eps > 0 else True:
        assert g_c <= 0 <= g_r
    assert g_c == pytest.approx(-g_r, abs=1e-12)  # a function of the margin alone


@SETTINGS
@given(c=margins, r=margins, rc=margins, rr=margins, beta=st.floats(0.01, 2.0))
def test_label_smoothing_one_half_makes_sigmoid_symmetric(c, r, rc, rr, beta):
    forward = prl.sigmoid(**pair(c, r, rc, rr), beta=beta, label_smoothing=0.5)
    swapped = prl.sigmoid(**pair(r, c, rr, rc), beta=beta, label_smoothing=0.5)
    assert forward.item() == pytest.approx(swapped.item(), rel=1e-12, abs=1e-12)


def test_references_get_no_gradient_and_shapes_are_checked():
    inputs = pair()
    inputs["ref_chosen_logps"] = inputs["ref_chosen_logps"].clone().requires_grad_(True)
    prl.sigmoid(**inputs, beta=0.1).sum().backward()
    assert inputs["ref_chosen_logps"].grad is None
    bad = pair()
    bad["rejected_logps"] = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"same \[P\]"):
        prl.ipo(**bad, beta=0.1)


@pytest.mark.parametrize("kwargs, match", [({"beta": 0.0}, "beta must be"),
                                           ({"beta": 0.1, "label_smoothing": 0.7}, "label_smoothing")])
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        prl.sigmoid(**pair(), **kwargs)
