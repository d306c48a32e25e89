"""A vision-language policy with what cannot run it exits 2 naming the key, before anything is built
(rltk.config.validation)."""

from __future__ import annotations

import json

import pytest

from rltk.commands.cli import main

VLM = "model.tiny.vision.depth=2"


@pytest.mark.parametrize("overrides, message", [
    ([VLM, "rollout.engine=vllm_server"], "bad value 'vllm_server' for 'rollout.engine' with a vision-language "
                                          "policy (the tiny VLM (model.tiny.vision.depth=2)): rltk passes images to "
                                          "hf, vllm only"),
    ([VLM, "model.tiny.moe.num_experts=8"], "the tiny VLM is a dense Qwen2.5-VL"),
    ([VLM, "model.tiny.vision.image_size=50"], "image_size a positive multiple of 28"),
    ([VLM, "trainer.pack_sequences=true"], "trainer.pack_sequences=true with a vision-language policy"),
    ([VLM, "strategy_args.tensor_parallel_size=2"],
     "strategy_args.tensor_parallel_size=2 with a vision-language policy (the tiny VLM (model.tiny.vision.depth=2)): "
     "a VLM is not tensor-parallel yet"),
])
def test_bad_vision_settings_exit_2_naming_the_key(tmp_path, capsys, overrides, message):
    assert main(["run", "grpo", f"output_dir={tmp_path / 'run'}", *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_the_vllm_engine_takes_a_vlm():
    from omegaconf import OmegaConf

    from rltk.config.schema import RunConfig
    from rltk.config.validation import check_vision_config

    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.from_dotlist([VLM, "rollout.engine=vllm"]))
    check_vision_config(cfg)  # no error: rltk.rollout.vllm_vision (tests/rollout/test_vllm_vision.py)


def test_a_model_folder_is_judged_by_its_config(tmp_path):
    from omegaconf import OmegaConf

    from rltk.config.validation import policy_is_vlm

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {"depth": 2}}))
    cfg = OmegaConf.create({"model": {"path": str(folder)}})
    assert policy_is_vlm(cfg) == (True, f"model.path='{folder}' (qwen2_5_vl)")
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert policy_is_vlm(cfg)[0] is False
