"""Fused response log-probs when the LM head weight is sharded: ZeRO-3, FSDP2, against the unsharded model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from rltk.models.logprobs import response_logprobs, response_logprobs_naive, run_as_forward
from tests.isolated import run_isolated

HERE = Path(__file__).resolve().parent
VOCAB = 97


def qwen2(tie: bool) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=VOCAB, initializer_range=0.2, tie_word_embeddings=tie,
    )
    return transformers.Qwen2ForCausalLM(config)


def batch():
    ids = torch.randint(3, VOCAB, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, -2:] = 0
    return ids, mask, 5


def _launch(command: list[str]) -> str:
    return run_isolated(command, extra_env={"PYTHONPATH": str(HERE.parents[1])}).stdout


@pytest.mark.slow
def test_zero3_partitioned_head_gives_the_unsharded_values_and_gradients():
    # A separate process: DeepSpeed's process group must not leak into other tests.
    stdout = _launch([sys.executable, str(HERE / "zero3_logprobs_worker.py")])
    assert stdout.count("RESULT") == 1, stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_zero3_head_partitioned_across_two_processes_gets_the_averaged_gradient():
    stdout = _launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                      str(HERE / "zero3_logprobs_worker.py")])
    assert stdout.count("RESULT") == 2, stdout


def test_run_as_forward_runs_the_module_hooks_and_restores_forward():
    module = nn.Linear(4, 3)
    seen = []
    module.register_forward_pre_hook(lambda mod, args: seen.append("pre"))
    module.register_forward_hook(lambda mod, args, out: seen.append("post"))
    out = run_as_forward(module, lambda x: x * 2, torch.ones(2))
    assert seen == ["pre", "post"] and torch.equal(out, torch.full((2,), 2.0))
    assert "forward" not in module.__dict__
    patched = lambda x: x  # noqa: E731  (a wrapper's own instance forward is put back)
    module.forward = patched
    with pytest.raises(ValueError):
        run_as_forward(module, lambda x: (_ for _ in ()).throw(ValueError("boom")), torch.ones(2))
    assert module.__dict__["forward"] is patched


@pytest.fixture
def single_process_group(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp2_head_in_a_unit_of_its_own_runs_the_op_inside_its_forward(single_process_group):
    from torch.distributed.fsdp import fully_shard

    reference, model = qwen2(tie=False), qwen2(tie=False)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model.lm_head)  # resharded after its own forward: a DTensor outside it
    fully_shard(model)
    ids, mask, width = batch()
    ours = response_logprobs(model, ids, mask, width, impl="torch", with_entropy=True)
    assert type(model.lm_head.weight).__name__ == "DTensor"
    ref = response_logprobs_naive(reference, ids, mask, width, with_entropy=True)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    (ours[0].sum() + ours[1].sum()).backward()
    (ref[0].sum() + ref[1].sum()).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, atol=1e-5, rtol=1e-4)


def test_head_left_sharded_falls_back_to_the_models_logits_under_auto_only(single_process_group):
    from torch.distributed.fsdp import fully_shard

    reference, model = qwen2(tie=False), qwen2(tie=False)
    # A wrapper on the decoder stack only: the head's weight stays a DTensor no hook ever unshards
    # for a call of the head module alone.
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model, reshard_after_forward=True)
    ids, mask, width = batch()
    response_logprobs_naive(model, ids, mask, width)  # one forward, so the root's hooks are in place
    if type(model.lm_head.weight).__name__ != "DTensor":
        pytest.skip("this torch keeps the root's parameters unsharded after the forward")
    with pytest.raises(NotImplementedError, match="impl='auto'"):
        response_logprobs(model, ids, mask, width, impl="torch")
    ours = response_logprobs(model, ids, mask, width, impl="auto", with_entropy=True)
    ref = response_logprobs_naive(reference, ids, mask, width, with_entropy=True)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
