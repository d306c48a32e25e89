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
    token_rewards   [B, T]      the scalar reward on the last response token; with
                                ``turn_rewards`` (multi turn) each turn's reward on its
                                position and the rest of the score on the last token,
                                so a row always sums to its score
    scores          [B]         the scalar reward
    sequence_rewards[B]         float32 ``token_rewards.sum(-1)``, each row's return ``R_i`` (equal to
                                ``scores`` up to float rounding; see :func:`refresh_row_sums`)
    policy_lengths  [B]         int64 ``response_mask.sum(-1)``, the tokens the policy produced
    group_ids       [B]         int64; responses of one prompt share an id
    response_lengths[B]         number of response positions (incl. env tokens)
    baseline_scores [B]         the greedy response's score (only when an experience has one: ReMax)
    reward_components[B, K]     float32; column k is reward function k's own, unweighted score
                                (``reward_details[reward_names[k]]``); only when ``reward_names``
                                is given (the recipes give the composer's names for gdpo)
    routed_experts  [B, P + T, L, k]  int64; an MoE policy's experts per token and sparse layer as the
                                rollout engine routed it, laid out like ``input_ids`` (-1 on padding, on
                                the last response token, which the engine never ran, and on rows
                                without a record); only when an experience carries it. Replayed by
                                ``algorithm.routing_replay=rollout`` (:mod:`rltk.models.moe`)
    pixel_values    [B, N, D]   float32; a VLM prompt's image patches (its processor's), zero rows after
                                them; only when an experience carries images (``Experience.vision``)
    image_grid_thw  [B, I, 3]   int64; each image's patch grid, zero grids after them (a zero grid is no
                                image); see :mod:`rltk.models.vision.inputs`

Later stages add ``old_logprobs``, ``ref_logprobs``, ``values``,
``advantages`` and ``returns`` (all ``[B, T]``) to the same dict, and
``sum_pi_squared`` ``[B, T]`` (``sum_v pi_old(v)^2`` of each token's
distribution) where the estimator names it (optimal_token_baseline).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary


@dataclass
class PromptImages:
    """One prompt's images as every consumer needs them (the per-prompt object of a VLM's rollout).

    A workflow makes one per prompt with images (:func:`rltk.models.vision.inputs.encode_prompt`, which also
    gives the prompt's ids, the image placeholders expanded), hands the list to the engine's
    ``generate(prompt_ids, params, vision_inputs=[PromptImages | None per prompt])``, and each sample's
    :class:`Experience` keeps its prompt's (the ``n`` samples share one object).

    Attributes:
        images: the decoded RGB ``PIL.Image`` s in placeholder order (for engines that take raw images,
            vLLM's ``multi_modal_data``); empty for one read back from a checkpoint, which keeps the rest.
        pixel_values: the processor's patches of all of them. Shape: (patches, D), float32.
        image_grid_thw: each image's ``(frames, height, width)`` patch grid. Shape: (images, 3), int64.
    """

    images: list = field(repr=False)
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """``{"pixel_values", "image_grid_thw"}`` for a model's forward or ``generate``."""
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}

    def state(self) -> dict[str, list]:
        """JSON-able: the processor outputs as nested lists (float32 values survive JSON exactly)."""
        return {"pixel_values": self.pixel_values.tolist(), "image_grid_thw": self.image_grid_thw.tolist()}

    @classmethod
    def from_state(cls, state: dict) -> "PromptImages":
        """The inverse of :meth:`state` (no decoded images: they served the engine, which has run)."""
        return cls([], torch.tensor(state["pixel_values"], dtype=torch.float32),
                   torch.tensor(state["image_grid_thw"], dtype=torch.long).reshape(-1, 3))


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
    # every reward function's own score under its name (plus "<name>/<key>" extras of dict rewards)
    reward_details: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # prompt text, ground truth, response text ...
    baseline_score: float | None = None  # e.g. ReMax's greedy-response score
    # Multi turn: (response position, reward) of each environment turn reward, on the last token of the
    # assistant turn it rewards. Part of `score` (score = their sum + the rest); see collate().
    turn_rewards: list[tuple[int, float]] | None = None
    # An MoE policy's routing while it sampled: [len(prompt_ids) + len(response_ids)][L][k] expert indices
    # (rltk.models.moe); -1 where not recorded. Only from engines that record it (hf).
    routed_experts: list | None = None
    # A VLM prompt's images and processor outputs (shared by the samples of one prompt); a dict (a
    # checkpointed buffer's PromptImages.state()) is read back into one
    vision: PromptImages | None = None

    def __post_init__(self):
        if isinstance(self.vision, dict):
            self.vision = PromptImages.from_state(self.vision)
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
        if self.routed_experts is not None and \
                len(self.routed_experts) != len(self.prompt_ids) + len(self.response_ids):
            raise ValueError(
                f"routed_experts has {len(self.routed_experts)} entries for {len(self.prompt_ids)} prompt + "
                f"{len(self.response_ids)} response tokens"
            )
        if self.turn_rewards is not None:
            # JSON (a checkpointed buffer) brings pairs back as lists: normalise to tuples
            pairs = []
            for pair in self.turn_rewards:
                position, reward = pair
                if isinstance(position, bool) or not isinstance(position, int) \
                        or not 0 <= position < len(self.response_ids):
                    raise ValueError(f"turn_rewards position {position!r} is outside the response's "
                                     f"{len(self.response_ids)} tokens")
                pairs.append((position, float(reward)))
            self.turn_rewards = pairs


def collate(experiences: list[Experience], pad_token_id: int, *,
            reward_names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """Pad a list of experiences into the batch tensors described in this module.

    Prompts are left-padded and responses right-padded so that every response
    starts at column ``P`` and ``logits[:, P - 1 : P - 1 + T]`` predict it.

    ``reward_names`` (the reward composer's ``names``: ``reward.reward_fn`` in
    config order) adds ``reward_components`` ``[B, K]``, column ``k`` from each
    experience's ``reward_details[reward_names[k]]``. Only those keys are read:
    a reward returning a dict also leaves ``"<name>/<key>"`` entries there,
    which are not components. An experience without one of the names (e.g.
    expert data given a fixed ``buffer.expert.score``) is a ValueError.

    ``turn_rewards`` (multi-turn episodes) are part of ``score``: each lands
    on its position of ``token_rewards`` (two on one position add up) and the
    last token holds ``score - sum(turn rewards)``, the rest of the score
    (the reward function's part). A row of ``token_rewards`` therefore always
    sums to ``scores``: outcome estimators reading ``scores`` and per-token
    ones (GAE, REINFORCE++) reading ``token_rewards`` see the same return.

    ``sequence_rewards`` and ``policy_lengths`` are the row sums of
    ``token_rewards`` and ``response_mask``, read off the experiences (no
    ``[B, T]`` pass) so that the outcome advantage estimators, which need only
    those ``[B]`` values, skip a ``[B, T]`` pass each
    (:mod:`rltk.algorithms.advantages`). They are sums
    of the tensors, not of ``score``: with turn rewards the float32 row sum
    may differ from ``score`` in the last bits, and the estimators must see
    exactly what they would sum themselves. A later change to the tensors
    (a KL penalty folded into the rewards) makes the trainer retake them
    (:func:`refresh_row_sums`).
    """
    if not experiences:
        raise ValueError("collate() needs at least one experience")
    B = len(experiences)
    P = max(len(e.prompt_ids) for e in experiences)
    T = max(max(len(e.response_ids) for e in experiences), 1)
    # Every field is filled with one boolean-mask write of all rows' tokens, flattened: a tensor and
    # two slice writes per row cost more than the data itself at RL batch shapes.
    prompt_lengths = torch.tensor([len(e.prompt_ids) for e in experiences], dtype=torch.long)
    response_lengths = torch.tensor([len(e.response_ids) for e in experiences], dtype=torch.long)
    in_prompt = torch.arange(P) >= (P - prompt_lengths)[:, None]  # [B, P], left-padded
    in_response = torch.arange(T) < response_lengths[:, None]  # [B, T], right-padded
    input_ids = torch.full((B, P + T), pad_token_id, dtype=torch.long)
    input_ids[:, :P][in_prompt] = torch.tensor(_flat(e.prompt_ids for e in experiences), dtype=torch.long)
    input_ids[:, P:][in_response] = torch.tensor(_flat(e.response_ids for e in experiences), dtype=torch.long)
    attention_mask = torch.cat([in_prompt, in_response], dim=1).to(torch.long)
    response_mask = torch.zeros((B, T), dtype=torch.float32)
    response_mask[in_response] = torch.tensor(_flat(e.response_mask for e in experiences), dtype=torch.float32)
    rollout_logprobs = torch.zeros((B, T), dtype=torch.float32)
    has_logprobs = torch.tensor([e.rollout_logprobs is not None for e in experiences], dtype=torch.bool)
    rollout_logprobs[in_response & has_logprobs[:, None]] = torch.tensor(
        _flat(e.rollout_logprobs for e in experiences if e.rollout_logprobs is not None), dtype=torch.float32)
    scores = torch.tensor([e.score for e in experiences], dtype=torch.float32)
    token_rewards = torch.zeros((B, T), dtype=torch.float32)
    answered = (response_lengths > 0).nonzero().squeeze(1)
    token_rewards[answered, response_lengths[answered] - 1] = scores[answered]
    for i, e in enumerate(experiences):
        if e.turn_rewards and e.response_ids:  # each turn's reward on its token, the rest of the score on the last
            last = len(e.response_ids) - 1
            for position, reward in e.turn_rewards:
                token_rewards[i, position] += reward
            token_rewards[i, last] -= sum(reward for _, reward in e.turn_rewards)
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "rollout_logprobs": rollout_logprobs,
        "has_rollout_logprobs": has_logprobs,
        "token_rewards": token_rewards,
        "scores": scores,
        "group_ids": torch.tensor([e.group_id for e in experiences], dtype=torch.long),
        "response_lengths": response_lengths,
    }
    _record_row_sums(batch, experiences)
    if reward_names is not None:
        batch["reward_components"] = reward_components(experiences, reward_names)
    if any(e.routed_experts is not None for e in experiences):
        batch["routed_experts"] = collate_routing(experiences, in_prompt, in_response)
    if any(e.vision is not None for e in experiences):
        batch.update(collate_vision([e.vision for e in experiences]))
    if any(e.baseline_score is not None for e in experiences):
        batch["baseline_scores"] = torch.tensor(
            [e.baseline_score if e.baseline_score is not None else 0.0 for e in experiences],
            dtype=torch.float32,
        )
    return batch


def collate_routing(experiences: list[Experience], in_prompt: torch.Tensor,
                    in_response: torch.Tensor) -> torch.Tensor:
    """``routed_experts`` ``[B, P + T, L, k]`` int64 from the experiences' records, laid out like
    ``input_ids`` (``in_prompt`` ``[B, P]`` / ``in_response`` ``[B, T]``: where their real tokens sit);
    -1 on padding and on rows without a record."""
    recorded = [e.routed_experts for e in experiences if e.routed_experts is not None]
    sample = torch.tensor(next(r for r in recorded if r), dtype=torch.long) if any(recorded) else None
    layers, k = (sample.shape[1], sample.shape[2]) if sample is not None else (1, 1)
    has = torch.tensor([e.routed_experts is not None for e in experiences], dtype=torch.bool)[:, None]
    real = torch.cat([in_prompt, in_response], dim=1) & has  # [B, P + T]
    routed = torch.full((*real.shape, layers, k), -1, dtype=torch.long)
    if recorded and real.any():
        routed[real] = torch.tensor(_flat(recorded), dtype=torch.long).reshape(-1, layers, k)
    return routed


def collate_vision(rows: Sequence[PromptImages | None]) -> dict[str, torch.Tensor]:
    """``pixel_values`` ``[B, N, D]`` and ``image_grid_thw`` ``[B, I, 3]`` of rows with these images (None: none):
    each row's own patches and grids, zeros after them, so every slice of rows keeps its samples' images."""
    given = [r for r in rows if r is not None and r.image_grid_thw.numel()]
    patches = max((r.pixel_values.shape[0] for r in given), default=0)
    width = given[0].pixel_values.shape[1] if given else 0
    images = max((r.image_grid_thw.shape[0] for r in given), default=0)
    pixel_values = torch.zeros(len(rows), patches, width, dtype=torch.float32)
    grids = torch.zeros(len(rows), images, 3, dtype=torch.long)
    for index, r in enumerate(rows):
        if r is not None and r.image_grid_thw.numel():
            pixel_values[index, : r.pixel_values.shape[0]] = r.pixel_values
            grids[index, : r.image_grid_thw.shape[0]] = r.image_grid_thw
    return {"pixel_values": pixel_values, "image_grid_thw": grids}


def _flat(rows) -> list:
    return [value for row in rows for value in row]


# Row-sum fields and the [B, T] field each sums. The outcome advantage estimators take them to
# skip a [B, T] pass each (rltk.algorithms.advantages); they must be exactly these sums.
ROW_SUMS = {"sequence_rewards": "token_rewards", "policy_lengths": "response_mask"}

# Row-sum tensor -> (weak reference to the tensor it summed, that tensor's version counter then).
# Keyed by identity, so a batch copied with dict(batch) keeps its record and nothing is kept alive.
_TAKEN_FROM = WeakIdKeyDictionary()


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version  # bumped by every in-place write
    except RuntimeError:  # inference-mode tensors keep no version counter: never trusted
        return None


def take_row_sums(batch: dict[str, torch.Tensor], name: str) -> None:
    """Set ``batch[name]`` (a :data:`ROW_SUMS` field) to the row sums of its source field, and
    remember which tensor, at which version, they were taken from (:func:`refresh_row_sums`)."""
    source = batch[ROW_SUMS[name]]
    sums = source.sum(-1)
    if name == "policy_lengths":
        sums = sums.to(torch.long)
    _TAKEN_FROM[sums] = (weakref.ref(source), _version(source))
    batch[name] = sums


def _record_row_sums(batch: dict[str, torch.Tensor], experiences: list[Experience]) -> None:
    """The :data:`ROW_SUMS` fields of a fresh batch, from the experiences rather than another [B, T] pass.

    A row without turn rewards holds its score on one token and zeros elsewhere, so its float32
    row sum *is* that float32 score (0 for an empty response, which holds nothing); only rows with
    turn rewards are summed as tensors (several nonzeros: the sum's rounding is the tensor's). The
    policy's token count is an integer sum of 0/1 flags, exact either way.
    """
    token_rewards = batch["token_rewards"]
    sums = torch.tensor([e.score if e.response_ids else 0.0 for e in experiences], dtype=torch.float32)
    multi = [i for i, e in enumerate(experiences) if e.turn_rewards and e.response_ids]
    if multi:
        rows = torch.tensor(multi, dtype=torch.long)
        sums[rows] = token_rewards.index_select(0, rows).sum(-1)
    lengths = torch.tensor([sum(e.response_mask) for e in experiences], dtype=torch.float32).to(torch.long)
    for name, value in (("sequence_rewards", sums), ("policy_lengths", lengths)):
        source = batch[ROW_SUMS[name]]
        _TAKEN_FROM[value] = (weakref.ref(source), _version(source))
        batch[name] = value


def refresh_row_sums(batch: dict[str, torch.Tensor], names: Sequence[str]) -> None:
    """Make sure each :data:`ROW_SUMS` field in ``names`` holds the row sums of the batch's current
    source tensor, retaking it where it is missing or stale.

    A field is trusted only if :func:`take_row_sums` took it from the very tensor now in the
    batch, with no in-place write since (its version counter unchanged). So a recipe may
    replace ``token_rewards`` (fold a KL penalty into them, add a bonus) or write into them and
    the estimators still see the right returns: the sums are retaken, one ``[B, T]`` pass,
    exactly what the estimator would otherwise do itself.
    """
    for name in names:
        source = batch.get(ROW_SUMS[name])
        if source is None:
            continue
        record = _TAKEN_FROM.get(batch[name]) if name in batch else None
        version = _version(source)
        if record is None or record[0]() is not source or version is None or record[1] != version:
            take_row_sums(batch, name)


def reward_components(experiences: list[Experience], reward_names: Sequence[str]) -> torch.Tensor:
    """``[B, K]`` float32: ``reward_details[reward_names[k]]`` of each experience (see :func:`collate`)."""
    names = list(reward_names)
    if not names:
        raise ValueError("reward_components needs at least one reward name (reward.reward_fn is empty)")
    rows = []
    for i, e in enumerate(experiences):
        missing = [n for n in names if n not in e.reward_details]
        if missing:
            where = f"experience {i}" + (f" (row '{e.info['row_id']}')" if "row_id" in e.info else "")
            expert = (" It is expert data with no per-reward scores: unset buffer.expert.score so that every "
                      "reward function scores the expert responses." if e.info.get("expert") else "")
            raise ValueError(
                f"{where} has no reward_details entry for reward(s) {missing} (it has "
                f"{sorted(e.reward_details)}); reward_components needs the score of every reward function "
                f"of reward.reward_fn {names}.{expert}"
            )
        rows.append([float(e.reward_details[n]) for n in names])
    return torch.tensor(rows, dtype=torch.float32)  # [B, K]


def response_width(batch: dict[str, torch.Tensor]) -> int:
    """``T``, the number of response columns of a collated batch."""
    return batch["response_mask"].shape[1]


def slice_batch(batch: dict[str, torch.Tensor], index: torch.Tensor | slice) -> dict[str, torch.Tensor]:
    """Rows ``index`` of every tensor in ``batch`` (micro- and mini-batches)."""
    return {k: v[index] for k, v in batch.items()}
