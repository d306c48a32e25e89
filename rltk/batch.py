"""The data contract between components: experiences and the tensors built from them.

A workflow produces :class:`Experience` objects (one per response); the buffer
stores them; :func:`collate` turns a list of them into the tensors the trainer
reads::

    input_ids       [B, P + T]  prompt left-padded to P, response right-padded to T
    attention_mask  [B, P + T]  1 on real prompt and response tokens
    response_mask   [B, T]      1 on tokens the policy produced (0 on padding and
                                on environment/tool tokens inside a response)
    rollout_logprobs[B, T]      log-probs the rollout engine sampled with (0 if absent)
    has_rollout_logprobs[B]     bool; False for experiences without them (e.g. expert data),
                                whose zeros above are no log-probs
    token_rewards   [B, T]      the scalar reward on the last response token
    scores          [B]         the scalar reward
    group_ids       [B]         int64; responses of one prompt share an id
    response_lengths[B]         number of response positions (incl. env tokens)

Later stages add ``old_logprobs``, ``ref_logprobs``, ``values``,
``advantages`` and ``returns`` (all ``[B, T]``) to the same dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Experience:
    """One response to one prompt, with what the trainer needs to learn from it."""

    prompt_ids: list[int]
    response_ids: list[int]
    score: float
    group_id: int
    response_mask: list[int] | None = None  # None means every response token is the policy's
    rollout_logprobs: list[float] | None = None
    finish_reason: str = "stop"  # "stop" (eos / stop token) or "length"
    reward_details: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # prompt text, ground truth, response text ...
    baseline_score: float | None = None  # e.g. ReMax's greedy-response score

    def __post_init__(self):
        if self.response_mask is None:
            self.response_mask = [1] * len(self.response_ids)
        if len(self.response_mask) != len(self.response_ids):
            raise ValueError(
                f"response_mask has {len(self.response_mask)} entries for "
                f"{len(self.response_ids)} response tokens"
            )
        if self.rollout_logprobs is not None and len(self.rollout_logprobs) != len(self.response_ids):
            raise ValueError(
                f"rollout_logprobs has {len(self.rollout_logprobs)} entries for "
                f"{len(self.response_ids)} response tokens"
            )


def collate(experiences: list[Experience], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Pad a list of experiences into the batch tensors described in this module.

    Prompts are left-padded and responses right-padded so that every response
    starts at column ``P`` and ``logits[:, P - 1 : P - 1 + T]`` predict it.
    """
    if not experiences:
        raise ValueError("collate() needs at least one experience")
    B = len(experiences)
    P = max(len(e.prompt_ids) for e in experiences)
    T = max(max(len(e.response_ids) for e in experiences), 1)
    input_ids = torch.full((B, P + T), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + T), dtype=torch.long)
    response_mask = torch.zeros((B, T), dtype=torch.float32)
    rollout_logprobs = torch.zeros((B, T), dtype=torch.float32)
    token_rewards = torch.zeros((B, T), dtype=torch.float32)
    for i, e in enumerate(experiences):
        p, t = len(e.prompt_ids), len(e.response_ids)
        input_ids[i, P - p : P] = torch.tensor(e.prompt_ids, dtype=torch.long)
        attention_mask[i, P - p : P] = 1
        if t:
            input_ids[i, P : P + t] = torch.tensor(e.response_ids, dtype=torch.long)
            attention_mask[i, P : P + t] = 1
            response_mask[i, :t] = torch.tensor(e.response_mask, dtype=torch.float32)
            if e.rollout_logprobs is not None:
                rollout_logprobs[i, :t] = torch.tensor(e.rollout_logprobs, dtype=torch.float32)
            token_rewards[i, t - 1] = e.score
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "rollout_logprobs": rollout_logprobs,
        "has_rollout_logprobs": torch.tensor([e.rollout_logprobs is not None for e in experiences], dtype=torch.bool),
        "token_rewards": token_rewards,
        "scores": torch.tensor([e.score for e in experiences], dtype=torch.float32),
        "group_ids": torch.tensor([e.group_id for e in experiences], dtype=torch.long),
        "response_lengths": torch.tensor([len(e.response_ids) for e in experiences], dtype=torch.long),
    }
    if any(e.baseline_score is not None for e in experiences):
        batch["baseline_scores"] = torch.tensor(
            [e.baseline_score if e.baseline_score is not None else 0.0 for e in experiences],
            dtype=torch.float32,
        )
    return batch


def response_width(batch: dict[str, torch.Tensor]) -> int:
    """``T``, the number of response columns of a collated batch."""
    return batch["response_mask"].shape[1]


def slice_batch(batch: dict[str, torch.Tensor], index: torch.Tensor | slice) -> dict[str, torch.Tensor]:
    """Rows ``index`` of every tensor in ``batch`` (micro- and mini-batches)."""
    return {k: v[index] for k, v in batch.items()}
