"""Preference losses: the DPO family, on the log-probs of a chosen and a rejected response.

A ``preference_loss`` is called as::

    losses = fn(chosen_logps=..., rejected_logps=..., ref_chosen_logps=..., ref_rejected_logps=...,
                beta=..., **configured_args)

Each input is ``[P]``, one entry per preference pair: the summed log-prob of
the chosen (resp. rejected) response under the policy being trained (with
gradient) and under the frozen reference (no gradient). ``beta`` is the
strength of the implicit KL regulariser (``dpo.beta``). The function returns
the ``[P]`` per-pair losses; the caller averages them over the global number
of pairs, so micro-batching and data parallelism give one large batch's
gradient.

Every variant is a function of one number per pair, the difference of
log-ratios

    h = (log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))

(``y_w`` chosen, ``y_l`` rejected): each pushes ``h`` up, i.e. the chosen
response's log-prob up and the rejected one's down, relative to the reference.
``beta * (log pi(y|x) - log pi_ref(y|x))`` is DPO's implicit reward of a
response; the recipe logs it as ``rewards/chosen`` and ``rewards/rejected``
(TRL's names).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import rltk

__all__ = ["sigmoid", "ipo", "hinge", "logratio_margin"]

#: The builtin preference losses by config name, filled by ``@register_preference_loss(name)`` on each definition and
#: returned by this module's ``rltk_preference_losses`` hook (the entry point ``preference_losses``).
PREFERENCE_LOSSES = rltk.ComponentTable("preference_loss")
register_preference_loss = PREFERENCE_LOSSES.register


def logratio_margin(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
                    ref_rejected_logps: torch.Tensor, where: str = "preference_loss") -> torch.Tensor:
    """``h = (chosen - ref_chosen) - (rejected - ref_rejected)``, float32 at least; the references detached.

    Shape: (P,) each -> (P,).
    """
    shapes = {"chosen_logps": tuple(chosen_logps.shape), "rejected_logps": tuple(rejected_logps.shape),
              "ref_chosen_logps": tuple(ref_chosen_logps.shape),
              "ref_rejected_logps": tuple(ref_rejected_logps.shape)}
    if len(set(shapes.values())) != 1 or chosen_logps.dim() != 1:
        listed = ", ".join(f"{k} {v}" for k, v in shapes.items())
        raise ValueError(f"preference_loss '{where}': every input must be the same [P] (one per pair); got {listed}")

    def up(t: torch.Tensor) -> torch.Tensor:  # a bf16 sum of many token log-probs loses the margin's digits
        return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t

    return (up(chosen_logps) - up(ref_chosen_logps).detach()) - (up(rejected_logps) - up(ref_rejected_logps).detach())


def _check_beta(where: str, beta: float) -> None:
    if beta is None or not (math.isfinite(float(beta)) and beta > 0):
        raise ValueError(f"preference_loss '{where}': beta must be a number > 0 (DPO's paper uses 0.1 to 0.5), "
                         f"got {beta!r}")


@register_preference_loss("sigmoid")
def sigmoid(*, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
            ref_rejected_logps: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """DPO's loss, the Bradley-Terry likelihood of the preference under the implicit reward; cDPO with smoothing.

    ::

        h    = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))
        loss = -(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)      eps = label_smoothing

    ``eps = 0`` is DPO. ``eps > 0`` is conservative DPO: each label is taken
    to be flipped with probability ``eps``, so the loss no longer drives
    ``h`` to infinity but to the finite optimum ``beta * h = log((1 - eps) / eps)``;
    at ``eps = 0.5`` the label carries no information and the loss is
    symmetric in chosen and rejected (its gradient at ``h = 0`` is 0).

    Papers: Rafailov et al. 2023, "Direct Preference Optimization: Your
    Language Model is Secretly a Reward Model", arXiv:2305.18290 (Eq. 7);
    Mitchell 2023, "A note on DPO with noisy preferences & relationship to
    IPO" (cDPO; TRL's ``label_smoothing``).

    Shape: (P,) each -> (P,).
    """
    _check_beta("sigmoid", beta)
    if label_smoothing is None or not (0.0 <= float(label_smoothing) <= 0.5):
        raise ValueError(f"preference_loss 'sigmoid': label_smoothing must be in [0, 0.5] (the probability a "
                         f"label is flipped; 0 is plain DPO), got {label_smoothing!r}")
    logits = beta * logratio_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, "sigmoid")
    return -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


@register_preference_loss("ipo")
def ipo(*, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
        ref_rejected_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """IPO: a squared loss that regresses the log-ratio margin onto ``1 / (2 beta)`` instead of pushing it to infinity.

    ::

        loss = (h - 1 / (2 * beta))^2          h as in :func:`sigmoid`

    ``beta`` here is the paper's regulariser ``tau``: DPO overfits
    deterministic preferences (its optimum puts ``h`` at infinity, ignoring
    the reference), IPO's optimum keeps the margin at ``1 / (2 tau)``. ``h``
    is built from the log-probs the caller passes: summed over tokens as in
    the paper (TRL averages them over tokens first; pass means for that).

    Paper: Azar et al. 2023, "A General Theoretical Paradigm to Understand
    Learning from Human Preferences", arXiv:2310.12036 (Eq. 17).

    Shape: (P,) each -> (P,).
    """
    _check_beta("ipo", beta)
    h = logratio_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, "ipo")
    return (h - 1.0 / (2.0 * beta)).square()


@register_preference_loss("hinge")
def hinge(*, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
          ref_rejected_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """SLiC's calibration loss: a hinge on the log-ratio margin, ``max(0, 1 - beta * h)``.

    ::

        loss = max(0, 1 - beta * h)            h as in :func:`sigmoid`

    Pairs whose scaled margin already exceeds 1 contribute nothing. SLiC-HF
    writes it as ``max(0, delta - log pi(y_w) + log pi(y_l))`` on the policy's
    own log-probs; normalised by the reference (as TRL and DPO's follow-ups
    do) and with ``delta = 1 / beta`` it is the form above.

    Paper: Zhao et al. 2023, "SLiC-HF: Sequence Likelihood Calibration with
    Human Feedback", arXiv:2305.10425 (Eq. 1).

    Shape: (P,) each -> (P,).
    """
    _check_beta("hinge", beta)
    h = logratio_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, "hinge")
    return torch.relu(1.0 - beta * h)


@rltk.hookimpl
def rltk_preference_losses():
    """Register the builtin preference losses (each marked ``@register_preference_loss`` where it is defined)."""
    return PREFERENCE_LOSSES
