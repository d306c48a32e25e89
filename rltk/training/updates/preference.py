"""The mechanics of preference optimisation (the ``dpo`` recipe): pairs as batches, their sequence
log-probs, and one optimizer step of a registered ``preference_loss``.

A step's batch holds each pair as two adjacent rows, chosen then rejected
(:func:`pair_batch`). The forward runs as the RL passes do
(:class:`rltk.training.step.forward.ForwardSettings`, so every strategy, LoRA,
packing and kernel choice applies), with two changes (:func:`pair_settings`):
micro-batches are cut by an even row count, so a pair never straddles two
forwards (the loss is not a sum over rows: it needs both halves of a pair),
and the temperature is 1 (DPO's log-probs are the policy's own, not those of
a sampling temperature).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch
from omegaconf import DictConfig

from rltk.batch import Experience, collate
from rltk.errors import ConfigError
from rltk.training.rollouts.collect import scores_differ
from rltk.training.step.forward import ForwardSettings
from rltk.training.step.micro_batches import MicroBatch
from rltk.training.scaffold.setup import args_of
from rltk.training.updates.update_loop import MicroLoss, optimizer_step


class PairExample(NamedTuple):
    """One preference pair, tokenized: the prompt and both responses with their loss masks."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    chosen_mask: list[int]
    rejected_ids: list[int]
    rejected_mask: list[int]


def _response(row: dict, value, tokenizer, tools, key: str, config_key: str) -> tuple[list[int], list[int], list[int]]:
    """``(prompt ids, response ids, loss mask)`` of one response column's value: text, or chat messages."""
    if isinstance(value, str):
        prompt_ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        ids = tokenizer(value, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return prompt_ids, ids, [1] * len(ids)
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        from rltk.data.chat import tokenize_transcript

        opening = row.get("messages")
        if not opening:
            raise ConfigError(f"row '{row.get('id')}': {config_key}='{key}' holds chat messages, but the row's "
                              f"prompt is text; chat responses need a chat prompt (a prompt column of messages, "
                              f"or data.messages_key)")
        # a response may repeat the conversation before it (TRL's implicit-prompt form) or hold only the reply
        transcript = value if value[: len(opening)] == list(opening) else [*opening, *value]
        try:
            return tokenize_transcript([dict(m) for m in transcript], tokenizer, tools=tools)
        except ValueError as exc:
            raise ConfigError(f"row '{row.get('id')}': {config_key}='{key}' cannot be tokenized: {exc}") from exc
    raise ConfigError(f"row '{row.get('id')}': {config_key}='{key}' holds a {type(value).__name__}; a response is a "
                      f"string or a list of chat messages [{{'role', 'content'}}]")


def preference_examples(rows: list[dict], tokenizer, *, chosen_key: str, rejected_key: str,
                        tools: list[dict] | None = None) -> list[PairExample]:
    """The tokenized pairs of ``rows``, the responses read from ``extras[chosen_key]`` / ``extras[rejected_key]``.

    A text response is tokenized after the row's (formatted) prompt, with eos,
    the loss on all of it; chat messages are appended to the row's opening
    messages and tokenized as a transcript (loss on assistant turns only, see
    :func:`rltk.data.chat.tokenize_transcript`). A missing column is a
    :class:`ConfigError` naming ``dpo.chosen_key`` / ``dpo.rejected_key``.
    """
    examples = []
    for row in rows:
        extras = row.get("extras") or {}
        for key, config_key in ((chosen_key, "dpo.chosen_key"), (rejected_key, "dpo.rejected_key")):
            if key not in extras:
                raise ConfigError(
                    f"{config_key}='{key}' is not a column of row '{row.get('id')}'; its columns: {sorted(extras)}. "
                    f"Set {config_key} to the column holding the "
                    f"{'preferred' if config_key.endswith('chosen_key') else 'dispreferred'} response "
                    f"(and keep it in data.extras_keys if that is set)")
        p_c, chosen, chosen_mask = _response(row, extras[chosen_key], tokenizer, tools, chosen_key, "dpo.chosen_key")
        p_r, rejected, rejected_mask = _response(row, extras[rejected_key], tokenizer, tools, rejected_key,
                                                 "dpo.rejected_key")
        if p_c != p_r:
            raise ConfigError(f"row '{row.get('id')}': the chosen and the rejected response do not continue the same "
                              f"prompt (their chat messages differ before the first assistant turn)")
        examples.append(PairExample(p_c, chosen, chosen_mask, rejected, rejected_mask))
    return examples


def pair_batch(pairs: list[PairExample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """A collated batch of ``2 P`` rows: pair ``i``'s chosen response at row ``2 i``, its rejected one at ``2 i + 1``.

    Both rows of a pair share ``group_id = i`` (and so one prompt pass where prompts are shared).
    """
    experiences = []
    for i, p in enumerate(pairs):
        experiences.append(Experience(prompt_ids=p.prompt_ids, response_ids=p.chosen_ids, score=1.0, group_id=i,
                                      response_mask=list(p.chosen_mask)))
        experiences.append(Experience(prompt_ids=p.prompt_ids, response_ids=p.rejected_ids, score=0.0, group_id=i,
                                      response_mask=list(p.rejected_mask)))
    return collate(experiences, pad_token_id)


def online_pairs(experiences: list[Experience]) -> list[PairExample]:
    """Online DPO's pairs: in each group of responses to one prompt whose scores differ, the best one chosen
    and the worst one rejected (the first of each on ties; a group of two is the n=2 case). Groups whose
    scores are all equal say nothing about which response is better and give no pair."""
    groups: dict[int, list[Experience]] = {}
    for e in experiences:
        groups.setdefault(e.group_id, []).append(e)
    pairs = []
    for group in groups.values():
        if not scores_differ(group):
            continue
        best = max(group, key=lambda e: e.score)
        worst = min(group, key=lambda e: e.score)
        pairs.append(PairExample(best.prompt_ids, best.response_ids, list(best.response_mask),
                                 worst.response_ids, list(worst.response_mask)))
    return pairs


def pair_settings(settings: ForwardSettings) -> ForwardSettings:
    """``settings`` for pair batches: an even number of rows per micro-batch (at least one pair), cut by
    rows rather than a token budget (which sorts rows by length and would split pairs), at temperature 1."""
    return dataclasses.replace(settings, micro_batch_size=max(2, settings.micro_batch_size // 2 * 2),
                               max_tokens_per_micro_batch=None, temperature=1.0)


def sequence_logps(logprobs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """A response's log-prob: the sum of its policy tokens' log-probs. Shape: (B, T), (B, T) -> (B,)."""
    return torch.where(response_mask > 0, logprobs.float(), 0.0).sum(-1)


@dataclasses.dataclass(frozen=True)
class PreferenceLoss:
    """``dpo.loss`` with its arguments (``dpo.loss_args``) and ``dpo.beta``, called on ``[P]`` log-probs."""

    fn: object
    args: dict
    beta: float

    @classmethod
    def from_config(cls, cfg: DictConfig) -> "PreferenceLoss":
        import rltk

        return cls(rltk.get_component("preference_loss", cfg.dpo.loss), args_of(cfg, "dpo.loss"), float(cfg.dpo.beta))

    def __call__(self, chosen, rejected, ref_chosen, ref_rejected) -> torch.Tensor:
        return self.fn(chosen_logps=chosen, rejected_logps=rejected, ref_chosen_logps=ref_chosen,
                       ref_rejected_logps=ref_rejected, beta=self.beta, **self.args)


@torch.no_grad()
def reference_sequence_logps(reference, batch: dict[str, torch.Tensor], settings: ForwardSettings) -> torch.Tensor:
    """The frozen reference's log-prob of every row of ``batch`` (:class:`rltk.training.step.reference.FrozenReference`).

    Shape: (B,)."""
    return sequence_logps(reference.logprobs(batch, settings), batch["response_mask"])


def preference_step(strategy, batch: dict[str, torch.Tensor], ref_logps: torch.Tensor, loss: PreferenceLoss,
                    settings: ForwardSettings, *, nll_coef: float = 0.0) -> dict[str, float]:
    """One optimizer step of ``loss`` on a :func:`pair_batch`, averaged over the pairs of every rank
    (:func:`rltk.training.updates.update_loop.optimizer_step`).

    ::

        L = (1 / P_global) sum_pairs loss(log pi(y_w), log pi(y_l), log pi_ref(y_w), log pi_ref(y_l))
            + nll_coef * (- sum_{chosen tokens} log pi(y_w,t) / N_chosen_tokens)

    The second term (``dpo.nll_coef``, TRL's ``rpo_alpha``) is the chosen
    responses' token-mean negative log-likelihood: Pang et al. 2024,
    "Iterative Reasoning Preference Optimization", arXiv:2404.19733, add it
    because DPO alone on reasoning tasks lowers the rejected answers'
    likelihood far more than it raises the chosen ones'.

    ``ref_logps`` ``[B]`` are the reference's log-probs of the batch's rows
    (:func:`reference_sequence_logps`, or precomputed). ``settings`` must keep
    pairs whole (:func:`pair_settings`). Metrics, means over the global pairs
    with TRL's names: ``rewards/chosen`` and ``rewards/rejected`` (the implicit
    rewards ``beta (log pi - log pi_ref)``), ``rewards/margins`` (their
    difference), ``rewards/accuracies`` (the fraction of pairs whose chosen
    reward is the higher), ``logps/chosen``, ``logps/rejected``; ``dpo_loss``
    (the preference term of L), ``nll_loss`` (the chosen tokens' mean NLL, logged
    whatever ``nll_coef``), ``entropy`` (mean token entropy over both responses, for the
    divergence guard), ``pairs`` (the step's pairs over every rank) and the strategy's step info.
    """
    B, T = batch["response_mask"].shape
    if B % 2:
        raise ValueError(f"preference_step: a pair batch has an even number of rows (chosen, rejected), got {B}")
    counts = strategy.all_reduce_sum(torch.tensor([B / 2, float(batch["response_mask"].sum()),
                                                   float(batch["response_mask"][0::2].sum())], dtype=torch.float64))
    global_pairs, global_tokens, chosen_tokens = (max(float(c), 1.0) for c in counts.tolist())
    micro_loss = functools.partial(_micro_preference_loss, strategy=strategy, settings=settings, width=T,
                                   ref_logps=ref_logps, loss=loss, nll_coef=nll_coef, global_pairs=global_pairs,
                                   global_tokens=global_tokens, chosen_tokens=chosen_tokens)
    sums, info = optimizer_step(strategy, settings.micro_batches(strategy, batch), micro_loss)
    return {**{k: v / global_pairs for k, v in sums.items()}, "pairs": global_pairs if B else 0.0, **info}


def _micro_preference_loss(mb: dict[str, torch.Tensor], micro: MicroBatch, *, strategy, settings: ForwardSettings,
                           width: int, ref_logps: torch.Tensor, loss: PreferenceLoss, nll_coef: float,
                           global_pairs: float, global_tokens: float, chosen_tokens: float) -> MicroLoss:
    """One micro-batch's share of :func:`preference_step`'s loss (whole pairs), and its sums of the metrics
    (divided by the global pairs once summed)."""
    logprobs, entropy = settings.logprobs(strategy.model, mb, width, with_entropy=True, strategy=strategy)
    seq = sequence_logps(logprobs, mb["response_mask"])  # [b]: chosen at even rows, rejected at odd
    ref = ref_logps[micro.rows].to(seq.device)
    losses = loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2])  # [b / 2]
    total = losses.sum() / global_pairs
    nll = -torch.where(mb["response_mask"][0::2] > 0, logprobs[0::2].float(), 0.0).sum() / chosen_tokens
    if nll_coef:
        total = total + nll_coef * nll

    @torch.no_grad()
    def read_sums() -> dict[str, float]:
        reward = loss.beta * (seq.detach() - ref)
        chosen, rejected = reward[0::2], reward[1::2]
        return {
            "dpo_loss": losses.detach().sum().item(), "nll_loss": nll.detach().item() * global_pairs,
            "rewards/chosen": chosen.sum().item(), "rewards/rejected": rejected.sum().item(),
            "rewards/margins": (chosen - rejected).sum().item(),
            "rewards/accuracies": (chosen > rejected).float().sum().item(),
            "logps/chosen": seq.detach()[0::2].sum().item(), "logps/rejected": seq.detach()[1::2].sum().item(),
            "entropy": torch.where(mb["response_mask"] > 0, entropy.detach().float(), 0.0).sum().item()
            * global_pairs / global_tokens,
        }

    return MicroLoss(total, read_sums)
