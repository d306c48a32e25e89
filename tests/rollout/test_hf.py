"""HFRolloutEngine against an independent recompute with plain forward passes."""

import pytest
import torch
from torch import nn

import rltk
from rltk.rollout.base import SamplingParams
from rltk.rollout.hf import HFRolloutEngine

from .conftest import build_model

PROMPTS = ["12+3=", "7=", "abc de", "(9*9)-1="]


def reference_logprobs(model, prompt, completion, *, temperature=1.0, top_k=0, top_p=1.0):
    """Log-probs of ``completion`` tokens re-scored with one unpadded forward pass.

    Written independently of transformers' warpers: divide by temperature, keep
    the top_k largest logits, then keep the smallest most-likely set whose mass
    reaches top_p (a token is kept if the mass strictly before it is < top_p).
    Returns ``(logprobs [L], log-probs of the full filtered distribution [L, V])``.
    """
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(completion)].double()
    logits = logits / temperature  # [L, V]
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        probs = logits.softmax(-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    full = logits.log_softmax(-1)
    return full.gather(1, torch.tensor(completion)[:, None]).squeeze(1), full


def test_registered_as_hf():
    assert rltk.get_component("rollout_engine", "hf") is HFRolloutEngine


def test_greedy_tokens_are_argmax_and_logprobs_are_temperature_one(model, tokenizer, encode):
    engine = HFRolloutEngine(model, tokenizer)
    prompts = [encode(p) for p in PROMPTS]
    out = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=6, stop_token_ids=[]))
    for prompt, [completion] in zip(prompts, out):
        assert completion.finish_reason == "length" and len(completion.token_ids) == 6
        expected, full = reference_logprobs(model, prompt, completion.token_ids)
        assert completion.token_ids == full.argmax(-1).tolist()
        torch.testing.assert_close(torch.tensor(completion.logprobs, dtype=torch.float64), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(2.0, 0, 1.0), (0.7, 5, 1.0), (1.0, 0, 0.6), (0.7, 5, 0.9)],
)
def test_sampled_logprobs_are_those_of_the_filtered_distribution(model, tokenizer, encode, temperature, top_k, top_p):
    engine = HFRolloutEngine(model, tokenizer)
    prompts = [encode(p) for p in PROMPTS[:2]]
    params = SamplingParams(n=3, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=8,
                            stop_token_ids=[], seed=11)
    differs_from_unfiltered = 0.0
    for prompt, group in zip(prompts, engine.generate(prompts, params)):
        for completion in group:
            expected, full = reference_logprobs(model, prompt, completion.token_ids,
                                                temperature=temperature, top_k=top_k, top_p=top_p)
            assert torch.isfinite(expected).all(), "a sampled token lies outside the kept set"
            torch.testing.assert_close(torch.tensor(completion.logprobs, dtype=torch.float64), expected,
                                       atol=1e-5, rtol=0)
            raw, _ = reference_logprobs(model, prompt, completion.token_ids)
            differs_from_unfiltered = max(differs_from_unfiltered, (expected - raw).abs().max().item())
    # The settings really change the distribution, so the comparison above has teeth.
    assert differs_from_unfiltered > 1e-2


def test_top_k_one_makes_sampling_greedy_with_logprob_zero(model, tokenizer, encode):
    engine = HFRolloutEngine(model, tokenizer)
    prompts = [encode(p) for p in PROMPTS]
    sampled = engine.generate(prompts, SamplingParams(top_k=1, max_new_tokens=5, stop_token_ids=[], seed=3))
    greedy = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=5, stop_token_ids=[]))
    for [s], [g] in zip(sampled, greedy):
        assert s.token_ids == g.token_ids
        assert s.logprobs == [0.0] * 5  # one token kept: probability 1


def test_stop_token_cuts_completion_and_is_kept(model, tokenizer, encode):
    engine = HFRolloutEngine(model, tokenizer)
    prompt = encode("12+3=")
    [[free]] = engine.generate([prompt], SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=[]))
    position = next(i for i, t in enumerate(free.token_ids) if t not in free.token_ids[:i] and i >= 2)
    stop = free.token_ids[position]
    [[cut]] = engine.generate([prompt], SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=[stop]))
    assert cut.finish_reason == "stop"
    assert cut.token_ids == free.token_ids[: position + 1] and cut.token_ids[-1] == stop
    assert cut.logprobs == pytest.approx(free.logprobs[: position + 1], abs=1e-6)
    assert cut.text == tokenizer.decode(cut.token_ids, skip_special_tokens=True)


def test_eos_of_the_tokenizer_is_the_default_stop(model, tokenizer, encode):
    engine = HFRolloutEngine(model, tokenizer)
    prompt = encode("7=")
    [[free]] = engine.generate([prompt], SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=[]))
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(free.token_ids[1])
    [[cut]] = engine.generate([prompt], SamplingParams(greedy=True, max_new_tokens=8))
    first = free.token_ids.index(free.token_ids[1])
    assert cut.finish_reason == "stop" and cut.token_ids == free.token_ids[: first + 1]


def test_left_padded_batch_matches_one_prompt_at_a_time(model, tokenizer, encode):
    prompts = [encode(p) for p in PROMPTS]  # lengths 5, 2, 6, 8
    params = SamplingParams(greedy=True, max_new_tokens=7, stop_token_ids=[])
    batched = HFRolloutEngine(model, tokenizer, batch_size=64).generate(prompts, params)
    single = HFRolloutEngine(model, tokenizer, batch_size=1).generate(prompts, params)
    for [b], [s] in zip(batched, single):
        assert b.token_ids == s.token_ids
        assert b.logprobs == pytest.approx(s.logprobs, abs=1e-5)


def test_n_samples_are_grouped_by_prompt_across_chunks(model, tokenizer, encode):
    prompts = [encode(p) for p in PROMPTS[:3]]
    params = SamplingParams(n=4, max_new_tokens=6, stop_token_ids=[], seed=5)
    out = HFRolloutEngine(model, tokenizer, batch_size=5).generate(prompts, params)  # 12 rows in chunks of 5
    assert [len(group) for group in out] == [4, 4, 4]
    assert [[c.prompt_index for c in group] for group in out] == [[0] * 4, [1] * 4, [2] * 4]
    for prompt, group in zip(prompts, out):
        assert len({tuple(c.token_ids) for c in group}) > 1  # independent samples
        for completion in group:  # each sample continues its own prompt
            expected, _ = reference_logprobs(model, prompt, completion.token_ids)
            assert torch.isfinite(expected).all()
            assert completion.logprobs == pytest.approx(expected.tolist(), abs=1e-5)
    greedy = HFRolloutEngine(model, tokenizer, batch_size=5).generate(
        prompts, SamplingParams(n=3, greedy=True, max_new_tokens=6, stop_token_ids=[]))
    assert all(len({tuple(c.token_ids) for c in group}) == 1 for group in greedy)


def test_seed_makes_a_call_reproducible_without_touching_global_rng(model, tokenizer, encode):
    engine = HFRolloutEngine(model, tokenizer)
    prompts = [encode(p) for p in PROMPTS]
    params = SamplingParams(n=2, max_new_tokens=6, stop_token_ids=[], seed=123)
    state = torch.get_rng_state()
    first = engine.generate(prompts, params)
    assert torch.equal(torch.get_rng_state(), state)
    second = engine.generate(prompts, params)
    other = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=6, stop_token_ids=[], seed=124))
    tokens = lambda out: [[c.token_ids for c in g] for g in out]  # noqa: E731
    assert tokens(first) == tokens(second)
    assert tokens(first) != tokens(other)


def test_train_mode_and_generation_config_are_restored(model, tokenizer, encode):
    engine = HFRolloutEngine(model, tokenizer)
    prompts = [encode(p) for p in PROMPTS]
    params = SamplingParams(greedy=True, max_new_tokens=5, stop_token_ids=[])
    model.train()
    clean = engine.generate(prompts, params)
    assert model.training
    # A checkpoint's generation defaults must not leak into rollouts.
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.suppress_tokens = clean[0][0].token_ids[:1]
    noisy = engine.generate(prompts, params)
    assert [g[0].token_ids for g in noisy] == [g[0].token_ids for g in clean]
    assert model.generation_config.repetition_penalty == 5.0
    model.eval()
    engine.generate(prompts, params)
    assert not model.training


class Wrapper(nn.Module):
    """Stands in for DDP: the real model sits at ``.module``."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def test_update_weights(model, tokenizer, encode):
    prompts = [encode(p) for p in PROMPTS]
    params = SamplingParams(greedy=True, max_new_tokens=6, stop_token_ids=[])
    engine = HFRolloutEngine(Wrapper(model), tokenizer)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    engine.update_weights(model)  # the module it already samples from: nothing to do
    engine.update_weights(Wrapper(model))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    other = build_model(len(tokenizer), seed=1)
    want = HFRolloutEngine(other, tokenizer).generate(prompts, params)
    assert [g[0].token_ids for g in engine.generate(prompts, params)] != [g[0].token_ids for g in want]
    state = {k: v for k, v in other.state_dict().items() if k != "lm_head.weight"}  # tied to the embedding
    engine.update_weights(state)
    got = engine.generate(prompts, params)
    assert [g[0].token_ids for g in got] == [g[0].token_ids for g in want]

    engine.update_weights(before)  # back, from a full state dict
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="missing 1"):
        engine.update_weights({k: v for k, v in before.items() if k != "model.norm.weight"})
    with pytest.raises(ValueError, match="unexpected 1"):
        engine.update_weights({**before, "extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="does not fit"):
        engine.update_weights({**before, "model.norm.weight": torch.zeros(3)})
    with pytest.raises(TypeError, match="nn.Module or a state dict"):
        engine.update_weights([1, 2])


def test_constructor_errors(model, tokenizer):
    with pytest.raises(ValueError, match=r"batch_size \(rollout.engine_args.batch_size\) must be an integer >= 1"):
        HFRolloutEngine(model, tokenizer, batch_size=0)
    with pytest.raises(TypeError, match="generate"):
        HFRolloutEngine(nn.Linear(2, 2), tokenizer)


def test_use_model_switches_the_module_the_engine_samples_from(model, tokenizer, encode):
    prompts = [encode(p) for p in PROMPTS]
    params = SamplingParams(greedy=True, max_new_tokens=6, stop_token_ids=[])
    other = build_model(len(tokenizer), seed=1)
    engine = HFRolloutEngine(model, tokenizer)
    engine.use_model(other)
    assert engine.model is other
    want = HFRolloutEngine(other, tokenizer).generate(prompts, params)
    assert [g[0].token_ids for g in engine.generate(prompts, params)] == [g[0].token_ids for g in want]
    engine.update_weights(other)  # the module it samples from now: nothing to copy
    engine.update_weights(model)  # a whole module of the same shape: copied in, other's storage reused
    assert engine.model is other and all(torch.equal(a, b) for a, b in zip(other.parameters(), model.parameters()))
    with pytest.raises(TypeError, match="generate"):
        engine.use_model(nn.Linear(2, 2))


def test_a_prompt_shared_by_n_rows_is_prefilled_once_and_samples_as_without_sharing(model, tokenizer, encode,
                                                                                     monkeypatch):
    # On the generate path (models other than Qwen2/Llama; rltk.rollout.hf_sampling has its own), n rows of
    # one prompt share its prefill (a cache indexed out to the rows); with the same seed the samples and
    # their log-probs are those of the engine prefilling every row itself.
    import rltk.rollout.hf as hf

    monkeypatch.setattr(hf, "sampling_blocker", lambda model: "switched off by the test")

    prompts = [encode(p) for p in PROMPTS[:3]]  # different lengths: left padding inside the shared cache
    params = SamplingParams(n=4, max_new_tokens=6, stop_token_ids=[], seed=11)
    prefills = []
    shared_cache = hf._shared_prompt_cache
    monkeypatch.setattr(hf, "_shared_prompt_cache", lambda *a: prefills.append(a[1].shape) or shared_cache(*a))
    shared = HFRolloutEngine(model, tokenizer).generate(prompts, params)
    assert prefills == [torch.Size([12, 6])]  # 3 prompts x 4 rows, left-padded to the longest (6 tokens)
    (cache,) = shared_cache(model, *_padded(prompts * 4)).values()
    assert cache.get_seq_length() == 5 and cache.layers[0].keys.shape[0] == 12  # all but the last token, per row
    monkeypatch.setattr(hf, "_shared_prompt_cache", lambda *a: {})
    alone = HFRolloutEngine(model, tokenizer).generate(prompts, params)
    for group_shared, group_alone in zip(shared, alone):
        for a, b in zip(group_shared, group_alone):
            assert a.token_ids == b.token_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_a_lora_policy_shares_the_prefill_through_the_peft_wrapper_and_samples_as_without_it(tokenizer, encode,
                                                                                           monkeypatch):
    # peft's PeftModelForCausalLM.forward declares neither `cache` nor `past_key_values` (it passes them on in
    # **kwargs): the keyword is read from the base model's forward, so a LoRA policy's n rows share one prefill
    # like a fully fine-tuned one's. Adapters with weights of their own, so the prefill runs them.
    import rltk.rollout.hf as hf
    from rltk.models.kv_cache import cache_keyword
    from rltk.models.lora import apply_lora

    policy = apply_lora(build_model(len(tokenizer)), {"r": 4, "alpha": 8, "target_modules": "all-linear"})
    with torch.no_grad():
        for name, weight in policy.named_parameters():
            if "lora_B" in name:
                weight.copy_(torch.linspace(-0.5, 0.5, weight.numel()).reshape(weight.shape))
    assert type(policy).__name__ == "PeftModelForCausalLM"
    prompts = [encode(p) for p in PROMPTS[:3]]
    params = SamplingParams(n=4, max_new_tokens=6, stop_token_ids=[], seed=11)
    caches = []
    shared_cache = hf._shared_prompt_cache
    monkeypatch.setattr(hf, "_shared_prompt_cache", lambda *a: caches.append(shared_cache(*a)) or caches[-1])
    shared = HFRolloutEngine(policy, tokenizer).generate(prompts, params)
    assert len(caches) == 1 and list(caches[0]) == [cache_keyword(policy.get_base_model().forward)]  # {} before
    ids, mask = _padded(prompts * 4)
    (cache,) = shared_cache(policy, ids, mask).values()
    assert cache.get_seq_length() == 5 and cache.layers[0].keys.shape[0] == 12  # all but the last token, per row
    # the cache holds the adapted model's keys: the prompts ran through the adapters, not the base model alone
    with policy.disable_adapter():
        (base_cache,) = shared_cache(policy, ids, mask).values()
    assert not torch.allclose(base_cache.layers[0].keys, cache.layers[0].keys)
    monkeypatch.setattr(hf, "_shared_prompt_cache", lambda *a: {})
    alone = HFRolloutEngine(policy, tokenizer).generate(prompts, params)
    # the same tokens; log-probs as close as the fully fine-tuned policy's on this path (the last prompt token
    # attends over a cache instead of in one pass: float32 sums in another order, ~2e-6 apart)
    assert [[c.token_ids for c in g] for g in shared] == [[c.token_ids for c in g] for g in alone]
    for group_shared, group_alone in zip(shared, alone):
        for a, b in zip(group_shared, group_alone):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def _padded(prompts):
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is present")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_tokens_and_logprobs_match_a_float32_rescore_on_the_cpu(tokenizer, encode, dtype):
    # The same weights on the CPU in fp32 (bf16-rounded for the bf16 run) are the reference.
    model = build_model(len(tokenizer)).to(dtype)
    cpu_model = build_model(len(tokenizer))
    cpu_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    engine = HFRolloutEngine(model.cuda(), tokenizer)
    prompts = [encode(p) for p in PROMPTS]
    # fp32 on both devices differs by summation order only. bf16 rounds every activation to 2^-8 of
    # its size and this init makes logits of tens: the bf16 engine against the fp32 rescore differed by
    # up to 0.21 on a CPU (3 seeds, temperatures 1 and 0.7), so 0.35 there, and argmax flips need a
    # top-2 gap under 0.5.
    atol, margin = (1e-4, 1e-3) if dtype == torch.float32 else (0.35, 0.5)
    greedy = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=6, stop_token_ids=[]))
    checked = 0
    for prompt, [completion] in zip(prompts, greedy):
        expected, full = reference_logprobs(cpu_model, prompt, completion.token_ids)
        top2 = full.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > margin  # steps where rounding cannot flip the argmax
        assert (torch.tensor(completion.token_ids)[clear] == full.argmax(-1)[clear]).all()
        torch.testing.assert_close(torch.tensor(completion.logprobs, dtype=torch.float64), expected, atol=atol, rtol=0)
        checked += int(clear.sum())
    assert checked >= 12, "too few greedy steps had a clear argmax to compare"
    # bf16 rounding can reorder the 5th and 6th logits, so top-k filtering is checked in fp32 only
    top_k = 5 if dtype == torch.float32 else 0
    params = SamplingParams(n=3, temperature=0.7, top_k=top_k, max_new_tokens=8, stop_token_ids=[], seed=3)
    first = engine.generate(prompts, params)
    assert [[c.token_ids for c in g] for g in engine.generate(prompts, params)] == [[c.token_ids for c in g] for g in first]
    for prompt, group in zip(prompts, first):
        for completion in group:
            expected, _ = reference_logprobs(cpu_model, prompt, completion.token_ids, temperature=0.7, top_k=top_k)
            assert torch.isfinite(expected).all(), "a sampled token lies outside the kept set"
            torch.testing.assert_close(torch.tensor(completion.logprobs, dtype=torch.float64), expected,
                                       atol=atol, rtol=0)
    assert next(model.parameters()).device.type == "cuda"
