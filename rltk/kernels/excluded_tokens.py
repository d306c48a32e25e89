"""The head op's outputs for the softmax with a few tokens excluded, from the full softmax's outputs.

A rollout engine that never samples some tokens (a VLM's image and video placeholders:
:func:`rltk.models.vision.tower.vision_token_ids`) samples from ``p'``, the softmax renormalised without
them, and records ``log p'``. The trainer must score that same distribution, or every ratio
``pi_trainer / pi_engine`` is ``1 - S`` instead of 1. With ``u = (h W^T + b) / T`` the scaled logits, ``y``
the label and ``B`` the excluded set (``|B|`` a handful of rows of the head, so no ``[N, V]`` tensor):

    log p_b = u_b - lse = u_b - u_y + log p_y      (lse, the full log-normaliser, read off the op's output)
    S = sum_{b in B} p_b                           (the excluded mass)
    log p'_y = log p_y - log(1 - S)                (y outside B; see below for y in B)
    H' = -sum_{v not in B} p'_v log p'_v = (H + sum_b p_b log p_b) / (1 - S) + log(1 - S)
    sum_v p'_v^2 = (sum_v p_v^2 - sum_b p_b^2) / (1 - S)^2

A label in ``B`` has no log-prob under ``p'`` (-inf): no engine sampled it, so it is a token the response holds
from elsewhere (an environment turn's image placeholders inside a multi-turn response, masked from the loss). It
keeps its full-softmax log-prob instead, finite, so that the loss's masking (a product with 0) stays clean.

Each line follows from ``p'_v = p_v / (1 - S)`` on ``v`` outside ``B``. Exact (fp32 rounding apart) and
differentiable by autograd through the op's own outputs and the ``|B|`` extra logits, so the fused kernels
stay as they are.
"""

from __future__ import annotations

import math

import torch

from rltk.kernels.logprobs import IGNORE_INDEX


def exclude_tokens(outputs: tuple[torch.Tensor, ...], hidden: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, labels: torch.Tensor, excluded: list[int], *,
                   temperature: float, ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, ...]:
    """``(logprobs, entropy[, sum_pi_squared])`` of :func:`rltk.kernels.token_logprobs_and_entropy` turned into
    those of the softmax without the ``excluded`` token ids (formulas in the module docstring).

    Args:
        outputs: the op's outputs for ``hidden``, ``weight``, ``bias``, ``labels`` at ``temperature``. Shape: (N,) each.
        hidden: Shape: (N, D). weight: Shape: (V, D). bias: Shape: (V,) or None. labels: Shape: (N,).
        excluded: the token ids the sampler never draws; an empty list returns ``outputs`` unchanged.
        temperature: the one the op applied (the model's own logit scaling included).
        ignore_index: labels without a target (an excluded label keeps the full softmax's log-prob, see the module): their log-prob stays 0 and their entropy is left as the op gave
            it (no normaliser can be read from a log-prob of 0; callers mask those positions).
    """
    if not excluded:
        return outputs
    logprobs, entropy = outputs[0], outputs[1]
    valid = labels != ignore_index
    targets = labels.masked_fill(~valid, 0)
    rows = torch.tensor(excluded, dtype=torch.long, device=weight.device)
    h = hidden.float()
    banned_logits = h @ weight[rows].float().T  # [N, |B|]
    target_logits = (h * weight[targets].float()).sum(-1)  # [N]
    if bias is not None:
        banned_logits = banned_logits + bias[rows].float()
        target_logits = target_logits + bias[targets].float()
    banned_logits, target_logits = banned_logits / temperature, target_logits / temperature
    # log p_b = u_b - lse = u_b - u_y + log p_y, with no large normaliser to cancel; an ignored label gets a
    # stand-in normaliser (S = 1/2 there) so that every branch stays finite (a NaN in a branch torch.where
    # drops still poisons the gradient)
    stand_in = -banned_logits.detach().logsumexp(-1, keepdim=True) - math.log(2.0)
    log_p_banned = banned_logits + torch.where(valid, logprobs - target_logits, 0.0)[:, None]
    log_p_banned = torch.where(valid[:, None], log_p_banned, banned_logits + stand_in)  # [N, |B|]
    p_banned = log_p_banned.exp()
    # 1 - S; kept above 0 where rounding would take an almost wholly excluded distribution through it
    kept = (1.0 - p_banned.sum(-1)).clamp(min=torch.finfo(torch.float32).tiny)
    log_kept = torch.log(kept)
    target_banned = (targets[:, None] == rows).any(-1) & valid
    new_logprobs = torch.where(valid & ~target_banned, logprobs - log_kept, logprobs)
    kept_entropy = (entropy + (p_banned * log_p_banned).sum(-1)) / kept + log_kept
    new_entropy = torch.where(valid, kept_entropy, entropy)
    result = (new_logprobs, new_entropy)
    if len(outputs) > 2:
        sum_pi_squared = outputs[2]
        corrected = (sum_pi_squared - p_banned.detach().square().sum(-1)) / kept.detach().square()
        result += (torch.where(valid, corrected, sum_pi_squared),)
    return result
