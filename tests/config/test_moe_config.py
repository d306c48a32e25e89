"""Bad MoE settings exit 2 naming the key, before anything is built (rltk.config.moe_checks)."""

from __future__ import annotations

import json

import pytest

from rltk.commands.cli import main

MOE = "model.tiny.moe.num_experts=8"


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.routing_replay=rollout"], "algorithm.routing_replay=rollout needs a mixture-of-experts policy, but "
                                           "the policy is the tiny model with model.tiny.moe.num_experts=0"),
    (["algorithm.router_aux_loss_coef=0.01"], "algorithm.router_aux_loss_coef=0.01 needs a mixture-of-experts"),
    (["algorithm.routing_replay=r3", MOE, "rollout.engine=vllm"],
     "rollout engine 'vllm' (rollout.engine) does not return the experts each token was routed to. Engines that do: hf"),
    (["algorithm.routing_replay=rollout", MOE, "rollout.workflow=multi_turn"], "rollout.workflow='multi_turn'"),
    (["algorithm.routing_replay=rollout", MOE, "model.gradient_checkpointing=true"], "model.gradient_checkpointing"),
    (["algorithm.routing_replay=replay"], "bad value 'replay' for 'algorithm.routing_replay'"),
    (["algorithm.router_aux_loss_coef=-1", MOE], "'algorithm.router_aux_loss_coef': a weight >= 0"),
])
def test_bad_moe_settings_exit_2_naming_the_key(tmp_path, capsys, overrides, message):
    # `run`, not only `validate`: the check comes before the model, data or run folder are built
    assert main(["run", "grpo", f"output_dir={tmp_path / 'run'}", *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_a_model_folder_is_judged_by_its_config(tmp_path, capsys):
    from omegaconf import OmegaConf

    from rltk.config.moe_checks import policy_is_moe

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    assert main(["validate", "grpo", f"model.path={folder}", "algorithm.routing_replay=rollout"]) == 2
    assert f"the policy is model.path='{folder}' (qwen2, 0 experts), a dense model" in capsys.readouterr().err
    cfg = OmegaConf.create({"model": {"path": str(folder)}})
    for config, moe in (({"model_type": "qwen3_moe", "num_experts": 128}, True),
                        ({"model_type": "mixtral", "num_local_experts": 8}, True),
                        ({"model_type": "deepseek_v3", "n_routed_experts": 256}, True),
                        ({"model_type": "qwen2_moe", "num_experts": 0}, False)):
        (folder / "config.json").write_text(json.dumps(config))
        assert policy_is_moe(cfg)[0] is moe


def test_the_moe_default_validates(capsys):
    assert main(["validate", "grpo", MOE, "algorithm.routing_replay=rollout", "algorithm.router_aux_loss_coef=0.01"]) == 0


EP = "strategy_args.expert_parallel_size"


@pytest.mark.parametrize("overrides, message", [
    ([f"{EP}=2"], f"{EP}=2: the policy is the tiny model with model.tiny.moe.num_experts=0, a dense model"),
    ([f"{EP}=3", MOE], f"{EP}=3 does not divide the 8 experts per layer"),
    ([f"{EP}=2", MOE, "strategy_args.fsdp=true"], f"{EP}=2 runs with strategy=accelerate and strategy_args.fsdp=false"),
    ([f"{EP}=2", MOE, "strategy=deepspeed"], f"{EP}=2 runs with strategy=accelerate and strategy_args.fsdp=false"),
    ([f"{EP}=0", MOE], f"bad value 0 for '{EP}'"),
])
def test_bad_expert_parallel_sizes_exit_2_naming_the_key(tmp_path, capsys, overrides, message):
    assert main(["run", "grpo", f"output_dir={tmp_path / 'run'}", *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_expert_parallel_must_divide_the_launched_processes(monkeypatch, capsys):
    assert main(["validate", "grpo", MOE, f"{EP}=2"]) == 0  # not launched yet: the process count is unknown
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(["validate", "grpo", MOE, f"{EP}=2"]) == 2
    assert f"{EP}=2 does not divide the 3 processes of this launch" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["validate", "grpo", MOE, f"{EP}=2"]) == 0
