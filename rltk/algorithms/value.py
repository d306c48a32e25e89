"""Critic and entropy terms of the PPO objective.

Not registry components (their convention is fixed and there is one standard
form of each); recipes import them directly::

    from rltk.algorithms.value import clipped_value_loss, entropy_bonus

Both take a ``loss_agg`` bound exactly as for policy losses (see
:mod:`rltk.algorithms.policy_losses`), so gradient accumulation over
micro-batches stays exact.
"""

from __future__ import annotations

from typing import Callable

import torch

from rltk.algorithms.aggregation import masked_mean

__all__ = ["clipped_value_loss", "entropy_bonus", "entropy_loss"]

LossAgg = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _check_same_shape(where: str, **tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        listed = ", ".join(f"{k} {v}" for k, v in shapes.items())
        raise ValueError(f"{where}: every input must be the same [B, T]; got {listed}")


def clipped_value_loss(
    *,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg: LossAgg,
    clip_range: float | None = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss for the critic.

    ::

        V_clip = V_old + clip(V - V_old, -clip_range, clip_range)
        l_t    = 0.5 * max( (V - R)^2, (V_clip - R)^2 )
        loss   = loss_agg(l, response_mask)

    ``V`` are the critic's current ``values`` (with gradient), ``V_old`` its
    values when the batch was collected, ``R`` the ``returns`` of the advantage
    estimator (for GAE, ``A + V_old``). Taking the larger error keeps the
    critic from moving more than ``clip_range`` per batch on tokens where that
    would look like progress; the 0.5 makes the gradient ``V - R``.
    ``clip_range=None`` gives the plain squared error. Note the value scale:
    ``clip_range`` is in reward units, so rescale it with the rewards.

    Paper: Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
    arXiv:1707.06347 (value clipping as in the OpenAI baselines
    implementation; see Engstrom et al. 2020, "Implementation Matters in Deep
    Policy Gradients", arXiv:2005.12729).

    Metrics (detached 0-dim tensors, local masked means):
    ``vf_clip_frac`` fraction of tokens where the clipped error is the larger
    one (no gradient there), ``vf_explained_var`` ``1 - Var(R - V) / Var(R)``
    (1 is a perfect critic, 0 no better than the mean return; ``Var(R)`` is
    floored at 1e-8), ``values_mean``.

    Shape: (B, T) each -> loss (), metrics {name: ()}.
    """
    _check_same_shape(
        "clipped_value_loss", values=values, old_values=old_values, returns=returns,
        response_mask=response_mask,
    )
    if clip_range is not None and not clip_range > 0:
        raise ValueError(
            f"clipped_value_loss: clip_range must be > 0 (in reward units, e.g. 0.2) or None for "
            f"no clipping, got {clip_range!r}"
        )
    on = response_mask > 0
    # where, not a multiply by the mask: garbage on padding must not reach the gradient.
    values = torch.where(on, values, 0.0)
    returns = torch.where(on, returns.detach(), 0.0)
    old_values = torch.where(on, old_values.detach(), 0.0)
    unclipped = (values - returns).square()
    if clip_range is None:
        loss_mat = 0.5 * unclipped
        clipped_more = torch.zeros_like(on)
    else:
        values_clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped = (values_clipped - returns).square()
        loss_mat = 0.5 * torch.maximum(unclipped, clipped)
        clipped_more = clipped > unclipped

    with torch.no_grad():
        residual = (returns - values).detach()
        residual_var = masked_mean((residual - masked_mean(residual, on)).square(), on)
        returns_var = masked_mean((returns - masked_mean(returns, on)).square(), on)
        metrics = {
            "vf_clip_frac": masked_mean(clipped_more.to(torch.float32), on),
            "vf_explained_var": 1.0 - residual_var / returns_var.clamp(min=1e-8),
            "values_mean": masked_mean(values.detach(), on),
        }
    return loss_agg(loss_mat, response_mask), metrics


def entropy_bonus(entropy: torch.Tensor, response_mask: torch.Tensor, loss_agg: LossAgg) -> torch.Tensor:
    """The aggregated per-token entropy of the policy, to be maximised.

    ``H = loss_agg(entropy, response_mask)`` with ``entropy_t = -sum_v
    pi(v | s_t) log pi(v | s_t)`` (e.g. from
    ``rltk.kernels.token_logprobs_and_entropy``). It is a positive bonus: the
    recipe adds ``-entropy_coef * H`` to the loss, so gradients raise the
    entropy. Aggregate it with the same ``loss_agg`` as the policy loss so both
    weigh tokens alike.

    Paper: Williams & Peng 1991, "Function Optimization Using Connectionist
    Reinforcement Learning Algorithms" (entropy regularisation); Mnih et al.
    2016, "Asynchronous Methods for Deep Reinforcement Learning",
    arXiv:1602.01783.

    Shape: (B, T), (B, T) -> ().
    """
    _check_same_shape("entropy_bonus", entropy=entropy, response_mask=response_mask)
    return loss_agg(entropy, response_mask)


# The same aggregated entropy under the name recipes may look for; it returns
# +H (a bonus): subtract ``coef * entropy_loss(...)`` from the loss.
entropy_loss = entropy_bonus
