"""The hf engine's own sampling loop (rltk.rollout.hf_sampling) against ``model.generate``: the same
tokens and log-probs bit for bit, with the rows it leaves out of each forward really left out."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import rltk.rollout.hf as hf
from rltk.rollout.base import SamplingParams
from rltk.rollout.hf import HFRolloutEngine
from rltk.rollout.hf_sampling import MIN_FORWARD_ROWS, _rows_to_keep, sampling_applies, shared_prompts

from .conftest import build_model, build_tokenizer

TOKENIZER = build_tokenizer()
VOCAB = len(TOKENIZER)


def _llama(seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, intermediate_size=64, max_position_embeddings=128,
                         initializer_range=0.3, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


MODELS = {"qwen2": build_model(VOCAB).eval(), "llama": _llama().eval()}


def _both_ways(model, prompts, params, monkeypatch):
    """(the loop's completions, generate's completions) for the same call."""
    engine = HFRolloutEngine(model, TOKENIZER)
    with monkeypatch.context() as patch:
        patch.setattr(hf, "sampling_blocker", lambda model: "switched off by the test")
        want = engine.generate(prompts, params)
    return engine.generate(prompts, params), want


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(sorted(MODELS)),
    prompt_lengths=st.lists(st.integers(1, 7), min_size=1, max_size=5),
    n=st.sampled_from([1, 2, 3, 8]),
    max_new_tokens=st.integers(1, 9),
    sampling=st.sampled_from(["greedy", "plain", "filtered"]),
    stops=st.sampled_from(["eos", "none", "many"]),
    seed=st.integers(0, 2**16),
)
def test_tokens_and_logprobs_are_generates_bit_for_bit(name, prompt_lengths, n, max_new_tokens, sampling, stops, seed,
                                                      monkeypatch):
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (length,), generator=generator).tolist() for length in prompt_lengths]
    # "many": a third of the vocabulary stops a row, so rows end at different steps and leave the batch
    stop_ids = {"eos": None, "none": [], "many": list(range(1, VOCAB, 3))}[stops]
    extra = {"greedy": dict(greedy=True), "plain": {}, "filtered": dict(temperature=0.7, top_k=9, top_p=0.9)}[sampling]
    params = SamplingParams(n=n, max_new_tokens=max_new_tokens, stop_token_ids=stop_ids, seed=seed, **extra)
    got, want = _both_ways(MODELS[name], prompts, params, monkeypatch)
    bitwise = _blas_rounds_rows_alike()
    for group_got, group_want in zip(got, want, strict=True):
        for a, b in zip(group_got, group_want, strict=True):
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
            if bitwise:
                assert a.logprobs == b.logprobs
            else:
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def _blas_rounds_rows_alike() -> bool:
    """Whether this machine's matrix product gives a row the same bits at MIN_FORWARD_ROWS rows as at 32
    (true of MKL on the CPUs we measured; the loop's bit-for-bit claim rests on it)."""
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 32, generator=generator), torch.randn(64, 32, generator=generator)
    return all(torch.equal(torch.nn.functional.linear(x[:rows], w), torch.nn.functional.linear(x, w)[:rows])
               for rows in range(MIN_FORWARD_ROWS, 32))


def test_finished_rows_leave_the_forward_and_prompts_run_their_last_token_once(monkeypatch):
    model = MODELS["qwen2"]
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    params = SamplingParams(n=8, max_new_tokens=8, stop_token_ids=list(range(1, VOCAB, 3)), seed=3)
    shapes = []
    handle = model.model.register_forward_hook(lambda module, args, kwargs, out: shapes.append(
        tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        got, want = _both_ways(model, prompts, params, monkeypatch)
    finally:
        handle.remove()
    loop_shapes = shapes[len(shapes) - _forwards_of_loop(shapes):]
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in want]
    # the prompts but their last token, once per prompt; the last token on those 3 rows and one more
    assert loop_shapes[:2] == [(3, 3), (MIN_FORWARD_ROWS, 1)]
    # token t + 1 is computed for the rows that had not stopped by token t, at least MIN_FORWARD_ROWS of them
    lengths = [len(c.token_ids) for g in got for c in g]
    expected, rows = [], 24
    for t in range(1, max(lengths)):
        alive = sum(length > t for length in lengths)
        rows = rows if alive == rows else min(rows, max(alive, MIN_FORWARD_ROWS))
        expected.append((rows, 1))
    assert loop_shapes[2:] == expected
    assert expected[-1][0] < 24  # the case exercises rows leaving


def _forwards_of_loop(shapes):
    # generate's forwards come first: its prefill of the distinct prompts, then one per token
    first_of_loop = [i for i, s in enumerate(shapes) if s == (3, 3)][-1]
    return len(shapes) - first_of_loop


def test_shared_prompts_numbers_prompts_by_first_row_and_tops_up_the_lead_rows():
    ids = torch.tensor([[0, 7, 8], [5, 6, 9], [0, 7, 8], [5, 6, 9], [5, 6, 9]])
    mask = (ids != 0).long()
    prompt_of_row, lead = shared_prompts(ids, mask, floor=4)
    assert prompt_of_row.tolist() == [0, 1, 0, 1, 1] and lead.tolist() == [0, 1, 2, 3]
    assert shared_prompts(ids[:2], mask[:2], floor=2) == (None, None)  # nothing repeats
    assert shared_prompts(ids[:, :1], mask[:, :1], floor=4) == (None, None)  # one-token prompts


def test_rows_to_keep():
    computed = torch.tensor([0, 1, 2, 3, 4, 5])
    unfinished = torch.tensor([1, 0, 1, 1, 1, 0])
    assert _rows_to_keep(computed, unfinished, floor=4).tolist() == [0, 2, 3, 4]
    assert _rows_to_keep(computed, torch.tensor([0, 0, 1, 0, 0, 0]), floor=4).tolist() == [0, 1, 2, 3]
    assert _rows_to_keep(computed, torch.ones(6, dtype=torch.long), floor=4) is None
    assert _rows_to_keep(computed[:4], torch.tensor([0, 0, 0, 1, 0, 0]), floor=4) is None  # already at the floor


def test_applies_to_plain_qwen2_and_llama_with_sdpa_only():
    assert sampling_applies(MODELS["qwen2"]) and sampling_applies(MODELS["llama"])
    eager = build_model(VOCAB)
    eager.config._attn_implementation = "eager"
    assert not sampling_applies(eager)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert not sampling_applies(gpt2)


def test_other_models_sample_through_generate(monkeypatch):
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                      eos_token_id=1, pad_token_id=0)).eval()
    monkeypatch.setattr(hf, "sample", lambda *a, **k: pytest.fail("the loop ran a GPT-2"))
    out = HFRolloutEngine(gpt2, TOKENIZER).generate([[5, 6]], SamplingParams(n=2, max_new_tokens=3, seed=0))
    assert len(out[0]) == 2
