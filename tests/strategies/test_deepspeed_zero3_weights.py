"""Whole weights out of a ZeRO-3 strategy: full_model_copy, the rollout engine's copy, release_model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers

from rltk.models.sharding import weightless_copy
from tests.isolated import run_isolated

HERE = Path(__file__).resolve().parent


def _launch(command: list[str]) -> str:
    return run_isolated(command, extra_env={"RLTK_DISABLE_PLUGIN_AUTOLOAD": "1"}).stdout


@pytest.mark.slow
def test_zero3_copies_and_releases_whole_weights_in_one_process():
    # A separate process: DeepSpeed's process group must not leak into other tests.
    stdout = _launch([sys.executable, str(HERE / "zero3_weights_worker.py")])
    assert stdout.count("RESULT") == 1, stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_zero3_copies_and_releases_whole_weights_across_two_processes():
    stdout = _launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                      str(HERE / "zero3_weights_worker.py")])
    assert stdout.count("RESULT") == 2, stdout


def test_weightless_copy_keeps_structure_ties_and_buffers_but_no_weights():
    torch.manual_seed(0)
    config = transformers.Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=50,
                                      tie_word_embeddings=True)
    model = transformers.Qwen2ForCausalLM(config)
    skeleton = weightless_copy(model)
    assert all(p.device.type == "meta" for p in skeleton.parameters())
    assert [n for n, _ in skeleton.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(p.requires_grad == q.requires_grad for p, q in zip(skeleton.parameters(), model.parameters()))
    assert skeleton.lm_head.weight is skeleton.model.embed_tokens.weight
    for (name, buffer), (_, original) in zip(skeleton.named_buffers(), model.named_buffers()):
        assert buffer.device.type == "cpu" and torch.equal(buffer, original), name
        assert buffer.data_ptr() != original.data_ptr(), f"{name} must be a copy"
    assert all(p.device.type == "cpu" for p in model.parameters()), "the original is untouched"
    assert skeleton.config is not model.config and skeleton.config.to_dict() == model.config.to_dict()
