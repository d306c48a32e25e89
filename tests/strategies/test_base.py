"""The shared strategy building blocks: LR schedule, settings validation, parameter groups, state by name."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from rltk.models.folders import load_full_state_into
from rltk.strategies.base import (
    OptimizerSettings,
    build_adamw,
    build_lr_scheduler,
    check_mixed_precision,
    load_optimizer_state_by_name,
    lr_multiplier,
    optimizer_state_by_name,
    weight_decay_groups,
)


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.norm = nn.LayerNorm(3)
        self.head = nn.Linear(3, 2)

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids)))


# ---------------------------------------------------------------- lr_multiplier


def test_linear_warmup_then_linear_decay_hand_computed():
    # warm-up (s+1)/2 for s < 2, then 1 - (s-2)/8
    expected = [0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125, 0.0]
    got = [lr_multiplier(s, total_steps=10, warmup_steps=2, schedule="linear") for s in range(11)]
    assert got == pytest.approx(expected, abs=1e-12)


def test_cosine_with_floor_hand_computed():
    # p = (s-2)/8; m + (1-m)(1+cos(pi p))/2 with m = 0.1
    assert lr_multiplier(2, total_steps=10, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1) == pytest.approx(1.0)
    assert lr_multiplier(6, total_steps=10, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1) == pytest.approx(0.55)
    assert lr_multiplier(10, total_steps=10, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1) == pytest.approx(0.1)
    # p = 2/8: 0.1 + 0.9 * (1 + cos(pi/4)) / 2 = 0.1 + 0.45 * 1.70710678 = 0.868198
    assert lr_multiplier(4, total_steps=10, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1) == pytest.approx(
        0.8681980515, abs=1e-9)


def test_constant_ignores_floor_and_has_warmup():
    got = [lr_multiplier(s, total_steps=5, warmup_steps=4, schedule="constant", min_lr_ratio=0.5) for s in range(6)]
    assert got == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 500), warmup_frac=st.floats(0, 1), schedule=st.sampled_from(["linear", "cosine"]),
       floor=st.floats(0, 1))
def test_decay_stays_between_floor_and_peak_and_never_rises(total, warmup_frac, schedule, floor):
    warmup = int(warmup_frac * total)
    values = [lr_multiplier(s, total_steps=total, warmup_steps=warmup, schedule=schedule, min_lr_ratio=floor)
              for s in range(warmup, total + 3)]
    assert all(floor - 1e-12 <= v <= 1.0 + 1e-12 for v in values)
    assert all(b <= a + 1e-12 for a, b in zip(values, values[1:]))
    assert values[0] == pytest.approx(1.0)


def test_lambda_scheduler_applies_the_multiplier_to_every_group():
    model = TinyNet()
    s = OptimizerSettings(lr=0.2, total_steps=10, warmup_steps=2, lr_schedule="linear", weight_decay=0.1)
    optimizer = build_adamw(model, s)
    scheduler = build_lr_scheduler(optimizer, s)
    seen = []
    for _ in range(4):
        decay_lr, no_decay_lr = (group["lr"] for group in optimizer.param_groups)
        assert decay_lr == no_decay_lr
        seen.append(decay_lr)
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.1, 0.2, 0.2, 0.175])


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"lr": 0.0}, "lr=0.0"),
        ({"lr": float("nan")}, "lr=nan"),
        ({"total_steps": 0}, "total_steps=0"),
        ({"total_steps": 2.5}, "total_steps=2.5"),
        ({"warmup_steps": 11}, "warmup_steps=11 is invalid; it must be an integer in [0, total_steps=10]"),
        ({"weight_decay": -0.1}, "weight_decay=-0.1"),
        ({"betas": (0.9,)}, "betas=(0.9,)"),
        ({"betas": (0.9, 1.0)}, "betas=(0.9, 1.0)"),
        ({"eps": 0}, "eps=0"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio=1.5"),
        ({"grad_clip": -1.0}, "grad_clip=-1.0"),
        ({"grad_clip": float("inf")}, "grad_clip=inf"),
    ],
)
def test_invalid_settings_name_the_argument_and_value(kwargs, fragment):
    with pytest.raises(ValueError) as info:
        OptimizerSettings(**{"lr": 1e-3, "total_steps": 10, **kwargs})
    assert fragment in str(info.value)


def test_unknown_schedule_suggests_the_closest_name():
    with pytest.raises(ValueError, match=r"unknown lr_schedule 'cosin'.*Did you mean: 'cosine'.*Valid: constant, "
                                         r"cosine, linear"):
        OptimizerSettings(lr=1e-3, total_steps=10, lr_schedule="cosin")


def test_grad_clip_none_or_zero_measures_without_clipping():
    assert OptimizerSettings(lr=1e-3, total_steps=1, grad_clip=None).clip_norm == math.inf
    assert OptimizerSettings(lr=1e-3, total_steps=1, grad_clip=0).clip_norm == math.inf
    assert OptimizerSettings(lr=1e-3, total_steps=1, grad_clip=0.5).clip_norm == 0.5


def test_mixed_precision_checks():
    cpu = torch.device("cpu")
    assert check_mixed_precision("no", cpu) is None
    assert check_mixed_precision("bf16", cpu) is torch.bfloat16
    with pytest.raises(ValueError, match="fp16' needs a CUDA device.*'bf16'"):
        check_mixed_precision("fp16", cpu)
    with pytest.raises(ValueError, match="unknown mixed_precision 'bf61'.*'bf16'"):
        check_mixed_precision("bf61", cpu)


# ---------------------------------------------------------------- parameter groups


def test_weight_decay_only_on_matrices_and_frozen_parameters_left_out():
    model = TinyNet()
    model.head.bias.requires_grad_(False)
    decay, no_decay = weight_decay_groups(model, 0.1)
    assert [p.shape for p in decay["params"]] == [torch.Size([5, 3]), torch.Size([2, 3])]
    assert decay["weight_decay"] == 0.1
    assert [p.shape for p in no_decay["params"]] == [torch.Size([3]), torch.Size([3])]  # LayerNorm gain, bias
    assert no_decay["weight_decay"] == 0.0


def test_model_without_trainable_parameters_is_refused():
    model = TinyNet().requires_grad_(False)
    with pytest.raises(ValueError, match="TinyNet\\) has no trainable parameters"):
        weight_decay_groups(model, 0.0)


# ---------------------------------------------------------------- state by name


def _trained(seed: int):
    torch.manual_seed(seed)
    model = TinyNet()
    s = OptimizerSettings(lr=0.1, total_steps=5, weight_decay=0.1)
    optimizer = build_adamw(model, s)
    for _ in range(2):
        model(torch.tensor([[0, 3, 4]])).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_optimizer_state_round_trips_by_name_into_a_fresh_optimizer():
    model, optimizer = _trained(0)
    saved = optimizer_state_by_name(optimizer, model)
    assert set(saved["state"]) == {"embed.weight", "norm.weight", "norm.bias", "head.weight", "head.bias"}
    assert saved["param_groups"][0]["params"] == ["embed.weight", "head.weight"]

    fresh_model = TinyNet()
    fresh_optimizer = build_adamw(fresh_model, OptimizerSettings(lr=0.1, total_steps=5, weight_decay=0.1))
    load_optimizer_state_by_name(fresh_optimizer, fresh_model, saved, "memory")
    for name, param in fresh_model.named_parameters():
        original = optimizer.state[dict(model.named_parameters())[name]]
        for key, value in fresh_optimizer.state[param].items():
            assert torch.equal(value, original[key]), (name, key)


def test_saving_optimizer_state_before_any_step_adds_no_state():
    # torch.distributed.checkpoint's helper would take a hidden zero-lr step and set Adam's step to 1.
    model = TinyNet()
    optimizer = build_adamw(model, OptimizerSettings(lr=0.1, total_steps=5))
    saved = optimizer_state_by_name(optimizer, model)
    assert saved["state"] == {} and len(optimizer.state) == 0


def test_optimizer_state_of_a_different_model_is_refused_with_the_first_difference():
    model, optimizer = _trained(0)
    saved = optimizer_state_by_name(optimizer, model)
    saved["param_groups"][0]["params"][1] = "lm_head.weight"
    fresh = TinyNet()
    fresh_optimizer = build_adamw(fresh, OptimizerSettings(lr=0.1, total_steps=5, weight_decay=0.1))
    with pytest.raises(ValueError, match="parameter 1 is 'head.weight' in the model but 'lm_head.weight' in the "
                                         "checkpoint"):
        load_optimizer_state_by_name(fresh_optimizer, fresh, saved, "ckpt/optimizer.pt")
    saved["param_groups"].pop()
    with pytest.raises(ValueError, match="'ckpt/optimizer.pt' has 1 parameter groups, the optimizer has 2"):
        load_optimizer_state_by_name(fresh_optimizer, fresh, saved, "ckpt/optimizer.pt")


class TiedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(4, 2)
        self.lm_head = nn.Linear(2, 4, bias=False)
        self.lm_head.weight = self.embed.weight


def test_full_state_load_accepts_a_tied_weight_stored_once_and_rejects_real_gaps():
    source = TiedNet()
    target = TiedNet()
    load_full_state_into(target, {"embed.weight": source.embed.weight.detach().clone()}, "ckpt")
    assert torch.equal(target.lm_head.weight, source.embed.weight)

    with pytest.raises(KeyError, match=r"missing \['norm.weight'.*unexpected \['extra'\]"):
        load_full_state_into(TinyNet(), {"embed.weight": torch.zeros(5, 3), "extra": torch.zeros(1)}, "ckpt")
    bad_shape = {k: v.clone() for k, v in TinyNet().state_dict().items()}
    bad_shape["head.weight"] = torch.zeros(4, 3)
    with pytest.raises(KeyError, match=r"head.weight: model \(2, 3\) vs checkpoint \(4, 3\)"):
        load_full_state_into(TinyNet(), bad_shape, "ckpt")


def test_adamw_is_fused_on_cpu_and_steps_like_torch_s_default_loop():
    # torch's CPU default is the per-parameter loop; build_adamw takes the fused kernel, which must give
    # the same weights (up to float rounding) after a few steps on the same gradients.
    from rltk.strategies.base import OptimizerSettings, adamw_implementation, build_adamw

    torch.manual_seed(0)
    fused_model, loop_model = nn.Linear(8, 4), nn.Linear(8, 4)
    loop_model.load_state_dict(fused_model.state_dict())
    settings = OptimizerSettings(lr=1e-2, total_steps=5, weight_decay=0.1)
    fused = build_adamw(fused_model, settings)
    loop = torch.optim.AdamW(weight_decay_groups(loop_model, 0.1), lr=1e-2, foreach=False)
    assert adamw_implementation(list(fused_model.parameters())) == {"fused": True}
    assert all(group["fused"] for group in fused.param_groups)
    for step in range(5):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        for model, optimizer in ((fused_model, fused), (loop_model, loop)):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
    for (name, a), b in zip(fused_model.named_parameters(), loop_model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_adamw_falls_back_to_foreach_where_torch_has_no_fused_kernel():
    from rltk.strategies.base import adamw_implementation

    assert adamw_implementation([]) == {}
    meta = torch.zeros(3, device="meta")  # no fused kernel for the meta device: the foreach loop
    assert adamw_implementation([meta]) == {"foreach": True}
