"""Advantage estimators: how much better each response token did than expected.

Every estimator is a pure function called with keyword arguments only. It names
in its signature the batch fields it needs (the recipe passes exactly those,
see :class:`rltk.training.step.estimator.Estimator`) plus its own configured arguments,
and returns ``(advantages, returns)``, both ``[B, T]`` float32 (what the
outcome estimators' ``returns`` hold off the mask: see "What consumers may rely
on" below).

Batch fields an estimator may declare (``T`` is the response width):

=====================  ========  ===================================================
``token_rewards``      ``[B,T]`` per-token reward; an outcome reward sits on the last
                                 response token, a KL penalty folded into the reward
                                 (:func:`rltk.algorithms.kl.apply_kl_penalty`) on
                                 every policy token
``response_mask``      ``[B,T]`` 1 on tokens the policy produced, 0 on padding and on
                                 environment/tool tokens inside a response
``group_ids``          ``[B]``   int64; responses to one prompt share an id. Ids need
                                 not be contiguous, sorted or adjacent
``values``             ``[B,T]`` critic value of the state before each token
``baseline_scores``    ``[B]``   ReMax: the reward of the greedy response
``old_logprobs``       ``[B,T]`` the behaviour policy's log-probs of the sampled tokens
``reward_components``  ``[B,K]`` gdpo: the unweighted score of each of the K reward
                                 functions (config order); the recipes fill it
                                 only for an estimator that names it
``sum_pi_squared``     ``[B,T]`` optimal_token_baseline: ``sum_v pi(v)^2`` of each
                                 token's distribution under the behaviour policy;
                                 the recipes fill it only for an estimator that
                                 names it
``teacher_logprobs``   ``[B,T]`` on_policy_distill: a teacher's log-probs of the
                                 sampled tokens (the distill recipe's teacher pass)
``sequence_rewards``   ``[B]``   optional, outcome estimators: ``token_rewards.sum(-1)``
                                 in float32, the return ``R_i`` (see below)
``policy_lengths``     ``[B]``   optional, opo / REINFORCE++-baseline / gdpo:
                                 ``response_mask.sum(-1)``, the policy tokens ``l_i``
=====================  ========  ===================================================

Conventions of the outcome (critic-free) estimators ``grpo``, ``rloo``,
``reinforce_plus_plus_baseline``, ``remax``, ``opo``, ``grpo_passk``, ``gdpo``
and ``gpg`` (``optimal_token_baseline`` keeps the group conventions, per token):

* A response's return is ``R_i = sum_t token_rewards[i, t]`` over the whole
  row, so a reward the workflow placed on an environment token still counts and
  a KL penalty folded into the rewards is part of the return. With pure outcome
  rewards ``R_i`` is the ``scores`` field.
* They are sequence-level: every policy token of response ``i`` gets the same
  advantage ``A_i``. Their ``returns`` are ``R_i`` on every token of row ``i``,
  padding included: a broadcast view of the ``[B]`` returns (they train no
  critic; the field is there for logging, a critic if one is attached, and a
  uniform contract).
* A group of one response, and a group whose returns are all equal, says
  nothing about which response was better: its advantage is exactly 0 (not NaN,
  not the raw score). Equality is tested on the returns themselves, up to the
  rounding of their float32 sums over tokens (``EQUAL_WITHIN_ULPS``), so such
  groups never get rounding noise blown up by a tiny standard deviation.
* Group statistics are float64 segment reductions over a group index
  (:class:`rltk.algorithms.groups.Groups`): no Python loop over groups, and a
  handful of ``[B]`` kernels, so an outcome estimator costs writing its
  advantages, plus one row sum of ``token_rewards`` unless the caller passes
  ``sequence_rewards`` (``benchmarks/advantages.py``).
* ``sequence_rewards`` and ``policy_lengths`` are optional ``[B]`` inputs
  that only save work: ``R_i`` is a ``[B, T]`` pass over ``token_rewards`` and
  ``l_i`` one over ``response_mask``, each about as long as writing the
  advantages, and the caller usually has them already.
  :func:`rltk.batch.collate` computes both once per batch, and the trainer
  retakes them where ``token_rewards`` or the mask changed since, e.g. a KL
  penalty folded into the rewards (:func:`rltk.batch.refresh_row_sums`).
  A caller that passes them promises ``sequence_rewards ==
  token_rewards.float().sum(-1)`` and ``policy_lengths ==
  response_mask.sum(-1)`` (same responses, same order): the estimators cannot
  check this without the very pass they save. Given or not, the results agree
  (bit for bit when the values are those sums).

What consumers may rely on
--------------------------

* ``advantages`` is a new, contiguous ``[B, T]`` float32 tensor, zero off
  ``response_mask``, aliasing no input and not ``returns``: the caller owns it
  and may modify it in place.
* ``returns`` has the documented values on every policy token. Off the mask it
  is 0 for the per-token estimators (``gae``, ``reinforce_plus_plus``,
  ``optimal_token_baseline``), whose returns are new contiguous tensors like
  the advantages. For the outcome estimators it is ``R_i`` there too: a
  read-only stride-0 view ``R[:, None].expand(B, T)`` of a ``[B]`` tensor the
  estimator allocated, which never aliases an input or the advantages.
  Writing a second ``[B, T]`` tensor would cost as much as the advantages
  themselves, for a field nothing reads off the mask.
* So a consumer masks ``returns`` before reducing over them (every rltk
  consumer does: the clipped value loss, explained variance and the logged
  means select policy tokens), never writes into them, and calls
  ``.contiguous()`` (or multiplies by the mask) when it needs a dense tensor,
  e.g. to ``.view`` it. An element-wise in-place op on the view raises, but
  an indexed write (``returns[m] = x``, ``masked_fill_``) only warns that it
  is deprecated and changes every token of the row. Indexing, slicing,
  ``.to(device)``, ``.clone()`` and arithmetic work on the view as on a dense
  tensor (the results are dense).

The time-dependent estimators (``gae``, ``reinforce_plus_plus``) treat the
policy tokens of a row as its time steps. Masked tokens inside a response (tool
or environment output) are not steps: the next value, return and advantage are
carried over them unchanged, and a reward placed on a masked token is credited,
undiscounted, to the policy token before it (a reward on masked tokens before
the first policy token has no action to credit and is dropped).
"""

from __future__ import annotations

import math

import torch

import rltk
from rltk.algorithms.groups import EQUAL_WITHIN_ULPS, Groups, group_index

__all__ = [
    "gae",
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "grpo_passk",
    "gdpo",
    "gpg",
    "optimal_token_baseline",
    "on_policy_distill",
    "masked_whiten",
    "discounted_returns",
]


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------


#: The ``[B]`` fields an estimator may take (one entry per response); every other checked tensor is ``[B, T]``.
PER_RESPONSE_FIELDS = frozenset({"group_ids", "baseline_scores", "sequence_rewards", "policy_lengths"})


def _check_inputs(where: str, **tensors: torch.Tensor | None) -> tuple[int, int]:
    """The input check every estimator opens with: the token tensors share one ``[B, T]`` shape, the
    per-response ones (:data:`PER_RESPONSE_FIELDS`) are ``[B]`` and ``group_ids`` are integers.

    Token tensors are checked first, then the per-response ones, each in the order given; ``B, T`` are
    those of the first token tensor. ``None`` is an optional field that was not given.
    """
    given = {name: tensor for name, tensor in tensors.items() if tensor is not None}
    token_tensors = {name: t for name, t in given.items() if name not in PER_RESPONSE_FIELDS}
    first_name, first = next(iter(token_tensors.items()))
    if first.dim() != 2:
        raise ValueError(
            f"{where}: {first_name} must be a [B, T] tensor (one row per response), "
            f"got shape {tuple(first.shape)}"
        )
    B, T = first.shape
    for name, tensor in token_tensors.items():
        if tuple(tensor.shape) != (B, T):
            raise ValueError(
                f"{where}: {name} has shape {tuple(tensor.shape)} but {first_name} has "
                f"{(B, T)}; every token tensor must be [B, T] over the same responses"
            )
    for name, tensor in ((n, t) for n, t in given.items() if n in PER_RESPONSE_FIELDS):
        if tuple(tensor.shape) != (B,):
            raise ValueError(
                f"{where}: {name} has shape {tuple(tensor.shape)} but must be [B] = ({B},), "
                f"one entry per response (B taken from {first_name} {(B, T)})"
            )
        if name == "group_ids" and (tensor.is_floating_point() or tensor.is_complex()):
            raise ValueError(
                f"{where}: group_ids must be an integer tensor (int64 prompt ids), got dtype "
                f"{tensor.dtype}; float ids would group responses by rounding accidents"
            )
    return B, T


def _check_unit_interval(where: str, **params: float) -> None:
    for name, value in params.items():
        if not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"{where}: {name} must be in [0, 1], got {value}")


# --------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------
# On CPU a fresh [B, T] tensor costs more than the arithmetic on it (the
# allocator maps and faults in new pages), so the hot paths below reuse buffers
# and work in place.


def _whiten_(x: torch.Tensor, on: torch.Tensor, eps: float) -> torch.Tensor:
    """In-place :func:`masked_whiten` of ``x``, which must already be 0 where ``on`` is 0."""
    if x.numel() == 0:
        return x
    count = on.sum().clamp(min=1)
    # Shift by one masked entry first: equal entries then become exactly 0, so
    # an all-equal batch whitens to exactly 0 instead of rounding noise divided
    # by a rounding-noise std. (It also keeps the variance sum well conditioned.)
    reference = x.reshape(-1)[on.reshape(-1).argmax()].clone()
    x.sub_(reference).mul_(on)
    x.sub_(x.sum() / count).mul_(on)
    std = torch.linalg.vector_norm(x) / count.sqrt()
    return x.div_(std + eps)


def _whiten_sequences(x: torch.Tensor, lengths: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`masked_whiten` of a sequence-level value ``x_i`` repeated on the
    ``l_i`` policy tokens of row ``i``, computed on ``[B]`` instead of ``[B, T]``::

        mean = sum_i l_i x_i / sum_i l_i,   var = sum_i l_i (x_i - mean)^2 / sum_i l_i

    Shape: (B,), (B,) float64 -> (B,) float64.
    """
    count = lengths.sum()
    if count == 0:
        return torch.zeros_like(x)
    # As in _whiten_: shift by a row that has tokens, so an all-equal batch is exactly 0.
    # (index_select: indexing with a 0-dim tensor takes the slower advanced-indexing path.)
    shifted = x - x.index_select(0, lengths.argmax().view(1))
    weighted = lengths * shifted
    shifted.sub_(weighted.sum() / count)
    # At B = 8192 each [B] kernel costs more in overhead than in arithmetic: reuse the buffers.
    std = (torch.mul(shifted, shifted, out=weighted).mul_(lengths).sum() / count).sqrt_()
    return shifted.div_(std + eps)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8) -> torch.Tensor:
    """Normalise ``values`` to zero mean and unit variance over the masked tokens.

    ``out = (x - mean) / (std + eps)``, with ``mean`` and the population
    (biased, ``1/n``) ``std`` over every token where ``mask`` is 1 in the whole
    batch. If every masked value is equal the result is exactly 0; an all-zero
    mask gives all zeros. The output is zero outside the mask.

    Shape: ``values`` (B, T), ``mask`` (B, T) -> (B, T) float32.
    """
    policy = mask > 0
    out = torch.where(policy, values.detach().to(torch.float32), 0.0)
    return _whiten_(out, policy.to(torch.float32), eps)


def _reverse_discounted_cumsum(x: torch.Tensor, discount: float, chunk: int = 64) -> torch.Tensor:
    """``s_t = x_t + discount * s_{t+1}`` (``s_T = 0``) for a constant discount.

    A sequential scan over 2048 steps is dominated by per-step overhead, so
    time is cut into chunks of ``L`` steps: within a chunk the sums are one
    batched matmul with the ``[L, L]`` matrix of powers ``discount^(k - t)``,
    and only the ``T / L`` chunk boundaries are chained in a loop. Powers stay
    in ``[0, 1]`` (no overflow, exact for ``discount = 0``).

    Shape: (B, T) -> (B, T) float32, a new tensor.
    """
    B, T = x.shape
    L = max(1, min(chunk, T))
    n_chunks = -(-T // L)
    padded = torch.nn.functional.pad(x, (0, n_chunks * L - T)) if n_chunks * L != T else x.contiguous()
    # A float32 matmul may silently run in TF32 / bf16 (GPUs, or any device once
    # torch.set_float32_matmul_precision lowered it): ~1e-3 relative error in
    # every advantage. Use float64 there; plain float32 is exact enough on CPU.
    exact = x.device.type == "cpu" and torch.get_float32_matmul_precision() == "highest"
    dtype = torch.float32 if exact else torch.float64
    steps = torch.arange(L, device=x.device, dtype=dtype)
    gap = steps[None, :] - steps[:, None]  # [L, L]: k - t
    base = torch.tensor(discount, device=x.device, dtype=dtype)
    powers = torch.where(gap >= 0, torch.pow(base, gap.clamp(min=0)), 0.0)
    local = torch.matmul(padded.view(B, n_chunks, L).to(dtype), powers.t())  # [B, n, L] sums within a chunk
    # s at the start of each chunk, chained from the last chunk backwards.
    chunk_starts = local[:, :, 0]  # [B, n]
    next_start = torch.zeros(B, n_chunks, device=x.device, dtype=dtype)  # s at the start of chunk j + 1
    carry = torch.zeros(B, device=x.device, dtype=dtype)
    span = discount**L
    for j in range(n_chunks - 1, 0, -1):
        carry = chunk_starts[:, j] + span * carry
        next_start[:, j - 1] = carry
    # Position t of a chunk sees the next chunk's start discounted by discount^(L - t).
    local.addcmul_(next_start[:, :, None], torch.pow(base, L - steps))
    out = local.view(B, n_chunks * L)[:, :T].to(torch.float32)
    return out if out.is_contiguous() else out.contiguous()


def _layout(policy: torch.Tensor, rewards: torch.Tensor) -> tuple[bool, bool]:
    """(every row's policy tokens form one contiguous run, some reward sits on a masked token)."""
    if policy.numel() == 0:
        return True, False
    segments = policy[:, 0].to(torch.int64)
    if policy.shape[1] > 1:
        segments = segments + (policy[:, 1:] > policy[:, :-1]).sum(-1)
    contiguous = (segments <= 1).all()
    stray_reward = ((rewards != 0) > policy).any()
    return bool(contiguous), bool(stray_reward)


def _credit_trailing_rewards(rewards: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """For rows with one contiguous run of policy tokens: rewards on masked
    tokens after the run go to its last token, those before it are dropped.

    Shape: (B, T), (B, T) -> (B, T), 0 off the mask.
    """
    T = on.shape[1]
    positions = torch.arange(T, device=on.device, dtype=torch.float32)
    last = (on * (positions + 1)).amax(-1, keepdim=True) - 1  # [B, 1], -1 for an empty row
    trailing = torch.where(positions > last, rewards, 0.0).sum(-1, keepdim=True)  # [B, 1]
    credited = rewards * on
    has_token = last >= 0
    credited.scatter_add_(1, last.clamp(min=0).to(torch.int64), torch.where(has_token, trailing, 0.0))
    return credited


def _compact(
    rewards: torch.Tensor, values: torch.Tensor | None, on: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Move each row's policy tokens to the front, in order, so that the time
    steps of every row become one contiguous run starting at column 0.

    Token ``t`` belongs to slot ``(number of policy tokens in [0, t]) - 1``: a
    policy token to its own slot, a masked token to the slot of the policy
    token before it. Rewards are summed into their slot, which is exactly the
    credit rule for rewards on masked tokens; those before the first policy
    token (slot -1) go to a discarded extra column, like the values of masked
    tokens.

    On CUDA, ``scatter_add_`` sums with atomics: when several rewards share a
    slot their order, and so the last bits of the sum, may differ between runs.

    Shape: (B, T) each -> compact rewards (B, T), compact values (B, T) or
    None, compact mask (B, T), and the slot index (B, T) to gather results back
    (T for masked tokens).
    """
    B, T = on.shape
    slot = on.cumsum(-1).sub_(1).to(torch.int64)  # [B, T]
    reward_slot = slot.masked_fill_(slot < 0, T)
    compact_rewards = torch.zeros(B, T + 1, device=on.device).scatter_add_(1, reward_slot, rewards)
    policy_slot = reward_slot.masked_fill(on == 0, T)
    compact_values = None
    if values is not None:
        # Several masked tokens write to the discarded column T; which one wins does not matter.
        compact_values = torch.zeros(B, T + 1, device=on.device).scatter_(1, policy_slot, values)
        compact_values = compact_values[:, :T]
    lengths = on.sum(-1, keepdim=True)
    compact_on = (torch.arange(T, device=on.device) < lengths).to(torch.float32)
    return compact_rewards[:, :T] * compact_on, compact_values, compact_on, policy_slot


def _expand(compact: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_compact` for a result: back to each policy token's column, 0 elsewhere."""
    return torch.nn.functional.pad(compact, (0, 1)).gather(1, slot)


def _gae_contiguous(
    rewards: torch.Tensor, values: torch.Tensor | None, on: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """GAE for rows whose policy tokens form one contiguous run, with ``values``
    (or zero values when None) and ``rewards`` already 0 off the mask.

    The next policy token of ``t`` is ``t + 1`` or none, so ``V_{t'}`` is the
    left shift of ``V`` (0 off the mask) and ``A`` is a reverse discounted
    cumulative sum of the TD errors with the constant discount ``gamma * lam``.

    Shape: (B, T) each -> (B, T).
    """
    if values is None:
        deltas = rewards.clone()
    else:
        deltas = torch.empty_like(values)
        deltas[:, -1:] = 0.0
        torch.mul(values[:, 1:], gamma, out=deltas[:, :-1])
        deltas.add_(rewards).sub_(values)
    deltas.mul_(on)
    return _reverse_discounted_cumsum(deltas, gamma * lam).mul_(on)


def _gae_any_layout(
    rewards: torch.Tensor, values: torch.Tensor | None, on: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """GAE for any mask: the fast contiguous path, after compacting the policy
    tokens when masked tokens interrupt a response or carry rewards.

    Shape: (B, T) each -> (B, T).
    """
    contiguous, stray_reward = _layout(on > 0, rewards)
    if contiguous:
        if stray_reward:
            rewards = _credit_trailing_rewards(rewards, on)
        return _gae_contiguous(rewards, values, on, gamma, lam)
    compact_rewards, compact_values, compact_on, slot = _compact(rewards, values, on)
    advantages = _gae_contiguous(compact_rewards, compact_values, compact_on, gamma, lam)
    return _expand(advantages, slot)


def discounted_returns(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """Discounted return of every policy token, skipping masked tokens.

    ``G_t = r'_t + gamma * G_{t'}`` with ``t'`` the next policy token (``G = 0``
    after the last one) and ``r'_t`` = ``r_t`` plus any reward on masked tokens
    between ``t`` and ``t'``. For a contiguous mask this is the textbook
    ``G_t = sum_{k >= t} gamma^(k - t) r_k``.

    Shape: (B, T), (B, T) -> (B, T) float32, zero outside the mask.
    """
    _check_inputs("discounted_returns", token_rewards=token_rewards, response_mask=response_mask)
    _check_unit_interval("discounted_returns", gamma=gamma)
    policy = response_mask > 0
    on = policy.to(torch.float32)
    rewards = token_rewards.detach().to(torch.float32)
    # With zero values and lam = 1 the GAE recursion is the return recursion.
    return _gae_any_layout(rewards, None, on, gamma, 1.0)


def _sequence_returns(token_rewards: torch.Tensor, sequence_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """``R_i = sum_t token_rewards[i, t]``, summed in float32, or the caller's ``sequence_rewards``.

    The row sum reads all of ``token_rewards``, most of an outcome
    estimator's cost besides its output, so a caller that already has the
    sums passes them (see the module doc). They are copied: the returns view
    must not alias an input.

    Shape: (B, T), optional (B,) -> (B,) float32, a new tensor.
    """
    if sequence_rewards is None:
        return token_rewards.detach().to(torch.float32).sum(-1)
    return sequence_rewards.detach().to(torch.float32, copy=True)


def _policy_lengths(weights: torch.Tensor, policy_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """``l_i = sum_t weights[i, t]``, the policy tokens of each response, or the caller's ``policy_lengths``.

    ``weights`` is :func:`_policy_weights` of the mask. Counts of 0/1 tokens
    are exact integers in float32 (below 2^24 tokens a row), so the given
    lengths give the same float64 values as the sum, without its ``[B, T]`` pass.

    Shape: (B, T), optional (B,) -> (B,) float64.
    """
    if policy_lengths is None:
        return weights.sum(-1).to(torch.float64)
    return policy_lengths.detach().to(torch.float64)


def _policy_weights(response_mask: torch.Tensor) -> torch.Tensor:
    """``response_mask`` as float32 0/1: itself when it already is float32 (the
    batch contract), else ``(response_mask > 0)`` as float32."""
    if response_mask.dtype == torch.float32:
        return response_mask.detach()
    return (response_mask > 0).to(torch.float32)


def _output(response_mask: torch.Tensor) -> torch.Tensor:
    """The uninitialised ``[B, T]`` float32 advantages of an outcome estimator, allocated first.

    On CPU, writing into memory the process already holds costs half as much
    as writing into fresh pages. glibc serves a ``[B, T]`` request from the
    ``[B, T]`` block the previous step freed only if no small allocation has
    split that block first, and the group statistics make a few dozen small
    ones: allocated after them, the output lands on new pages (~4000 page
    faults at ``B = 8192, T = 512``) about half the time.
    """
    return torch.empty(response_mask.shape, dtype=torch.float32, device=response_mask.device)


def _sequence_level(
    advantage: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Put per-response ``A_i`` on every policy token and ``R_i`` on every token of row ``i``.

    The advantages are the one ``[B, T]`` tensor an outcome estimator writes:
    a broadcast multiply by the 0/1 mask into ``out`` (a ``where`` on a
    bool mask costs a comparison pass plus a slower select, about 3x the time
    on CPU). The returns are a stride-0 broadcast view of the ``[B]`` returns
    (see "What consumers may rely on" in the module doc): writing a second
    ``[B, T]`` tensor would double the estimator's cost for a field that only
    a critic reads, and a critic masks its targets anyway.

    ``out`` is :func:`_output`; ``returns`` must be a tensor the estimator
    allocated (the view must not alias an input).

    Shape: (B,), (B,), (B, T), (B, T) -> (B, T) contiguous, (B, T) view with strides (1, 0); float32.
    """
    B, T = response_mask.shape
    torch.mul(_policy_weights(response_mask), advantage.to(torch.float32)[:, None], out=out)
    return out, returns.to(torch.float32)[:, None].expand(B, T)


def _outcome_inputs(where: str, token_rewards: torch.Tensor, response_mask: torch.Tensor,
                    sequence_rewards: torch.Tensor | None = None, policy_lengths: torch.Tensor | None = None,
                    **per_response: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The opening of an outcome estimator: :func:`_check_inputs`, then its output allocated (first: see
    :func:`_output`) and the returns ``R_i`` (:func:`_sequence_returns`).

    ``per_response``: the ``[B]`` fields it reads (``group_ids``, ``baseline_scores``).

    Shape: (B, T), (B, T)[, (B,), (B,)], (B,) each -> (B, T) uninitialised, (B,) float32.
    """
    _check_inputs(where, token_rewards=token_rewards, response_mask=response_mask, **per_response,
                  sequence_rewards=sequence_rewards, policy_lengths=policy_lengths)
    return _output(response_mask), _sequence_returns(token_rewards, sequence_rewards)


# --------------------------------------------------------------------------
# Estimators
# --------------------------------------------------------------------------

#: The builtin estimators by config name, filled by ``@register_advantage_fn(name)`` on each definition and
#: returned by this module's ``rltk_advantage_fns`` hook (the entry point ``advantages``).
ADVANTAGE_FNS = rltk.ComponentTable("advantage_fn")
register_advantage_fn = ADVANTAGE_FNS.register


@register_advantage_fn("gae")
def gae(
    *,
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = True,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation with a critic (PPO's estimator).

    Over the policy tokens ``t`` of a row, ``t'`` the next one::

        delta_t = r'_t + gamma * V_{t'} - V_t          (V_{t'} = 0 after the last token)
        A_t     = delta_t + gamma * lam * A_{t'}
        returns = A_t + V_t                            (the critic's regression target)

    ``r'_t`` is ``r_t`` plus the rewards on masked tokens before ``t'``. Masked
    tokens inside a response (tool output) are not time steps: the next value
    and advantage are carried over them unchanged. ``whiten=True`` (PPO's
    default) then normalises the advantages over all policy tokens of the batch
    (:func:`masked_whiten`); ``returns`` always come from the raw advantages.

    ``gamma = lam = 1`` with zero values gives the reward-to-go; ``lam = 0``
    gives one-step TD errors. Defaults follow LLM PPO practice: gamma 1
    (episodes are short, rewards sparse) and lam 0.95 (OpenAI's
    lm-human-preferences, TRL and OpenRLHF use it).

    Paper: Schulman et al. 2016, "High-Dimensional Continuous Control Using
    Generalized Advantage Estimation", arXiv:1506.02438.

    Shape: ``token_rewards``, ``values``, ``response_mask`` (B, T) -> (B, T), (B, T).
    """
    _check_inputs("gae", token_rewards=token_rewards, values=values, response_mask=response_mask)
    _check_unit_interval("gae", gamma=gamma, lam=lam)
    policy = response_mask > 0
    on = policy.to(torch.float32)
    rewards = token_rewards.detach().to(torch.float32)
    # Critics may emit anything on padding; never let it reach a policy token.
    values = torch.where(policy, values.detach().to(torch.float32), 0.0)  # [B, T]
    advantages = _gae_any_layout(rewards, values, on, gamma, lam)
    returns = values.add_(advantages)  # reuses the values buffer: V + A, zero off the mask
    if whiten:
        advantages = _whiten_(advantages, on, eps)
    return advantages, returns


@register_advantage_fn("grpo")
def grpo(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    sequence_rewards: torch.Tensor | None = None,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantage (GRPO); ``norm_by_std=False`` is Dr. GRPO.

    For response ``i`` in group ``g`` with return ``R_i``::

        A_i = (R_i - mean_g(R)) / (std_g(R) + eps)      norm_by_std=True
        A_i =  R_i - mean_g(R)                          norm_by_std=False

    on every policy token of ``i``. ``std_g`` is the unbiased (Bessel-corrected,
    ``1/(n-1)``) standard deviation, as in TRL, verl and OpenRLHF. Groups of
    one and all-equal groups get ``A = 0``.

    Papers: Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical
    Reasoning in Open Language Models", arXiv:2402.03300 (GRPO); Liu et al.
    2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
    arXiv:2503.20783 (Dr. GRPO: dividing by the std up-weights groups that are
    nearly all right or all wrong).

    ``sequence_rewards`` (optional, ``[B]``): ``R``, precomputed as
    ``token_rewards.float().sum(-1)``; saves the row sum (see the module doc).

    Shape: (B, T), (B, T), (B,)[, (B,)] -> (B, T), (B, T).
    """
    out, returns = _outcome_inputs("grpo", token_rewards, response_mask, sequence_rewards, group_ids=group_ids)
    groups = Groups.of(group_ids)
    advantage = groups.centred(returns.to(torch.float64))
    if norm_by_std:
        advantage = advantage / (groups.expand(groups.std(advantage) + eps))
    return _sequence_level(advantage, returns, response_mask, out)


@register_advantage_fn("opmd")
def opmd(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    sequence_rewards: torch.Tensor | None = None,
    baseline: str = "mean",
    tau: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPMD's advantage: the return minus a group baseline, the mean or the soft maximum ``tau * log mean exp(R / tau)``.

    For response ``i`` in group ``g`` of ``n_g`` responses::

        A_i = R_i - mean_g(R)                                     baseline="mean"
        A_i = R_i - tau * log( (1/n_g) sum_{j in g} exp(R_j / tau) )   baseline="logavgexp"

    on every policy token of ``i``, no division by a standard deviation.
    ``logavgexp`` is the log-partition of the KL-regularised optimum
    ``pi* ~ pi exp(R / tau)`` estimated from the group's samples: every
    response then gets ``A <= max_g R - baseline``, and as ``tau`` grows it
    tends to the mean. A group of one gets the baseline 0 in Trinity-RFT (its
    raw return); here it gets ``A = 0`` like every builtin outcome estimator:
    one response says nothing about which answer was better. All-equal groups
    get ``A = 0`` under both baselines (``logavgexp`` of equal returns is that
    return).

    Papers: Trinity-RFT technical report, Pan et al. 2025, arXiv:2505.17826
    (Appendix A, OPMD), following its ``opmd`` advantage (``opmd_baseline``
    mean | logavgexp, ``tau``); Kimi k1.5, arXiv:2501.12599 (Sec. 2.3.2:
    the mean reward approximates ``tau log Z``).

    Shape: (B, T), (B, T), (B,)[, (B,)] -> (B, T), (B, T).
    """
    out, returns = _outcome_inputs("opmd", token_rewards, response_mask, sequence_rewards, group_ids=group_ids)
    if baseline not in ("mean", "logavgexp"):
        raise ValueError(f"advantage_fn 'opmd': baseline must be 'mean' or 'logavgexp', got {baseline!r}")
    if tau is None or not (math.isfinite(float(tau)) and tau > 0):
        raise ValueError(f"advantage_fn 'opmd': tau must be a number > 0 (Trinity-RFT uses 1.0), got {tau!r}")
    groups = Groups.of(group_ids)
    r = returns.to(torch.float64)
    if baseline == "mean":
        advantage = groups.centred(r)
    else:
        # tau * log mean exp(R / tau), shifted by the group max so exp never overflows
        top = groups.expand(groups.max(r))
        mean_exp = groups.sum(torch.exp((r - top) / tau)) / groups.sizes()
        advantage = r - (top + tau * groups.expand(torch.log(mean_exp)))
    # groups of one and all-equal groups carry no comparison (see the module doc)
    advantage = advantage.masked_fill(groups.expand(groups.all_equal(r)), 0.0)  # True for a group of one
    return _sequence_level(advantage, returns, response_mask, out)


@register_advantage_fn("rloo")
def rloo(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    sequence_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out: each response's baseline is the mean of the others.

    For a group of ``n > 1`` responses::

        A_i = R_i - (sum_{j != i} R_j) / (n - 1) = n / (n - 1) * (R_i - mean_g(R))

    on every policy token of ``i``. A group of one has no other member and gets
    ``A = 0``, as do all-equal groups.

    Papers: Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for
    Free!" (ICLR DeepRLStructPred workshop); Ahmadian et al. 2024, "Back to
    Basics: Revisiting REINFORCE Style Optimization for Learning from Human
    Feedback in LLMs", arXiv:2402.14740.

    ``sequence_rewards`` (optional, ``[B]``): ``R``, precomputed as
    ``token_rewards.float().sum(-1)``; saves the row sum (see the module doc).

    Shape: (B, T), (B, T), (B,)[, (B,)] -> (B, T), (B, T).
    """
    out, returns = _outcome_inputs("rloo", token_rewards, response_mask, sequence_rewards, group_ids=group_ids)
    groups = Groups.of(group_ids)
    sizes = groups.expand(groups.sizes())
    # Groups of one already have centred == 0; the clamp only avoids 0 / 0.
    advantage = groups.centred(returns.to(torch.float64)) * sizes / (sizes - 1).clamp(min=1)
    return _sequence_level(advantage, returns, response_mask, out)


@register_advantage_fn("reinforce_plus_plus")
def reinforce_plus_plus(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    whiten: bool = True,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: per-token discounted return, whitened over the whole batch.

    ::

        G_t = r'_t + gamma * G_{t'}          (t' the next policy token, see the module doc)
        A_t = (G_t - mean_batch(G)) / (std_batch(G) + eps)

    with the mean and population std over every policy token of the batch: the
    batch statistics are the baseline, so it works with one response per
    prompt. ``returns`` are ``G``. The per-token rewards usually carry the KL
    penalty (:func:`rltk.algorithms.kl.apply_kl_penalty`), as in the paper.

    Paper: Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning
    Large Language Models", arXiv:2501.03262.

    Shape: (B, T), (B, T) -> (B, T), (B, T).
    """
    returns = discounted_returns(token_rewards, response_mask, gamma)
    advantages = returns.clone()
    if whiten:
        advantages = _whiten_(advantages, (response_mask > 0).to(torch.float32), eps)
    return advantages, returns


@register_advantage_fn("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    sequence_rewards: torch.Tensor | None = None,
    policy_lengths: torch.Tensor | None = None,
    whiten: bool = True,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: group-mean baseline, then batch whitening.

    ::

        a_i = R_i - mean_g(R)                                (0 for groups of one / all equal)
        A_t = (a_i - mean_batch(a)) / (std_batch(a) + eps)   on every policy token t of i

    The batch statistics run over policy tokens, so long responses weigh more,
    as in the paper. Whitening maps the ``a_i = 0`` of a group of one or an
    all-equal group to ``-mean_batch(a) / std_batch(a)``, the shift every token
    gets; ``whiten=False`` keeps it exactly 0. ``returns`` are ``R_i``.

    Paper: Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning
    Large Language Models", arXiv:2501.03262 (REINFORCE++-baseline).

    ``sequence_rewards`` (optional, ``[B]``): ``R``, precomputed as
    ``token_rewards.float().sum(-1)``; saves the row sum (see the module doc).
    ``policy_lengths`` (optional, ``[B]``): ``l``, precomputed as
    ``response_mask.sum(-1)``; saves that pass when whitening (see the module doc).

    Shape: (B, T), (B, T), (B,)[, (B,), (B,)] -> (B, T), (B, T).
    """
    out, returns = _outcome_inputs("reinforce_plus_plus_baseline", token_rewards, response_mask, sequence_rewards,
                                   policy_lengths=policy_lengths, group_ids=group_ids)
    centred = Groups.of(group_ids).centred(returns.to(torch.float64))
    if whiten:
        # a_i repeated on its l_i policy tokens: the token statistics from [B] values and lengths
        centred = _whiten_sequences(centred, _policy_lengths(_policy_weights(response_mask), policy_lengths), eps)
    return _sequence_level(centred, returns, response_mask, out)


@register_advantage_fn("remax")
def remax(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    baseline_scores: torch.Tensor,
    sequence_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: the reward of the greedy response to the same prompt is the baseline.

    ::

        A_i = R(x, y_i) - R(x, y_greedy)

    on every policy token of ``i``. ``baseline_scores`` holds the greedy
    response's reward (``rltk.batch.Experience.baseline_score``); ``R`` is the
    row sum of ``token_rewards``. No group is needed: every response has its
    own baseline.

    Paper: Li et al. 2023, "ReMax: A Simple, Effective, and Efficient
    Reinforcement Learning Method for Aligning Large Language Models",
    arXiv:2310.10505.

    ``sequence_rewards`` (optional, ``[B]``): ``R``, precomputed as
    ``token_rewards.float().sum(-1)``; saves the row sum (see the module doc).

    Shape: (B, T), (B, T), (B,)[, (B,)] -> (B, T), (B, T).
    """
    out, returns = _outcome_inputs("remax", token_rewards, response_mask, sequence_rewards,
                                   baseline_scores=baseline_scores)
    advantage = returns.to(torch.float64) - baseline_scores.detach().to(torch.float64)
    return _sequence_level(advantage, returns, response_mask, out)


@register_advantage_fn("opo")
def opo(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    sequence_rewards: torch.Tensor | None = None,
    policy_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: the length-weighted group mean as the (optimal) baseline.

    With ``l_i`` the number of policy tokens of response ``i``::

        b_g = sum_{i in g} l_i R_i / sum_{i in g} l_i
        A_i = R_i - b_g                   (no std normalisation)

    on every policy token of ``i``. Groups of one and all-equal groups get
    ``A = 0``; a group whose responses are all empty has no token to carry an
    advantage.

    Paper: Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline",
    arXiv:2505.23585.

    ``sequence_rewards`` (optional, ``[B]``): ``R``, precomputed as
    ``token_rewards.float().sum(-1)``; saves the row sum (see the module doc).
    ``policy_lengths`` (optional, ``[B]``): ``l``, precomputed as
    ``response_mask.sum(-1)``; saves that pass (see the module doc).

    Shape: (B, T), (B, T), (B,)[, (B,), (B,)] -> (B, T), (B, T).
    """
    out, returns = _outcome_inputs("opo", token_rewards, response_mask, sequence_rewards,
                                   policy_lengths=policy_lengths, group_ids=group_ids)
    R = returns.to(torch.float64)
    weights = _policy_weights(response_mask)
    lengths = _policy_lengths(weights, policy_lengths)
    groups = Groups.of(group_ids)
    baseline = groups.expand(groups.sum(lengths * R) / groups.sum(lengths).clamp(min=1))
    advantage = (R - baseline).masked_fill_(groups.expand(groups.all_equal(R)), 0.0)
    return _sequence_level(advantage, returns, weights, out)


@register_advantage_fn("grpo_passk")
def grpo_passk(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    sequence_rewards: torch.Tensor | None = None,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k advantage: only a group's strict best response is credited, A = (R_max - R_second) / (std + eps).

    For group ``g`` with returns sorted ``R_(1) >= R_(2) >= ...``::

        A_i = (R_(1) - R_(2)) / (std_g(R) + eps)   if i is the unique best of g   (norm_by_std=True)
        A_i =  R_(1) - R_(2)                       ditto                          (norm_by_std=False)
        A_i = 0                                    for every other response

    on every policy token of ``i``. This is the gradient of the group's
    maximum reward, the objective of pass@k-style inference (sample k, keep
    the best): only the best response's contribution to the maximum changes
    when its probability changes. ``std_g`` is the unbiased group std, as in
    ``grpo``. A tie at the top (two best responses within float32 rounding,
    ``EQUAL_WITHIN_ULPS``), an all-equal group and a group of one give 0
    everywhere. Deliberate difference from verl: verl raises for a group of
    one; here it is 0, like every group estimator in rltk.

    Paper: Tang et al. 2025, "Optimizing Language Models for Inference Time
    Objectives using Reinforcement Learning", arXiv:2503.19595.

    ``sequence_rewards`` (optional, ``[B]``): ``R``, precomputed as
    ``token_rewards.float().sum(-1)``; saves the row sum (see the module doc).

    Shape: (B, T), (B, T), (B,)[, (B,)] -> (B, T), (B, T).
    """
    out, returns = _outcome_inputs("grpo_passk", token_rewards, response_mask, sequence_rewards, group_ids=group_ids)
    R = returns.to(torch.float64)
    groups = Groups.of(group_ids)
    best = groups.expand(groups.max(R))
    tolerance = EQUAL_WITHIN_ULPS * torch.finfo(torch.float32).eps * best.abs()
    at_top = R >= best - tolerance
    n_at_top = groups.expand(groups.sum(at_top.to(torch.float64)))
    # The best of the rest: the largest return below the top (-inf when there is none).
    second = groups.expand(groups.max(torch.where(at_top, -torch.inf, R)))
    credited = at_top & (n_at_top == 1) & (groups.expand(groups.counts) > 1)
    advantage = torch.where(credited, best - second, 0.0)
    if norm_by_std:
        centred = R - groups.expand(groups.mean(R))
        advantage = advantage / (groups.expand(groups.std(centred) + eps))
    return _sequence_level(advantage, returns, response_mask, out)


@register_advantage_fn("gdpo")
def gdpo(
    *,
    reward_components: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    policy_lengths: torch.Tensor | None = None,
    reward_weights: list[float] | None = None,
    norm_by_std: bool = True,
    whiten: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO: normalise each reward within its group first, then sum: A = whiten(sum_k w_k grpo(r_k)).

    With ``r_ik`` the k-th named reward of response ``i`` (``reward_components``)::

        a_ik = (r_ik - mean_g(r_k)) / (std_g(r_k) + eps)       per reward k   (norm_by_std=False: no division)
        a_i  = sum_k w_k a_ik                                   w = reward_weights (default all 1)
        A_i  = (a_i - mean_batch(a)) / (std_batch(a) + 1e-8)   over every policy token   (whiten=True)

    on every policy token of ``i``. Summing rewards before normalising (GRPO)
    lets the reward with the largest spread drown the others and collapses
    distinct reward combinations onto one advantage; normalising each one
    within its group keeps every signal at unit scale. Per reward, groups of
    one and groups where that reward is all equal give ``a_ik = 0`` (as in
    ``grpo``); batch whitening then maps ``a_i = 0`` to the common shift
    ``-mean/std``, and ``whiten=False`` keeps it exactly 0. ``returns`` are
    ``sum_k w_k r_ik``.

    **Input.** ``reward_components`` ``[B, K]`` float: column ``k`` is the
    unweighted score of the k-th reward function of ``reward.reward_fn``, in
    config order (each experience's ``reward_details[name]``). The batch must
    carry it; ``reward_weights`` (length ``K``) weighs the normalised
    advantages, not the raw rewards.

    Deliberate differences from verl: a group of one gives 0 (verl's grpo
    step passes the raw score through), and the batch std is the population
    std over policy tokens (verl's ``masked_whiten`` uses Bessel's correction
    over tokens; the two differ by a factor ``sqrt(n / (n - 1))`` for ``n``
    tokens).

    Paper: "GDPO: Group reward-Decoupled Normalization Policy Optimization",
    arXiv:2601.05242.

    ``policy_lengths`` (optional, ``[B]``): ``l``, precomputed as
    ``response_mask.sum(-1)``; saves that pass when whitening (see the module doc).

    Shape: (B, K), (B, T), (B,)[, (B,)] -> (B, T), (B, T).
    """
    if reward_components.dim() != 2 or reward_components.shape[1] == 0:
        raise ValueError(
            f"gdpo: reward_components must be a [B, K] tensor with K >= 1 named rewards per response "
            f"(column k = the k-th reward of reward.reward_fn), got shape {tuple(reward_components.shape)}"
        )
    B, K = reward_components.shape
    _check_inputs("gdpo", response_mask=response_mask, group_ids=group_ids, policy_lengths=policy_lengths)
    if response_mask.shape[0] != B:
        raise ValueError(
            f"gdpo: reward_components has {B} rows but response_mask {tuple(response_mask.shape)} has "
            f"{response_mask.shape[0]}; both need one row per response"
        )
    if reward_weights is None:
        weights = torch.ones(K, dtype=torch.float64, device=reward_components.device)
    else:
        weights = torch.as_tensor(list(reward_weights), dtype=torch.float64, device=reward_components.device)
        if weights.dim() != 1 or weights.numel() != K or not torch.isfinite(weights).all():
            raise ValueError(
                f"gdpo: reward_weights must be {K} finite numbers, one per column of reward_components, "
                f"got {list(reward_weights)!r}"
            )
    out = _output(response_mask)  # first: see _output
    rewards = reward_components.detach().to(torch.float64)  # [B, K]
    groups = Groups.of(group_ids)
    centred = groups.centred(rewards)  # [B, K]; 0 where reward k is constant in the group
    if norm_by_std:
        centred = centred / (groups.expand(groups.std(centred) + eps))
    combined = centred @ weights  # [B]
    if whiten:
        combined = _whiten_sequences(combined, _policy_lengths(_policy_weights(response_mask), policy_lengths), 1e-8)
    return _sequence_level(combined, rewards @ weights, response_mask, out)


@register_advantage_fn("gpg")
def gpg(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    sequence_rewards: torch.Tensor | None = None,
    f_norm: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG advantage: group-mean baseline rescaled by B / (B - M), A = B/(B - M) * (R - mean_g(R)) / F_norm.

    ::

        A_i = alpha * (R_i - mean_g(R)) / f_norm,      alpha = B / (B - M)

    on every policy token of ``i``, with ``B`` the responses of the batch and
    ``M`` those in groups without signal (a group of one, or all returns
    equal), whose advantage is exactly 0. Those responses still count in the
    mean a token-mean loss takes, which shrinks the gradient by ``(B - M) /
    B``; ``alpha`` undoes that, so the gradient keeps the scale of the
    informative responses (the paper's accurate gradient estimation). No std
    normalisation unless ``f_norm`` is set to a constant. ``alpha`` is a
    batch statistic: under data parallelism the estimator sees the gathered
    batch, so ``B`` and ``M`` are global. A batch with no signal at all gives
    0 everywhere.

    Deliberate difference from verl: verl counts ``B - M`` as the number of
    responses with a non-zero raw score (for 0/1 rewards, the correct ones),
    not those in groups with signal; this follows the paper.

    Paper: Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning
    Baseline for Model Reasoning", arXiv:2504.02546.

    ``sequence_rewards`` (optional, ``[B]``): ``R``, precomputed as
    ``token_rewards.float().sum(-1)``; saves the row sum (see the module doc).

    Shape: (B, T), (B, T), (B,)[, (B,)] -> (B, T), (B, T).
    """
    out, returns = _outcome_inputs("gpg", token_rewards, response_mask, sequence_rewards, group_ids=group_ids)
    if not (isinstance(f_norm, (int, float)) and f_norm > 0 and f_norm != float("inf")):
        raise ValueError(f"gpg: f_norm must be a number > 0 (the paper uses 1), got {f_norm!r}")
    R = returns.to(torch.float64)
    groups = Groups.of(group_ids)
    constant = groups.all_equal(R)  # [G]
    centred = groups.centred(R, constant)
    # responses in groups with signal: more than one member and not all equal
    informative = groups.counts[~constant & (groups.counts > 1)].sum().to(torch.float64)
    alpha = returns.numel() / informative.clamp(min=1)
    return _sequence_level(alpha * centred / f_norm, returns, response_mask, out)


@register_advantage_fn("optimal_token_baseline")
def optimal_token_baseline(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    old_logprobs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    handle_zero_tail: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline: a per-position baseline weighted by accumulated gradient energy, A_t = G_t - B*_t.

    For response ``i`` and policy token ``t`` (the column ``t`` of the row)::

        w_it  = 1 - 2 pi_it + sum_v pi_it(v)^2       = ||e_token - pi_it||^2, the squared logit-gradient
        W_it  = sum_{j <= t} w_ij                    over policy tokens: energy realised up to t
        G_it  = sum_{j >= t} r'_ij                   reward-to-go (undiscounted, see the module doc)
        B*_gt = sum_{i in g} G_it W_it / sum_{i in g} W_it      over the members with a policy token at t
        A_it  = G_it - B*_gt,    returns = G

    ``pi_it = exp(old_logprobs)`` is the sampled token's probability and
    ``sum_pi_squared`` its distribution's ``sum_v pi(v)^2`` under the same
    policy. ``B*`` is the baseline that minimises the variance of the
    policy-gradient estimate when the squared gradient norm of a prefix is
    approximated by ``W`` (the logit-gradient proxy): responses that have
    accumulated more uncertainty count more. Where every member's ``W`` is 0
    (deterministic prefixes) the plain mean of ``G`` is used; where the
    present members' ``G`` are all equal, ``B* = G`` exactly (advantage 0).

    ``handle_zero_tail``: at a position where only one member of the group
    still has a policy token (the tail of the longest response), ``B*``
    would be that response's own ``G`` and cancel its signal; there the
    baseline is 0 instead, as in verl. A group of one gives ``A = 0``
    everywhere (its only baseline is itself), like every group estimator in
    rltk; verl instead passes its raw return through. A group whose returns
    ``R_i = G_i0`` are all equal gets no zero tail (verl gives one): with
    outcome rewards its advantages are then exactly 0, where verl would
    credit the longest response's tail with its raw return, a reward for
    length alone.

    **Inputs.** ``old_logprobs`` ``[B, T]`` (the behaviour policy's token
    log-probs) and ``sum_pi_squared`` ``[B, T]``, ``sum_v pi(v)^2`` per token
    under that policy, which the log-prob pass must compute from the logits:
    ``exp(logsumexp(2 z / temp) - 2 logsumexp(z / temp))``. Deliberate
    difference from verl: a reward placed on a masked token is credited to
    the policy token before it (verl drops it).

    Paper: "Optimal Token Baseline" (OTB), arXiv:2602.07078 (the paper verl's
    ``optimal_token_baseline`` cites).

    Shape: (B, T) x4, (B,) -> (B, T), (B, T).
    """
    _check_inputs("optimal_token_baseline", token_rewards=token_rewards, response_mask=response_mask,
                  old_logprobs=old_logprobs, sum_pi_squared=sum_pi_squared, group_ids=group_ids)
    B, T = response_mask.shape
    policy = response_mask > 0
    on = policy.to(torch.float64)
    returns = discounted_returns(token_rewards, response_mask, 1.0).to(torch.float64)  # [B, T], 0 off the mask
    pi = torch.exp(old_logprobs.detach().to(torch.float64))
    energy = torch.where(policy, (1.0 - 2.0 * pi + sum_pi_squared.detach().to(torch.float64)).clamp(min=0.0), 0.0)
    realised = energy.cumsum(-1) * on  # [B, T]: W, 0 off the mask

    inverse, counts = group_index(group_ids)
    n_groups = counts.numel()
    cell = (inverse[:, None] * T + torch.arange(T, device=inverse.device)).reshape(-1)  # (group, column)

    def per_cell(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n_groups * T, dtype=torch.float64, device=x.device).index_add_(0, cell, x.reshape(-1))[cell]

    present = per_cell(on)  # members with a policy token at (group, t)
    weight_sum = per_cell(realised)
    weighted = per_cell(returns * realised)
    plain = per_cell(returns) / present.clamp(min=1)
    baseline = torch.where(weight_sum > 0, weighted / weight_sum.clamp(min=torch.finfo(torch.float64).tiny), plain)
    # Equal returns at a position give exactly that return as the baseline, not a rounded weighted mean.
    lowest = torch.full((n_groups * T,), torch.inf, dtype=torch.float64, device=on.device).scatter_reduce_(
        0, cell, torch.where(policy, returns, torch.inf).reshape(-1), reduce="amin")[cell]
    highest = torch.full((n_groups * T,), -torch.inf, dtype=torch.float64, device=on.device).scatter_reduce_(
        0, cell, torch.where(policy, returns, -torch.inf).reshape(-1), reduce="amax")[cell]
    values = returns.reshape(-1)
    tolerance = EQUAL_WITHIN_ULPS * torch.finfo(torch.float32).eps * torch.maximum(lowest.abs(), highest.abs())
    baseline = torch.where(highest - lowest <= tolerance, values, baseline)
    alone = counts[inverse] == 1
    if handle_zero_tail:
        # Not in a group whose returns are all equal: its only signal would be the tail's raw return,
        # a reward for being longest.
        groups = Groups(inverse, counts)
        equal = groups.expand(groups.all_equal(_sequence_returns(token_rewards).to(torch.float64)))
        tail = (present == 1) & (~alone & ~equal)[:, None].expand(B, T).reshape(-1)
        baseline = torch.where(tail, 0.0, baseline)
    advantages = torch.where(alone[:, None], 0.0, (values - baseline).reshape(B, T)) * on
    return advantages.to(torch.float32), returns.to(torch.float32)


@register_advantage_fn("on_policy_distill")
def on_policy_distill(
    *,
    old_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    token_rewards: torch.Tensor,
    group_ids: torch.Tensor,
    sequence_rewards: torch.Tensor | None = None,
    task_coef: float = 0.0,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation: each sampled token's advantage is minus the student's reverse-KL term against a teacher.

    For response ``i`` sampled from the student ``pi_old`` and policy token ``t``::

        A_it = -(log pi_old(y_it | x, y_i<t) - log pi_teacher(y_it | x, y_i<t))
               + task_coef * A^grpo_i                   (A^grpo: :func:`grpo` of the task reward)
        returns = A (the per-token return: the advantage is not discounted over later tokens)

    ``log pi_old - log pi_teacher`` at the sampled token is the one-sample
    estimate of the per-token reverse KL ``KL(pi_student || pi_teacher)``;
    the policy gradient with this advantage, ``E[A_t grad log pi(y_t)]``,
    is the gradient of the reverse KL of the student's own samples with each
    token's term taken alone (discount 0), which is the dense teacher signal
    of on-policy distillation. It is GKD with the student-data fraction
    ``lambda = 1`` and the reverse-KL divergence, estimated from the sampled
    token instead of summed over the vocabulary. Where the teacher rates a
    sampled token higher than the student does, ``A > 0``: the student moves
    toward the teacher. ``task_coef > 0`` adds the group-relative advantage
    of the task reward (0, the default, is pure distillation; ``token_rewards``
    and ``group_ids`` are read only then).

    Papers: Agarwal et al. 2024, "On-Policy Distillation of Language Models:
    Learning from Self-Generated Mistakes" (GKD), arXiv:2306.13649; Lu and
    Thinking Machines Lab 2025, "On-Policy Distillation" (Connectionism),
    the per-token ``-reverse KL`` advantage with discount 0 that tinker-cookbook
    and the peers' OPD recipes use.

    Shape: (B, T) x4, (B,)[, (B,)] -> (B, T), (B, T).
    """
    _check_inputs("on_policy_distill", old_logprobs=old_logprobs, teacher_logprobs=teacher_logprobs,
                  response_mask=response_mask, token_rewards=token_rewards, group_ids=group_ids,
                  sequence_rewards=sequence_rewards)
    if task_coef is None or not math.isfinite(float(task_coef)) or task_coef < 0:
        raise ValueError(f"advantage_fn 'on_policy_distill': task_coef must be a number >= 0, got {task_coef!r}")
    on = _policy_weights(response_mask)
    # float64 difference: two log-probs near -20 differ in their last float32 bits
    advantages = (teacher_logprobs.detach().to(torch.float64) - old_logprobs.detach().to(torch.float64))
    advantages = (advantages * on).to(torch.float32)
    if task_coef > 0:
        task, _ = grpo(token_rewards=token_rewards, response_mask=response_mask, group_ids=group_ids,
                       sequence_rewards=sequence_rewards, norm_by_std=norm_by_std, eps=eps)
        advantages.add_(task, alpha=float(task_coef))
    return advantages, advantages.clone()


@rltk.hookimpl
def rltk_advantage_fns():
    """Register the builtin advantage estimators (each marked ``@register_advantage_fn`` where it is defined)."""
    return ADVANTAGE_FNS
