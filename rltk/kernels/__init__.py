"""Fused per-token log-probabilities and entropy from hidden states and the LM head.

``token_logprobs_and_entropy(hidden [N, D], weight [V, D], labels [N]) -> (logprobs [N], entropy [N])``
never holds the ``[N, V]`` logits; ``with_sum_pi_squared=True`` adds ``sum_v p_v^2`` per token
from the same pass. See :mod:`rltk.kernels.logprobs`.
"""

from rltk.kernels.logprobs import (
    IGNORE_INDEX,
    IMPLS,
    naive_token_logprobs_and_entropy,
    resolve_impl,
    token_logprobs_and_entropy,
)

__all__ = [
    "IGNORE_INDEX",
    "IMPLS",
    "naive_token_logprobs_and_entropy",
    "resolve_impl",
    "token_logprobs_and_entropy",
]
