"""Reward-model training pieces: preference pairs, the Bradley-Terry model on the policy architecture,
its pairwise forward, and the held-out pairwise accuracy (the loop is recipes/reward_model.py).

A reward model here is what :mod:`rltk.rewards.judges.reward_model` loads: an
``AutoModelForSequenceClassification`` with one output (``num_labels=1``; for
the tiny model ``Qwen2ForSequenceClassification``) that reads
``prompt + response`` tokenized without special tokens, the longest texts cut
from the left, and whose reward is the score head at the last real token. It
is trained, and evaluated, on exactly that reading.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from omegaconf import DictConfig

from rltk.errors import ConfigError

# The chosen/rejected texts of one pair, the prompt already rendered as the policy sees it.
Pair = tuple[str, str, str]  # (prompt, chosen response, rejected response)


def preference_pairs(rows: list[dict], cfg: DictConfig, *, split: str) -> list[Pair]:
    """``(prompt, chosen, rejected)`` of each row.

    A dataset (``data.path``) names its columns with ``reward_model.chosen_key`` and
    ``reward_model.rejected_key`` (text responses). A synthetic task has none: its pairs
    are the right answer (chosen) against a wrong one (rejected), the right one moved
    by a nonzero offset in ``[-reward_model.wrong_offset, +reward_model.wrong_offset]``
    (near misses, the errors a policy makes), drawn from ``seed`` and ``split``; with
    ``reward_model.wrong_length`` that fraction of rejected answers is the right one with one
    digit dropped or one added: a wrong length, an error a policy trained against the model
    makes (benchmarks/rm_then_grpo.py), and easy pairs that start the backbone learning
    before the near misses do.
    """
    r = cfg.reward_model
    if cfg.data.path:
        pairs = []
        for row in rows:
            extras = row.get("extras") or {}
            for key in ("chosen_key", "rejected_key"):
                column = r[key]
                if column not in extras:
                    raise ConfigError(f"reward_model.{key}='{column}' is not a column of row '{row.get('id')}'; "
                                      f"its columns: {sorted(extras)} (and data.prompt_key='{cfg.data.prompt_key}')")
                if not isinstance(extras[column], str):
                    raise ConfigError(f"reward_model.{key}='{column}': row '{row.get('id')}' holds a "
                                      f"{type(extras[column]).__name__}, not a text response")
            pairs.append((row["prompt"], extras[r.chosen_key], extras[r.rejected_key]))
        return pairs
    rng = random.Random(f"{cfg.seed}:{split}:pairs")
    pairs = []
    for row in rows:
        answer = str(row["ground_truth"])
        try:
            value = int(answer)
        except ValueError:
            raise ConfigError(f"data.task='{cfg.data.task}': its answers are not integers ('{answer}'), so no wrong "
                              f"answer can be made for a synthetic pair; give preference data with data.path "
                              f"and reward_model.chosen_key / rejected_key") from None
        if r.wrong_length and rng.random() < r.wrong_length:
            at = rng.randrange(len(answer))  # drop that digit, or (one-digit answers, or half the time) add one
            wrong = (answer[:at] + answer[at + 1:] if len(answer) > 1 and rng.random() < 0.5
                     else answer[:at] + str(rng.randrange(10)) + answer[at:])
            pairs.append((row["prompt"], answer, wrong))
            continue
        offsets = [o for o in range(-r.wrong_offset, r.wrong_offset + 1) if o != 0 and value + o >= 0]
        pairs.append((row["prompt"], answer, str(value + rng.choice(offsets))))
    return pairs


def build_reward_model(cfg: DictConfig, policy: torch.nn.Module) -> torch.nn.Module:
    """A ``num_labels=1`` sequence-classification model on the policy's architecture and backbone weights.

    ``policy`` is the causal LM ``model.path`` (or the tiny model) gives; its decoder
    is copied into ``AutoModelForSequenceClassification`` of the same config, whose score
    head starts at zero (every reward 0: the loss starts at log 2 whatever the backbone).
    """
    from transformers import AutoModelForSequenceClassification

    config = policy.config.__class__.from_dict(policy.config.to_dict())
    config.num_labels = 1
    config.pad_token_id = policy.config.pad_token_id
    try:
        model = AutoModelForSequenceClassification.from_config(config)
    except ValueError as exc:
        raise ConfigError(f"model.path: the {config.model_type} architecture has no sequence-classification "
                          f"model in transformers, so no reward model can be built on it: {exc}") from exc
    missing = model.base_model.load_state_dict(policy.base_model.state_dict(), strict=False)
    if missing.missing_keys:
        raise ConfigError(f"model.path: the reward model's backbone lacks weights the policy has not: "
                          f"{missing.missing_keys[:5]}")
    torch.nn.init.zeros_(model.score.weight)
    return model.to(next(policy.parameters()).dtype).train()


def tokenize_pairs(pairs: list[Pair], tokenizer, max_length: int) -> list[tuple[list[int], list[int]]]:
    """Token ids of ``prompt + chosen`` and ``prompt + rejected`` per pair, as the reward function reads them
    (no special tokens, cut to ``max_length`` from the left)."""
    out = []
    for prompt, chosen, rejected in pairs:
        ids = tokenizer([prompt + chosen, prompt + rejected], add_special_tokens=False)["input_ids"]
        out.append((list(ids[0][-max_length:]) or [tokenizer.pad_token_id],
                    list(ids[1][-max_length:]) or [tokenizer.pad_token_id]))
    return out


def pair_rewards(model: torch.nn.Module, pairs: list[tuple[list[int], list[int]]], pad_token_id: int,
                 device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards ``(chosen [B], rejected [B])``: the score head at each text's last real token.

    Chosen and rejected texts run in one right-padded forward of ``2B`` rows; pooling
    at the known last position (not by looking for pad ids, which a text may contain).
    """
    texts = [p[0] for p in pairs] + [p[1] for p in pairs]
    lengths = torch.tensor([len(x) for x in texts])
    input_ids = torch.full((len(texts), int(lengths.max())), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, x in enumerate(texts):
        input_ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    hidden = model.base_model(input_ids=input_ids, attention_mask=mask).last_hidden_state  # [2B, L, H]
    pooled = hidden[torch.arange(len(texts), device=device), (lengths - 1).to(device)]  # [2B, H]
    rewards = model.score(pooled)[:, 0].float()  # [2B]
    return rewards[: len(pairs)], rewards[len(pairs):]


@torch.no_grad()
def pairwise_accuracy(model: torch.nn.Module, pairs: list[tuple[list[int], list[int]]], pad_token_id: int, device,
                      micro_batch_size: int) -> dict[str, float]:
    """Held-out ``eval/pairwise_accuracy`` (fraction of pairs with r_chosen > r_rejected, a tie counting half:
    the zero-initialised head starts at 0.5) and ``eval/margin`` (mean r_chosen - r_rejected)."""
    from rltk.algorithms.reward_model_losses import pairwise_wins

    was_training = model.training
    model.eval()
    wins = margin = 0.0
    for start in range(0, len(pairs), micro_batch_size):
        chosen, rejected = pair_rewards(model, pairs[start:start + micro_batch_size], pad_token_id, device)
        wins += pairwise_wins(chosen - rejected).sum().item()
        margin += (chosen - rejected).sum().item()
    model.train(was_training)
    n = max(len(pairs), 1)
    return {"eval/pairwise_accuracy": wins / n, "eval/margin": margin / n}


def save_reward_model(model: torch.nn.Module, tokenizer, folder: Path) -> Path:
    """The Hugging Face folder the ``reward_model`` reward function loads: config, weights and tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
