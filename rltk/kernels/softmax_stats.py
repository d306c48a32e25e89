"""The last step of an online softmax, shared by every backend of the fused log-prob op and by its
vocabulary-parallel form: per-token statistics at one max turned into log-sum-exp, mean logit and entropy."""

from __future__ import annotations

import torch


def finish_softmax_stats(run_max: torch.Tensor, run_sum: torch.Tensor,
                         run_wsum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lse, E_p[z], entropy)`` per token from online-softmax stats at one max ``m``:
    ``s = sum e^(z-m)`` and ``w = sum e^(z-m) (z-m)`` give ``lse = m + log s``, ``E_p[z] = m + w / s`` and
    ``entropy = lse - E_p[z] = log s - w / s``. Shape: (N,) each."""
    log_sum = run_sum.log()
    mean_shifted = run_wsum / run_sum  # E_p[z] - m
    return run_max + log_sum, run_max + mean_shifted, log_sum - mean_shifted
