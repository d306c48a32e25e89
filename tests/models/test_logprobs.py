"""Response log-probs from a causal LM through the fused op, against model(...).logits.

Tiny random models are built here (no downloads). ``initializer_range`` is
raised so the next-token distributions are peaked, not uniform, which makes a
wrong position or a wrong head visible in the numbers.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from torch import nn

from rltk.models.logprobs import (
    logit_temperature_factor,
    positions_from_mask,
    response_logprobs,
    response_logprobs_naive,
)

from tests.waits import scaled

VOCAB = 97
SMALL = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, vocab_size=VOCAB, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


def qwen2(tie: bool, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, tie_word_embeddings=tie)).eval()


def llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, tie_word_embeddings=False)).eval()


def left_right_padded_batch(seed: int = 0):
    """Three rows, P = 6 prompt columns (left-padded), T = 5 response columns (right-padded)."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (3, 11), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0  # prompt of 3
    attention_mask[1, :1] = 0  # prompt of 5
    attention_mask[0, -1] = 0  # response of 4
    attention_mask[2, -3:] = 0  # response of 2
    input_ids[attention_mask == 0] = 0
    return input_ids, attention_mask, 5


def param_grads(model, outputs, upstream):
    loss = sum((o * u).sum() for o, u in zip(outputs, upstream))
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params, allow_unused=True)


def assert_grads_close(ours, ref, rel=1e-5):
    for a, b in zip(ours, ref):
        if b is None:
            assert a is None or a.abs().max() == 0
            continue
        err = (a - b).abs().max().item()
        assert err <= rel * max(b.abs().max().item(), 1e-12), f"gradient error {err:.3e}"


# --------------------------------------------------------------------------
# Fused path against the model's own logits
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build", [lambda: qwen2(tie=True), lambda: qwen2(tie=False), llama], ids=["qwen2-tied", "qwen2-untied", "llama"]
)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_matches_model_logits_with_gradients(build, temperature):
    model = build()
    input_ids, attention_mask, width = left_right_padded_batch()
    ours = response_logprobs(
        model, input_ids, attention_mask, width, temperature=temperature, impl="torch", with_entropy=True,
        chunk_size=(4, 40),
    )
    ref = response_logprobs_naive(model, input_ids, attention_mask, width, temperature=temperature, with_entropy=True)
    for a, b in zip(ours, ref):
        assert a.shape == (3, width) and a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert ours[0].min() < math.log(1 / VOCAB) - 1, "distribution should be peaked, not uniform"
    upstream = (torch.linspace(-1, 1, 15).view(3, 5), torch.linspace(0.5, 1.5, 15).view(3, 5))
    assert_grads_close(param_grads(model, ours, upstream), param_grads(model, ref, upstream))


def test_tied_head_gets_one_gradient_for_both_uses():
    model = qwen2(tie=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    input_ids, attention_mask, width = left_right_padded_batch(1)
    lp, _ = response_logprobs(model, input_ids, attention_mask, width, impl="torch")
    ref, _ = response_logprobs_naive(model, input_ids, attention_mask, width)
    (ours_grad,) = torch.autograd.grad(lp.sum(), [model.get_input_embeddings().weight])
    (ref_grad,) = torch.autograd.grad(ref.sum(), [model.get_input_embeddings().weight])
    assert_grads_close([ours_grad], [ref_grad])


def test_lm_head_with_bias():
    model = qwen2(tie=False)
    head = nn.Linear(32, VOCAB, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.copy_(torch.linspace(-2, 2, VOCAB))
    model.lm_head = head
    input_ids, attention_mask, width = left_right_padded_batch(2)
    ours = response_logprobs(model, input_ids, attention_mask, width, impl="torch", with_entropy=True)
    ref = response_logprobs_naive(model, input_ids, attention_mask, width, with_entropy=True)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    (g_ours,) = torch.autograd.grad(ours[0].sum() + ours[1].sum(), [head.bias])
    (g_ref,) = torch.autograd.grad(ref[0].sum() + ref[1].sum(), [head.bias])
    assert_grads_close([g_ours], [g_ref])


def gpt2() -> nn.Module:
    # Absolute position embeddings: unlike RoPE models, a shifted position shows in the output.
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2,
    )
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("build", [lambda: qwen2(tie=True), gpt2], ids=["qwen2", "gpt2"])
def test_left_padding_does_not_change_a_row(build):
    # Row 0 has 3 pad columns before its prompt; alone and unpadded it must score the same,
    # which needs position ids counted from its first real token.
    model = build()
    input_ids, attention_mask, width = left_right_padded_batch(3)
    batched = response_logprobs(model, input_ids, attention_mask, width, impl="torch", with_entropy=True)
    alone = input_ids[0:1, 3:10]  # prompt of 3 + response of 4, no padding at all
    single = response_logprobs(model, alone, torch.ones_like(alone), 4, impl="torch", with_entropy=True)
    for a, b in zip(batched, single):
        torch.testing.assert_close(a[0, :4], b[0], atol=1e-5, rtol=0)
    ref = response_logprobs_naive(model, input_ids, attention_mask, width, with_entropy=True)
    for a, b in zip(batched, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_padding_positions_are_zero_and_send_no_gradient():
    model = qwen2(tie=False)
    input_ids, attention_mask, width = left_right_padded_batch(4)
    logprobs, entropy = response_logprobs(model, input_ids, attention_mask, width, impl="torch", with_entropy=True)
    padding = attention_mask[:, -width:] == 0
    assert (logprobs[padding] == 0).all() and (entropy[padding] == 0).all()
    assert (logprobs[~padding] < 0).all() and (entropy[~padding] > 0).all()
    # Changing a padded token id changes nothing.
    changed = input_ids.clone()
    changed[2, -1] = 50
    again, _ = response_logprobs(model, changed, attention_mask, width, impl="torch")
    torch.testing.assert_close(again, logprobs, atol=0, rtol=0)


def test_the_head_runs_on_one_position_only():
    model = qwen2(tie=False)
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    input_ids, attention_mask, width = left_right_padded_batch()
    response_logprobs(model, input_ids, attention_mask, width, impl="torch")
    assert seen == [(3, 1, 32)], f"LM head saw {seen}; the full [B, S, V] logits must never be built"


def test_positions_follow_the_attention_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    assert positions_from_mask(mask).tolist() == [[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 3, 3]]


def test_without_entropy_returns_none_and_empty_response():
    model = qwen2(tie=True)
    input_ids, attention_mask, width = left_right_padded_batch()
    _, entropy = response_logprobs(model, input_ids, attention_mask, width, impl="torch")
    assert entropy is None
    lp, ent = response_logprobs(model, input_ids, attention_mask, 0, impl="torch", with_entropy=True)
    assert lp.shape == ent.shape == (3, 0)


def test_bad_response_width_is_explained():
    model = qwen2(tie=True)
    input_ids, attention_mask, _ = left_right_padded_batch()
    with pytest.raises(ValueError, match=r"response_width=11 must be in \[0, S\) with S = 11"):
        response_logprobs(model, input_ids, attention_mask, 11)
    with pytest.raises(ValueError, match="attention_mask"):
        response_logprobs(model, input_ids, attention_mask[:, 1:], 3)


def test_bf16_model_and_autocast():
    model = qwen2(tie=False)
    input_ids, attention_mask, width = left_right_padded_batch()
    exact, _ = response_logprobs_naive(model, input_ids, attention_mask, width)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast_lp, _ = response_logprobs(model, input_ids, attention_mask, width, impl="torch")
    half = qwen2(tie=False).to(torch.bfloat16)
    half_lp, _ = response_logprobs(half, input_ids, attention_mask, width, impl="torch")
    assert autocast_lp.dtype == half_lp.dtype == torch.float32
    # bf16 activations move log-probs by a few 1e-2 on this model; fp32 log-softmax keeps the rest exact.
    torch.testing.assert_close(autocast_lp, exact, atol=0.1, rtol=0)
    torch.testing.assert_close(half_lp, exact, atol=0.1, rtol=0)


# --------------------------------------------------------------------------
# Final logit scaling of other architectures
# --------------------------------------------------------------------------


def test_cohere_logit_scale_and_granite_logits_scaling_are_folded_into_the_temperature():
    input_ids, attention_mask, width = left_right_padded_batch(5)
    torch.manual_seed(0)
    cohere = transformers.CohereForCausalLM(transformers.CohereConfig(**SMALL, logit_scale=0.25)).eval()
    torch.manual_seed(0)
    granite = transformers.GraniteForCausalLM(transformers.GraniteConfig(**SMALL, logits_scaling=3.0)).eval()
    assert logit_temperature_factor(cohere) == pytest.approx(4.0)
    assert logit_temperature_factor(granite) == pytest.approx(3.0)
    for model in (cohere, granite):
        ours = response_logprobs(model, input_ids, attention_mask, width, temperature=0.8, impl="torch",
                                 with_entropy=True)
        ref = response_logprobs_naive(model, input_ids, attention_mask, width, temperature=0.8, with_entropy=True)
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_soft_capped_logits_are_refused_with_the_naive_alternative():
    torch.manual_seed(0)
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**SMALL, head_dim=8)).eval()
    input_ids, attention_mask, width = left_right_padded_batch()
    with pytest.raises(NotImplementedError, match="final_logit_softcapping=30.0.*response_logprobs_naive"):
        response_logprobs(gemma, input_ids, attention_mask, width, impl="torch")
    lp, _ = response_logprobs_naive(gemma, input_ids, attention_mask, width)
    assert torch.isfinite(lp).all()


# --------------------------------------------------------------------------
# Wrappers: DDP's forward must run, or gradients would not be synchronised
# --------------------------------------------------------------------------


@pytest.fixture
def single_process_group(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_wrapped_model_runs_through_the_wrapper(single_process_group):
    model = qwen2(tie=False)
    ddp = nn.parallel.DistributedDataParallel(model)
    calls = []
    ddp.register_forward_pre_hook(lambda module, args: calls.append(1))
    input_ids, attention_mask, width = left_right_padded_batch(6)
    ours = response_logprobs(ddp, input_ids, attention_mask, width, impl="torch", with_entropy=True)
    assert calls == [1], "the DDP wrapper's forward must run (it prepares gradient synchronisation)"
    ref = response_logprobs_naive(model, input_ids, attention_mask, width, with_entropy=True)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    (ours[0].sum() + ours[1].sum()).backward()
    fused_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (ref[0].sum() + ref[1].sum()).backward()
    assert_grads_close(fused_grads, [p.grad for p in model.parameters()])


class ForwardingEngine(nn.Module):
    """Shaped like DeepSpeed's engine: holds ``.module`` and forwards unknown attributes to it."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.forward_calls = 0

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)

    def forward(self, *args, **kwargs):
        self.forward_calls += 1
        return self.module(*args, **kwargs)


def test_engine_that_forwards_attributes_is_still_called_through_its_forward():
    model = qwen2(tie=True)
    engine = ForwardingEngine(model)
    assert hasattr(engine, "get_output_embeddings")  # forwarded, yet it is a wrapper
    input_ids, attention_mask, width = left_right_padded_batch(8)
    ours = response_logprobs(engine, input_ids, attention_mask, width, impl="torch", with_entropy=True)
    assert engine.forward_calls == 1
    ref = response_logprobs_naive(model, input_ids, attention_mask, width, with_entropy=True)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_fsdp2_sharded_model_in_one_process(single_process_group):
    from torch.distributed.fsdp import fully_shard

    reference = qwen2(tie=True)
    model = qwen2(tie=True)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    input_ids, attention_mask, width = left_right_padded_batch(7)
    ours = response_logprobs(model, input_ids, attention_mask, width, impl="torch", with_entropy=True)
    ref = response_logprobs_naive(reference, input_ids, attention_mask, width, with_entropy=True)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    (ours[0].sum() + ours[1].sum()).backward()
    (ref[0].sum() + ref[1].sum()).backward()
    assert_grads_close([p.grad.full_tensor() for p in model.parameters()], [p.grad for p in reference.parameters()])


FSDP2_WORKER = '''
import os, sys, torch, transformers
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from rltk.models.logprobs import response_logprobs, response_logprobs_naive

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
config = transformers.Qwen2Config(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
    vocab_size=97, tie_word_embeddings=True, initializer_range=0.2,
)
reference = transformers.Qwen2ForCausalLM(config)
model = transformers.Qwen2ForCausalLM(config)
model.load_state_dict(reference.state_dict())
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
batches = []
for r in range(dist.get_world_size()):
    ids = torch.randint(3, 97, (3, 11), generator=torch.Generator().manual_seed(r))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    batches.append((ids, mask))
lp, ent = response_logprobs(model, *batches[rank], 5, impl="torch", with_entropy=True)
(lp.sum() + ent.sum()).backward()
# FSDP averages gradients over ranks: the reference is the mean of every rank's loss.
total = 0
for ids, mask in batches:
    ref_lp, ref_ent = response_logprobs_naive(reference, ids, mask, 5, with_entropy=True)
    total = total + ref_lp.sum() + ref_ent.sum()
(total / len(batches)).backward()
worst = max(
    ((p.grad.full_tensor() - q.grad).abs().max() / q.grad.abs().max()).item()
    for p, q in zip(model.parameters(), reference.parameters())
)
print(f"RESULT rank={rank} worst_rel_grad_error={worst:.3e}", flush=True)
dist.destroy_process_group()
# os._exit: under CPU contention a gloo thread's C++ destructor at interpreter exit once aborted
# ("terminate called without an active exception", exit -6) after both results were printed
os._exit(0 if worst < 1e-5 else 1)
'''


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_two_processes_shard_the_head_and_average_its_gradient(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker = tmp_path / "worker.py"
    worker.write_text(FSDP2_WORKER)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(180),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("RESULT") == 2, result.stdout


@pytest.mark.parametrize("impl", ["torch", "naive"])
def test_sum_pi_squared_of_each_response_position_matches_the_model_logits(impl):
    # optimal_token_baseline's statistic: sum_v pi(v)^2 of the distribution that predicted each response token
    model = qwen2(tie=False)
    input_ids, attention_mask, T = left_right_padded_batch()
    logprobs, entropy, sq = response_logprobs(model, input_ids, attention_mask, T, temperature=0.7, impl=impl,
                                              with_sum_pi_squared=True)
    ref_lp, ref_ent, ref_sq = response_logprobs_naive(model, input_ids, attention_mask, T, temperature=0.7,
                                                      with_entropy=True, with_sum_pi_squared=True)
    assert entropy is None and not sq.requires_grad and logprobs.requires_grad
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=positions_from_mask(attention_mask)).logits[:, -(T + 1) : -1].double()
    by_hand = (logits / 0.7).softmax(-1).square().sum(-1)  # [B, T]
    valid = attention_mask[:, -T:].bool()
    torch.testing.assert_close(sq.double(), torch.where(valid, by_hand, 0.0), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ref_sq, sq, atol=1e-6, rtol=1e-5)
    assert (sq[~valid] == 0).all() and (sq[valid] > 0).all()
    torch.testing.assert_close(ref_lp, logprobs, atol=1e-5, rtol=0)
    assert len(response_logprobs(model, input_ids, attention_mask, T)) == 2  # no third output unless asked
    empty = response_logprobs(model, input_ids[:, :6], attention_mask[:, :6], 0, with_sum_pi_squared=True)
    assert len(empty) == 3 and empty[2].shape == (3, 0)


# --------------------------------------------------------------------------
# Prompts shared by several rows run once
# --------------------------------------------------------------------------


def grouped_batch(seed: int = 0):
    """Three prompts (left-padded to P = 6) with 3, 1 and 2 responses (right-padded to T = 5), rows shuffled
    so that a group's rows are not adjacent."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, VOCAB, (3, 6), generator=gen)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[0, :2] = 0
    prompt_mask[2, :4] = 0
    rows = [0, 2, 1, 0, 2, 0]
    responses = torch.randint(3, VOCAB, (len(rows), 5), generator=gen)
    response_mask = torch.ones_like(responses)
    response_mask[1, -2:] = 0
    response_mask[3, -4:] = 0  # a response of one token
    input_ids = torch.cat([prompts[rows], responses], dim=1)
    attention_mask = torch.cat([prompt_mask[rows], response_mask], dim=1)
    input_ids[attention_mask == 0] = 0
    return input_ids, attention_mask, 5


@pytest.mark.parametrize("build", [lambda: qwen2(tie=True), llama], ids=["qwen2-tied", "llama"])
@pytest.mark.parametrize("width", [5, 1])
def test_rows_sharing_a_prompt_give_the_full_pass_values_and_gradients(build, width):
    from rltk.models.logprobs import shared_prompt_hidden_states

    model = build()
    input_ids, attention_mask, full = grouped_batch()
    input_ids, attention_mask = input_ids[:, : input_ids.shape[1] - full + width], attention_mask[:, : 6 + width]
    assert shared_prompt_hidden_states(model, input_ids, attention_mask, 6) is not None  # the shared path runs
    ours = response_logprobs(model, input_ids, attention_mask, width, impl="torch", with_entropy=True)
    ref = response_logprobs_naive(model, input_ids, attention_mask, width, with_entropy=True)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    upstream = (torch.linspace(-1, 1, 6 * width).view(6, width), torch.linspace(0.5, 1.5, 6 * width).view(6, width))
    assert_grads_close(param_grads(model, ours, upstream), param_grads(model, ref, upstream))


def test_distinct_prompts_and_wrapped_models_take_the_whole_batch_path():
    from rltk.models.logprobs import shared_prompt_hidden_states

    model = qwen2(tie=True)
    input_ids, attention_mask, _ = left_right_padded_batch()  # three different prompts
    assert shared_prompt_hidden_states(model, input_ids, attention_mask, 6) is None
    input_ids, attention_mask, _ = grouped_batch()
    wrapper = nn.Module()
    wrapper.module = model  # DDP / DeepSpeed style: hooks expect one forward per backward
    assert shared_prompt_hidden_states(wrapper, input_ids, attention_mask, 6) is None


class _Wrapper(nn.Module):
    """DDP / DeepSpeed style: the model in ``.module``, forward passed through."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_a_plain_copy_that_follows_the_wrapped_models_path_matches_it_bitwise_and_its_k3_gradient_is_zero():
    # The frozen reference is a plain copy of a policy that trains wrapped. The copy could share prompts,
    # the wrapped policy cannot; the reference pass must take the policy's path, or at equal weights the
    # two log-probs differ by rounding and the KL term sends a noise gradient that Adam scales to a step.
    import copy

    from rltk.algorithms.kl import kl_k3
    from rltk.models.logprobs import prompt_sharing_applies

    model = qwen2(tie=True)
    policy, reference = _Wrapper(model), copy.deepcopy(model).requires_grad_(False)
    assert not prompt_sharing_applies(policy) and prompt_sharing_applies(reference)
    input_ids, attention_mask, width = grouped_batch()
    logprobs, _ = response_logprobs(policy, input_ids, attention_mask, width, impl="torch")
    with torch.no_grad():
        followed, _ = response_logprobs(reference, input_ids, attention_mask, width, impl="torch",
                                      share_prompts=prompt_sharing_applies(policy))
        shared, _ = response_logprobs(reference, input_ids, attention_mask, width, impl="torch")
    assert torch.equal(logprobs.detach(), followed)
    torch.testing.assert_close(shared, followed, atol=1e-5, rtol=0)  # the other path: equal up to rounding only
    kl_k3(logprobs, followed).sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and not any(g.any() for g in grads)
