"""LoRA through peft: which parameters train, the adapter-free reference, adapter folders, merging, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from rltk.config.lora_checks import check_lora_fits_model, check_lora_values
from rltk.errors import ConfigError
from rltk.models.lora import adapter_mismatches, unmatched_targets
from rltk.config.schema import RunConfig
from rltk.models.logprobs import response_logprobs
from rltk.strategies.base import TrainingStrategy
from rltk.strategies.layout import ParallelLayout
from rltk.models.lora import (
    adapter_names,
    adapter_state_to_live,
    adapters_disabled,
    apply_lora,
    is_lora_model,
    lora_scalings,
    merge_lora_weights,
    merged_copy,
    save_adapter_folder,
)
from rltk.models.tiny import build_char_tokenizer, build_tiny_model, save_pretrained_dir

LINEAR_LEAVES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny(seed: int = 0, hidden_size: int = 32):
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=hidden_size, num_layers=2, num_heads=4, num_kv_heads=2,
                             intermediate_size=64, seed=seed)
    return tokenizer, model


def lora(model, r=4, alpha=8.0, targets="all-linear", **more):
    return apply_lora(model, {"r": r, "alpha": alpha, "dropout": 0.0, "target_modules": targets, **more})


def randomise_adapters(model, seed: int = 1) -> None:
    """peft starts B at 0 (the adapted model equals the base); give B values so the adapter matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)


def batch(seed: int = 0, rows: int = 3, length: int = 12):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 60, (rows, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    return ids, mask


# ---------------------------------------------------------------- which parameters train


def test_only_adapter_weights_train_and_weight_decay_groups_still_apply():
    from rltk.strategies.base import OptimizerSettings, build_adamw, weight_decay_groups

    _, model = tiny()
    model = lora(model, targets=["q_proj", "v_proj"])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    # 2 layers x 2 targets x (A, B)
    assert len(trainable) == 8 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all("q_proj" in n or "v_proj" in n for n in trainable)
    groups = weight_decay_groups(model, 0.1)
    # A [r, in] and B [out, r] are matrices: decayed; no bias or norm gain trains, so no second group
    assert [g["weight_decay"] for g in groups] == [0.1]
    assert {id(p) for p in groups[0]["params"]} == {id(p) for n, p in model.named_parameters() if n in trainable}
    optimizer = build_adamw(model, OptimizerSettings(lr=1e-3, total_steps=1, weight_decay=0.1))
    assert sum(len(g["params"]) for g in optimizer.param_groups) == 8


def test_adapted_model_equals_base_before_training_and_differs_after():
    _, base = tiny()
    _, model = tiny()
    model = lora(model)
    ids, mask = batch()
    same = response_logprobs(model, ids, mask, 5)[0]
    assert torch.equal(same, response_logprobs(base, ids, mask, 5)[0])  # B = 0 at the start
    randomise_adapters(model)
    assert (response_logprobs(model, ids, mask, 5)[0] - same).abs().max() > 1e-2


def test_lora_off_returns_the_model_itself():
    _, model = tiny()
    assert apply_lora(model, {"r": 0}) is model
    assert apply_lora(model, {"r": None, "path": None}) is model
    assert not is_lora_model(model)


# ---------------------------------------------------------------- the reference for free


def test_reference_logprobs_equal_a_separately_loaded_base_model(tmp_path):
    from rltk.models.loading import load_model
    from rltk.training.step.forward import ForwardSettings
    from rltk.training.step.reference import FrozenReference

    tokenizer, model = tiny(seed=3)
    folder = save_pretrained_dir(model, tokenizer, tmp_path / "base")
    policy = lora(load_model(folder), r=8)
    randomise_adapters(policy)

    class OneProcess:  # the strategy surface FrozenReference uses
        world_size = data_world_size = 1
        logprobs, layout = TrainingStrategy.logprobs, ParallelLayout()

        def unwrap(self):
            return policy

    reference = FrozenReference.for_stage(OneProcess(), kl_coef=0.1)
    assert reference.shares_policy  # no copy held
    ids, mask = batch(seed=5, rows=4, length=14)
    response = torch.ones(4, 6, dtype=torch.long)
    response[1, 4:] = 0
    data = {"input_ids": ids, "attention_mask": mask, "response_mask": response}
    ref = reference.logprobs(data, ForwardSettings(micro_batch_size=3))
    base = load_model(folder)  # loaded on its own: no peft anywhere
    expected = response_logprobs(base.eval(), ids, mask, 6)[0]
    assert ref.shape == (4, 6)
    torch.testing.assert_close(ref, expected, rtol=0, atol=1e-6)
    # the adapters are back on afterwards, and they do change the log-probs
    adapted = response_logprobs(policy.eval(), ids, mask, 6)[0]
    assert (adapted - expected).abs().max() > 1e-2
    # and the context restores them after an error too
    with pytest.raises(RuntimeError):
        with adapters_disabled(policy):
            raise RuntimeError("boom")
    torch.testing.assert_close(response_logprobs(policy, ids, mask, 6)[0], adapted, rtol=0, atol=0)


def test_reference_without_lora_is_a_frozen_copy():
    from rltk.training.step.forward import ForwardSettings
    from rltk.training.step.reference import FrozenReference

    _, model = tiny()

    class OneProcess:
        world_size = data_world_size = 1
        reference_model = TrainingStrategy.reference_model

        def unwrap(self):
            return model

        def full_model_copy(self):
            import copy

            return copy.deepcopy(model)

    assert FrozenReference.for_stage(OneProcess(), kl_coef=0.0) is None
    reference = FrozenReference.for_stage(OneProcess(), kl_coef=0.1)
    assert not reference.shares_policy and reference.copy is not model
    assert not any(p.requires_grad for p in reference.copy.parameters())


# ---------------------------------------------------------------- adapter folders


def test_adapter_folder_holds_only_the_adapter_and_loads_back_in_peft_and_rltk(tmp_path):
    from peft import PeftModel

    _, model = tiny(seed=2)
    model = lora(model, r=4, targets=["q_proj", "down_proj"])
    randomise_adapters(model)
    save_adapter_folder(model, model.state_dict(), tmp_path / "adapter")
    files = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(saved) == 8 and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in saved)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["down_proj", "q_proj"]

    ids, mask = batch()
    expected = response_logprobs(model, ids, mask, 5)[0]
    # peft reads it onto a fresh base
    _, fresh = tiny(seed=2)
    loaded = PeftModel.from_pretrained(fresh, str(tmp_path / "adapter"))
    torch.testing.assert_close(response_logprobs(loaded, ids, mask, 5)[0], expected, rtol=0, atol=0)
    # rltk's own loader (what a resumed checkpoint uses) maps peft's names back to the live ones
    from rltk.models.folders import load_full_state_into

    _, other = tiny(seed=2)
    other = lora(other, r=4, targets=["q_proj", "down_proj"])
    load_full_state_into(other, saved, tmp_path / "adapter")
    torch.testing.assert_close(response_logprobs(other, ids, mask, 5)[0], expected, rtol=0, atol=0)
    # and model.lora.path starts a run from it, trainable
    _, again = tiny(seed=2)
    again = apply_lora(again, {"path": str(tmp_path / "adapter")})
    assert any(p.requires_grad for p in again.parameters())
    torch.testing.assert_close(response_logprobs(again, ids, mask, 5)[0], expected, rtol=0, atol=0)


def test_adapter_names_drop_the_adapter_name_like_peft():
    _, model = tiny()
    model = lora(model, targets=["q_proj"])
    names = adapter_names(model)
    assert names["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] == \
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert len(names) == 4
    with pytest.raises(KeyError, match="missing"):
        adapter_state_to_live(model, {k: torch.zeros(1) for k in list(names)[:3]}, "somewhere")


# ---------------------------------------------------------------- merging (vLLM, export)


def test_merge_lora_weights_by_hand():
    # W0 = I, A = [[1, 2]], B = [[3], [4]], s = alpha / r = 0.5:
    # W = I + 0.5 * B A = [[1 + 1.5, 3], [2, 1 + 4]] = [[2.5, 3], [2, 5]]
    state = [
        ("base_model.model.embed.weight", torch.ones(3, 2)),
        ("base_model.model.layer.proj.base_layer.weight", torch.eye(2)),
        ("base_model.model.layer.proj.base_layer.bias", torch.tensor([0.5, -0.5])),
        ("base_model.model.layer.proj.lora_A.default.weight", torch.tensor([[1.0, 2.0]])),
        ("base_model.model.layer.proj.lora_B.default.weight", torch.tensor([[3.0], [4.0]])),
        ("base_model.model.layer.proj.lora_A.other.weight", torch.zeros(1, 2)),  # another adapter: dropped
    ]
    merged = dict(merge_lora_weights(state, {"base_model.model.layer.proj": 0.5}))
    assert sorted(merged) == ["embed.weight", "layer.proj.bias", "layer.proj.weight"]
    assert torch.equal(merged["layer.proj.weight"], torch.tensor([[2.5, 3.0], [2.0, 5.0]]))
    assert torch.equal(merged["layer.proj.bias"], torch.tensor([0.5, -0.5]))
    assert torch.equal(state[1][1], torch.eye(2))  # the input is not modified
    with pytest.raises(KeyError, match="layer.proj"):
        list(merge_lora_weights(state[:4], {"base_model.model.layer.proj": 0.5}))  # lora_B never came


def test_merging_a_peft_models_weights_matches_peft_merge_and_loads_into_the_plain_model():
    # what the vLLM engine receives from a LoRA policy (rltk.rollout.vllm_engine.engine_weights)
    _, model = tiny(seed=4)
    model = lora(model, r=4, alpha=12.0)
    randomise_adapters(model)
    assert set(lora_scalings(model).values()) == {3.0}  # alpha / r
    merged = dict(merge_lora_weights(model.state_dict().items(), lora_scalings(model)))
    plain = merged_copy(model)
    assert not is_lora_model(plain) and is_lora_model(model)  # the original keeps its adapters
    reference = plain.state_dict()
    assert set(merged) == set(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6)
    _, fresh = tiny(seed=0)  # another base, same shapes: every weight comes from the merge
    fresh.load_state_dict(merged, strict=True)
    ids, mask = batch()
    torch.testing.assert_close(response_logprobs(fresh, ids, mask, 5)[0], response_logprobs(model, ids, mask, 5)[0],
                               rtol=0, atol=1e-5)


def test_hf_engine_samples_from_the_adapted_model():
    from rltk.rollout.base import SamplingParams
    from rltk.rollout.hf import HFRolloutEngine

    tokenizer, model = tiny(seed=6)
    model = lora(model, r=8)
    randomise_adapters(model, seed=2)
    engine = HFRolloutEngine(model=model, tokenizer=tokenizer)
    engine.update_weights(model)  # the trainer's own module: nothing to copy
    prompts = [tokenizer("12+34=", add_special_tokens=False)["input_ids"]]
    params = SamplingParams(n=1, greedy=True, max_new_tokens=6)
    ours = engine.generate(prompts, params)[0][0].token_ids
    merged_engine = HFRolloutEngine(model=merged_copy(model), tokenizer=tokenizer)
    base_engine = HFRolloutEngine(model=tiny(seed=6)[1], tokenizer=tokenizer)
    assert ours == merged_engine.generate(prompts, params)[0][0].token_ids
    assert ours != base_engine.generate(prompts, params)[0][0].token_ids


# ---------------------------------------------------------------- bad input


def cfg_with(**lora_keys):
    cfg = OmegaConf.structured(RunConfig)
    cfg.model.tiny.hidden_size = 32
    for key, value in lora_keys.items():
        cfg.model.lora[key] = value
    return cfg


@pytest.mark.parametrize("r", [-1, -16])
def test_a_negative_rank_names_the_key(r):
    with pytest.raises(ConfigError, match=r"'model\.lora\.r'.*positive integer"):
        check_lora_values(cfg_with(r=r))
    with pytest.raises(ConfigError, match=r"'model\.lora\.r'.*positive integer"):
        apply_lora(tiny()[1], {"r": r})


def test_targets_that_match_nothing_list_the_linear_modules():
    with pytest.raises(ConfigError) as info:
        check_lora_fits_model(cfg_with(r=8, target_modules=["q_proj", "qkv_proj"]))
    message = str(info.value)
    assert "'model.lora.target_modules'" in message and "['qkv_proj']" in message
    for leaf in LINEAR_LEAVES:
        assert leaf in message
    assert "lm_head" not in message
    assert unmatched_targets(["q_proj", "layers.1.mlp.up_proj", "up"], ["model.layers.1.mlp.up_proj"]) == \
        ["q_proj", "up"]


@pytest.mark.parametrize("targets, message", [("q_proj", r"\[q_proj\]"), ([], "non-empty"), ([""], "non-empty")])
def test_target_modules_must_be_a_list_or_all_linear(targets, message):
    with pytest.raises(ConfigError, match=message):
        check_lora_values(cfg_with(r=8, target_modules=targets))


def test_alpha_and_dropout_are_checked():
    with pytest.raises(ConfigError, match=r"'model\.lora\.alpha'"):
        check_lora_values(cfg_with(r=8, alpha=0.0))
    with pytest.raises(ConfigError, match=r"'model\.lora\.dropout'"):
        check_lora_values(cfg_with(r=8, dropout=1.0))


def test_an_adapter_for_another_base_model_names_the_key_and_the_shapes(tmp_path):
    _, other = tiny(hidden_size=48)
    other = lora(other, r=4, targets=["q_proj"])
    save_adapter_folder(other, other.state_dict(), tmp_path / "adapter48")
    cfg = cfg_with(path=str(tmp_path / "adapter48"))  # the run's model has hidden_size 32
    check_lora_values(cfg)  # a well-formed folder
    with pytest.raises(ConfigError) as info:
        check_lora_fits_model(cfg)
    message = str(info.value)
    assert "'model.lora.path'" in message and "another base model" in message
    assert "model.layers.0.self_attn.q_proj is (in, out) = (32, 32) in the model but (48, 48) in the adapter" in message
    assert adapter_mismatches({"x.q": (4, 4)}, {"x.q": (4, 4)}) == []
    assert adapter_mismatches({"x.k": (4, 4)}, {"x.q": (4, 4)}) == ["x.k is not a linear module of the model"]


def test_a_folder_that_is_no_adapter_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"'model\.lora\.path'.*no such folder"):
        check_lora_values(cfg_with(path=str(tmp_path / "missing")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"'model\.lora\.path'.*not a peft adapter folder"):
        check_lora_values(cfg_with(path=str(tmp_path / "empty")))


@pytest.mark.parametrize("overrides, expected", [
    (["model.lora.r=-4"], "'model.lora.r'"),
    (["model.lora.r=1.5"], "'model.lora.r'"),  # the schema's int type refuses these
    (["model.lora.r=true"], "'model.lora.r'"),
    (["model.lora.r=8", "model.lora.target_modules=[qkv]"], "'model.lora.target_modules'"),
    (["model.lora.path=/nonexistent/adapter"], "'model.lora.path'"),
    (["stages=[{name: a, type: sft}, {name: b, type: rl, overrides: {model.lora.r: 8}}]"],
     "stages[1].overrides (stage 'b') sets 'model.lora.r'"),
])
def test_validate_and_run_exit_2_naming_the_key(overrides, expected, capsys, tmp_path):
    from rltk.commands.cli import main

    assert main(["validate", "grpo", *overrides]) == 2
    assert expected in capsys.readouterr().err
    assert main(["run", "grpo", f"output_dir={tmp_path / 'run'}", *overrides]) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()
