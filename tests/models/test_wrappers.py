"""unwrap_model: one walk through training's wrappers, and what each caller needs of a peft model."""

from __future__ import annotations

import torch
from torch import nn

from rltk.models.lora import apply_lora
from rltk.models.tiny import build_char_tokenizer, build_tiny_model
from rltk.models.wrappers import unwrap_model


class ForwardingEngine(nn.Module):
    """Shaped like DeepSpeed's engine: holds ``.module`` and forwards unknown attributes to it."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)


class Holder(nn.Module):
    """Shaped like DDP: holds ``.module``, forwards nothing."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def tiny(seed: int = 0):
    return build_tiny_model(build_char_tokenizer(), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=64, seed=seed)


def test_wrappers_come_off_whichever_way_they_nest():
    model = tiny()
    wrapped = Holder(ForwardingEngine(model))
    assert hasattr(wrapped.module, "get_output_embeddings")  # forwarded, yet a wrapper
    assert unwrap_model(wrapped) is model
    assert unwrap_model(wrapped, through_peft=False) is model
    assert unwrap_model(model) is model


def test_a_causal_lm_with_a_submodule_named_module_is_not_a_wrapper():
    model = tiny()
    model.module = nn.Linear(2, 2)  # its class has get_output_embeddings: the walk stops at it
    assert unwrap_model(model) is model


def test_peft_is_seen_through_for_the_forwards_and_kept_whole_for_the_engines():
    peft_model = apply_lora(tiny(), {"r": 4, "alpha": 8.0, "target_modules": "all-linear"})
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.add_(0.1)  # adapters that change the output (lora_B starts at zero)
    wrapped = Holder(ForwardingEngine(peft_model))

    # log-prob and critic forwards, the guard: the base model, whose own forward runs the adapter layers
    base = unwrap_model(wrapped)
    assert base is peft_model.get_base_model()
    assert any("lora_A" in name for name, _ in base.named_modules())
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(base(input_ids=ids).logits, peft_model(input_ids=ids).logits, atol=0, rtol=0)

    # rollout engines: the PeftModel itself, with peft's state-dict names (the vLLM engine maps those
    # to the plain architecture and takes the adapters' scalings from it)
    kept = unwrap_model(wrapped, through_peft=False)
    assert kept is peft_model
    assert all(name.startswith("base_model.model.") for name in kept.state_dict())
    assert hasattr(kept, "generate")
