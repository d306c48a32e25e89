"""The vLLM engine with a LoRA policy: it receives merged weights under the plain model's names."""

import pytest
import torch

from rltk.models.lora import apply_lora, merged_copy
from rltk.rollout.vllm_engine import VLLMRolloutEngine, engine_weights
from tests.rollout.test_vllm_engine import FakeLLM, install_fake_vllm


def adapted(model, seed=1, r=4, alpha=8.0):
    model = apply_lora(model, {"r": r, "alpha": alpha, "target_modules": "all-linear"})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen).to(param.device) * 0.3)
    return model


def test_engine_weights_of_a_lora_model_are_the_merged_plain_weights(model):
    plain_names = set(model.state_dict())
    policy = adapted(model)
    expected = merged_copy(policy).state_dict()
    for source in (policy, policy.state_dict()):  # a module, or its full state dict (peft's names)
        weights = engine_weights(source, policy)
        assert set(weights) == plain_names  # no base_model.model. prefix, no .base_layer, no lora_* entries
        for name, tensor in expected.items():
            torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-6)
    # q_proj did change: the merge is not a pass-through of the base weights
    name = "model.layers.0.self_attn.q_proj.weight"
    assert (weights[name] - policy.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight).abs().max() > 1e-3
    with pytest.raises(ValueError, match="trainer's model"):
        engine_weights(policy.state_dict(), None)


def test_a_plain_model_passes_through_unchanged(model):
    weights = engine_weights(model)
    assert set(weights) == set(model.state_dict())
    assert all(weights[k].data_ptr() == v.data_ptr() for k, v in model.state_dict().items())  # no copies


@pytest.fixture
def fake_vllm(monkeypatch):
    return install_fake_vllm(monkeypatch)


def test_the_engine_is_built_from_the_base_config_and_gets_merged_weights_after_each_step(fake_vllm, model,
                                                                                          tokenizer):
    plain_names = set(model.state_dict())
    policy = adapted(model)
    engine = VLLMRolloutEngine(policy, tokenizer, lora_sync="merged")
    llm = FakeLLM.instances[-1]
    assert set(llm.loaded) == plain_names
    with torch.no_grad():  # an optimizer step on the adapter
        policy.get_base_model().model.layers[1].mlp.up_proj.lora_B["default"].weight.add_(1.0)
    engine.update_weights(policy)
    name = "model.layers.1.mlp.up_proj.weight"
    torch.testing.assert_close(llm.loaded[name], merged_copy(policy).state_dict()[name], rtol=0, atol=1e-6)
