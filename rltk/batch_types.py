"""The batch contract in one place: every field a training batch may hold, with its shape, and the
calling conventions of the components that read it.

A workflow's experiences become a batch in :func:`rltk.batch.collate`; the
loop adds the fields of its passes (old and reference log-probs, values,
advantages). :class:`TrainingBatch` lists them all with their shapes; ``B`` is
the number of responses, ``P`` the prompt width (left-padded), ``T`` the
response width (right-padded), ``K`` the number of reward functions.

The Protocols give the calling convention of each algorithm component (the
plugin contract; see CONTRIBUTING.md "Components"). Every other list of batch
fields derives from :data:`BATCH_FIELDS` or is checked against it by
``tests/test_batch_contract.py``: the registry's fields an advantage estimator
may name, the stages' ``provides``, the CONTRIBUTING table and the
``rltk.batch`` / ``rltk.algorithms.advantages`` docstrings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Callable, Protocol, TypedDict, get_type_hints

if TYPE_CHECKING:
    from torch import Tensor
else:  # the registry reads this module before anything needs torch
    Tensor = Any


class TrainingBatch(TypedDict, total=False):
    """Every field of a training batch, as ``Annotated[Tensor, shape, dtype, who fills it]``."""

    # collate: from the experiences
    input_ids: Annotated[Tensor, "[B, P + T]", "int64", "collate: prompt left-padded to P, response right-padded"]
    attention_mask: Annotated[Tensor, "[B, P + T]", "int64", "collate: 1 on real prompt and response tokens"]
    response_mask: Annotated[Tensor, "[B, T]", "float32", "collate: 1 on tokens the policy produced"]
    rollout_logprobs: Annotated[Tensor, "[B, T]", "float32", "collate: the engine's log-probs (0 if absent)"]
    has_rollout_logprobs: Annotated[Tensor, "[B]", "bool", "collate: False for experiences without them"]
    token_rewards: Annotated[Tensor, "[B, T]", "float32", "collate: each row sums to its score"]
    scores: Annotated[Tensor, "[B]", "float32", "collate: the scalar reward"]
    sequence_rewards: Annotated[Tensor, "[B]", "float32", "collate: token_rewards.sum(-1), the return R_i"]
    policy_lengths: Annotated[Tensor, "[B]", "int64", "collate: response_mask.sum(-1)"]
    group_ids: Annotated[Tensor, "[B]", "int64", "collate: responses of one prompt share an id"]
    response_lengths: Annotated[Tensor, "[B]", "int64", "collate: response positions, env tokens included"]
    baseline_scores: Annotated[Tensor, "[B]", "float32", "collate: the greedy response's score (ReMax)"]
    reward_components: Annotated[Tensor, "[B, K]", "float32", "collate: each reward function's own score (gdpo)"]
    routed_experts: Annotated[Tensor, "[B, P + T, L, k]", "int64",
                              "collate: an MoE policy's experts per token and layer at rollout (-1: none)"]
    pixel_values: Annotated[Tensor, "[B, N, D]", "float32",
                            "collate: a VLM prompt's image patches, zero rows after them"]
    image_grid_thw: Annotated[Tensor, "[B, I, 3]", "int64",
                              "collate: each image's patch grid, zero grids after them"]
    # the loop's passes
    old_logprobs: Annotated[Tensor, "[B, T]", "float32", "old-log-prob pass: the behaviour policy's"]
    sum_pi_squared: Annotated[Tensor, "[B, T]", "float32", "old-log-prob pass: sum_v pi_old(v)^2"]
    ref_logprobs: Annotated[Tensor, "[B, T]", "float32", "reference pass (kl_coef > 0)"]
    teacher_logprobs: Annotated[Tensor, "[B, T]", "float32", "teacher pass (distill recipe)"]
    values: Annotated[Tensor, "[B, T]", "float32", "critic pass (ppo recipe)"]
    advantages: Annotated[Tensor, "[B, T]", "float32", "advantage pass"]
    returns: Annotated[Tensor, "[B, T]", "float32", "advantage pass"]


_HINTS = get_type_hints(TrainingBatch, include_extras=True)
#: ``{field: shape}`` of every batch field, in :class:`TrainingBatch` order.
FIELD_SHAPES: dict[str, str] = {name: hint.__metadata__[0] for name, hint in _HINTS.items()}
#: ``{field: dtype name}`` (a ``torch`` attribute: ``"float32"``, ``"int64"``, ``"bool"``).
FIELD_DTYPES: dict[str, str] = {name: hint.__metadata__[1] for name, hint in _HINTS.items()}

#: The names a component's signature may use for batch fields: every field of
#: :class:`TrainingBatch`, and ``logprobs`` (the current policy's, inside the update).
BATCH_FIELDS: frozenset[str] = frozenset(FIELD_SHAPES) | {"logprobs"}


class AdvantageFn(Protocol):
    """``fn(*, <batch fields it names>, **args) -> (advantages [B, T], returns [B, T])``."""

    def __call__(self, **fields_and_args: Any) -> tuple[Tensor, Tensor]: ...


class LossAgg(Protocol):
    """``agg(loss_mat [B, T], response_mask [B, T], *, global_tokens, global_seqs, **args) -> scalar``."""

    def __call__(self, loss_mat: Tensor, response_mask: Tensor, **kwargs: Any) -> Tensor: ...


class PolicyLoss(Protocol):
    """``fn(*, logprobs, old_logprobs, advantages, response_mask, loss_agg, **args) -> (loss, metrics)``,
    every tensor ``[B, T]``; ``loss_agg`` reduces the per-token loss matrix. A loss may also take
    ``behaviour_logprobs`` ``[B, T]`` (the sampling policy's, per token: ``decoupled_ppo``)."""

    def __call__(self, *, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor,
                 loss_agg: Callable[..., Tensor], **args: Any) -> tuple[Tensor, dict[str, Tensor]]: ...


class KLPenalty(Protocol):
    """``fn(logprobs [B, T], ref_logprobs [B, T], **args) -> [B, T]`` per-token KL estimate; it may also
    take ``old_logprobs=`` (``k3_unbiased``)."""

    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor, **args: Any) -> Tensor: ...
