"""strategy_args.tensor_parallel_size that cannot shard the model or the world exits 2 naming the key, before
anything is built (rltk.config.tensor_parallel_checks)."""

from __future__ import annotations

import json

import pytest

from rltk.commands.cli import main

TP = "strategy_args.tensor_parallel_size"


@pytest.mark.parametrize("overrides, message", [
    ([f"{TP}=3"], f"{TP}=3 does not divide num_attention_heads=4 of the tiny model (model.tiny)"),
    ([f"{TP}=4"], f"{TP}=4 does not divide num_key_value_heads=2 of the tiny model"),
    ([f"{TP}=2", "model.tiny.intermediate_size=255"], f"{TP}=2 does not divide intermediate_size=255"),
    ([f"{TP}=0"], f"{TP}: 0 is not a whole number of ranks >= 1"),
    # one process: the size does not fit the world (that DeepSpeed runs no TP: test_sequence_parallel.py)
    ([f"{TP}=2", "strategy=deepspeed"], f"{TP}=2 = 2 does not divide the 1 processes of the run"),
])
def test_a_size_that_does_not_divide_exits_2_naming_the_key(tmp_path, capsys, overrides, message):
    assert main(["run", "grpo", f"output_dir={tmp_path / 'run'}", *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_a_model_folders_vocabulary_and_the_launched_world_are_checked(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 151645}))
    assert main(["validate", "grpo", f"model.path={folder}", f"{TP}=2"]) == 2
    assert f"{TP}=2 does not divide vocab_size=151645 of model.path='{folder}' (qwen2)" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(["validate", "grpo", f"{TP}=2"]) == 2
    assert f"{TP}=2 does not divide the 3 processes of the run" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["validate", "grpo", f"{TP}=2"]) == 2
    assert "set strategy_args.fsdp=true" in capsys.readouterr().err
    # a size that fits passes (a run: tests/recipes/test_tensor_parallel_recipe.py)
    assert main(["validate", "grpo", f"{TP}=2", "strategy_args.fsdp=true"]) == 0


def test_a_recipe_with_a_critic_is_refused_naming_the_key(capsys):
    # the critic's value model has no vocabulary head to split; refused before anything is built
    assert main(["validate", "ppo", f"{TP}=2"]) == 2
    assert f"{TP}=2: the critic (a value model, no vocabulary head) is not tensor-parallel yet" in \
        capsys.readouterr().err


def test_lora_is_refused_naming_both_keys_and_why(capsys):
    assert main(["validate", "grpo", f"{TP}=2", "model.lora.r=8"]) == 2
    err = capsys.readouterr().err
    assert f"{TP}=2 with model.lora: LoRA adapters are not tensor-parallel" in err and "Traceback" not in err
    assert main(["validate", "grpo", f"{TP}=1", "model.lora.r=8"]) == 0
