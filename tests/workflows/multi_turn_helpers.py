"""Environments, engines and a tool-aware tokenizer shared by the multi-turn tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rltk.environments.base import AssistantTurn, Environment, StepResult
from rltk.models.tiny import build_char_tokenizer, build_tiny_model
from rltk.rollout.base import Completion, RolloutEngine, SamplingParams
from rltk.rollout.hf import HFRolloutEngine

# The tiny template with a `tool` role and a tools= header: tool results are shown as user turns
# prefixed "tool:", the tools as one system line. (The shipped tiny template gains its own tool role
# in the mt-data branch; these tests do not depend on it.)
TOOL_TEMPLATE = (
    "{%- if tools -%}<|system|>tools:{%- for t in tools -%}{{ ' ' + t['function']['name'] }}{%- endfor -%}<|eos|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}<|user|>tool:{{ message['content'] }}<|eos|>"
    "{%- else -%}<|{{ message['role'] }}|>{{ message['content'] }}<|eos|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def tool_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


def tiny_engine(tokenizer, seed: int = 0, max_position_embeddings: int = 512):
    torch.manual_seed(seed)
    model = build_tiny_model(tokenizer, max_position_embeddings=max_position_embeddings, seed=seed)
    return HFRolloutEngine(model, tokenizer)


class RecordingEngine(RolloutEngine):
    """Wraps an engine and records every call's prompts and completions (token-in/token-out checks)."""

    def __init__(self, inner: RolloutEngine):
        self.inner = inner
        self.calls: list[tuple[list[list[int]], SamplingParams, list[list[Completion]]]] = []

    def generate(self, prompt_ids, params):
        out = self.inner.generate(prompt_ids, params)
        self.calls.append(([list(p) for p in prompt_ids], params, out))
        return out

    def update_weights(self, state_dict_or_model):
        self.inner.update_weights(state_dict_or_model)


class ScriptedEngine(RolloutEngine):
    """Answers turn k of every prompt with ``script[k]`` (text, tokenized) + eos; log-prob -0.5 per token.

    ``script`` may also be a function ``(prompt_ids, call_index) -> text``. ``stop`` False leaves the eos
    off and reports finish_reason "length".
    """

    def __init__(self, tokenizer, script, stop: bool = True):
        self.tokenizer, self.script, self.stop = tokenizer, script, stop
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []

    def generate(self, prompt_ids, params):
        call = len(self.calls)
        self.calls.append(([list(p) for p in prompt_ids], params))
        groups = []
        for index, prompt in enumerate(prompt_ids):
            text = self.script(prompt, call) if callable(self.script) else self.script[min(call, len(self.script) - 1)]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if self.stop:
                ids = ids + [self.tokenizer.eos_token_id]
            reason = "stop" if self.stop else "length"
            if not ids:  # engines generate at least one token
                ids, reason = [self.tokenizer.eos_token_id], "stop"
            if len(ids) > params.max_new_tokens:
                ids, reason = ids[: params.max_new_tokens], "length"
            groups.append([Completion(index, ids, [-0.5] * len(ids), reason) for _ in range(params.n)])
        return groups

    def update_weights(self, state_dict_or_model):
        pass


class CountingEnv(Environment):
    """Rewards every turn with `reward`, answers "again" (a user turn), done after `turns` turns."""

    def __init__(self, turns: int = 3, reward: float = 0.5):
        self.turns, self.reward, self.seen = turns, reward, 0
        self.closed = 0

    def reset(self, row):
        self.turns = row.get("extras", {}).get("turns", self.turns)
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, turn: AssistantTurn) -> StepResult:
        self.seen += 1
        done = self.seen >= self.turns
        return StepResult(observation=[{"role": "user", "content": "again"}], reward=self.reward, done=done,
                          info={"seen": self.seen})

    def close(self):
        self.closed += 1


class StepRaisesEnv(CountingEnv):
    """Raises in step() on turn `fail_at` (1-based)."""

    def __init__(self, fail_at: int = 2, turns: int = 5, reward: float = 0.5):
        super().__init__(turns=turns, reward=reward)
        self.fail_at = fail_at

    def step(self, turn):
        if self.seen + 1 >= self.fail_at:
            raise RuntimeError("simulator crashed")
        return super().step(turn)


class ResetRaisesEnv(CountingEnv):
    """Raises in reset() for rows whose extras say so."""

    def reset(self, row):
        if row.get("extras", {}).get("broken"):
            raise KeyError("no such board")
        return super().reset(row)


class BadReturnEnv(CountingEnv):
    """Returns something that is not a StepResult."""

    def step(self, turn):
        return {"observation": []}


class MatchReward:
    """1.0 when the response equals the ground truth, else 0.0; carries a composer-like ``fallback``."""

    def __init__(self, fallback: float = -1.0):
        self.fallback = fallback
        self.seen: list[dict] = []

    def __call__(self, prompt, response, ground_truth, extras):
        self.seen.append({"prompt": prompt, "response": response})
        return 1.0 if response.strip() == ground_truth else 0.0


def constant_reward(value: float = 1.0):
    def reward(prompt, response, ground_truth, extras):
        return value
    return reward
