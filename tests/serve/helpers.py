"""Shared pieces of the endpoint tests: the tiny chat model, engines that script or record, a live server."""

from __future__ import annotations

import threading
import time

from rltk.rollout.base import Completion, RolloutEngine, SamplingParams, cut_at_stop
from tests.workflows.multi_turn_helpers import RecordingEngine


def ensure_serve_builtins() -> None:
    """Register the agentic workflow and the builtin agents when the installed entry points predate them."""
    from tests.builtin_plugins import ensure_registered

    ensure_registered("agentic", "agents")


def tiny_chat_model():
    """The char tokenizer with its chat template and a 1-layer tiny Qwen2 (fast on one thread)."""
    from rltk.models.tiny import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64, max_position_embeddings=128)
    return tokenizer, model


class SpyEngine(RecordingEngine):
    """A :class:`RecordingEngine` (every call's prompt ids, params and completions) that also keeps the
    names of the threads that called it and may take ``delay_s`` longer per call."""

    def __init__(self, inner: RolloutEngine, delay_s: float = 0.0):
        super().__init__(inner)
        self.model = getattr(inner, "model", None)
        self.delay_s = delay_s
        self.threads: set[str] = set()

    def generate(self, prompt_ids, params):
        self.threads.add(threading.current_thread().name)
        if self.delay_s:
            time.sleep(self.delay_s)
        return super().generate(prompt_ids, params)


class ScriptedEngine(RolloutEngine):
    """Answers each prompt with a scripted text: ``script(prompt_text) -> completion text``.

    The completion is the text's ids plus eos (``finish_reason "stop"``), cut at
    ``max_new_tokens`` like a real engine; log-prob of token ``i`` is
    ``-(i + 1) / 10`` so tests can check exactly where each one lands.
    """

    def __init__(self, tokenizer, script, append_eos: bool = True):
        self.tokenizer = tokenizer
        self.script = script
        self.append_eos = append_eos
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []

    def generate(self, prompt_ids, params):
        self.calls.append(([list(p) for p in prompt_ids], params))
        eos = self.tokenizer.eos_token_id
        stops = params.stop_token_ids if params.stop_token_ids is not None else [eos]
        out = []
        for index, ids in enumerate(prompt_ids):
            text = self.script(self.tokenizer.decode(ids))
            tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"] + ([eos] if self.append_eos else [])
            logprobs = [-(i + 1) / 10 for i in range(len(tokens))]
            samples = []
            for _ in range(params.n):
                kept, lps, reason = cut_at_stop(tokens, logprobs, stops, params.max_new_tokens)
                samples.append(Completion(index, kept, lps, reason, self.tokenizer.decode(kept, skip_special_tokens=True)))
            out.append(samples)
        return out

    def update_weights(self, state_dict_or_model):
        pass
