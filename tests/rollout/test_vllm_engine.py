"""The vLLM engine: its error paths and orchestration on CPU (with a stand-in vllm module), real runs on GPU."""

import copy
import dataclasses
import importlib.util
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import rltk
from rltk.rollout.base import SamplingParams
from rltk.rollout.vllm_engine import VLLMRolloutEngine, completions_from_outputs, vllm_request_kwargs


def test_registered_as_vllm_and_importable_without_vllm():
    assert rltk.get_component("rollout_engine", "vllm") is VLLMRolloutEngine


def test_missing_vllm_names_the_config_key_and_suggests_hf(monkeypatch, model, tokenizer):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError) as info:
        VLLMRolloutEngine(model, tokenizer)
    message = str(info.value)
    assert "rollout.engine=vllm" in message and "rollout.engine=hf" in message and "pip install" in message


def test_old_vllm_is_rejected(monkeypatch, model, tokenizer):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.6.3"))
    with pytest.raises(ImportError, match=r"needs vllm >= 0.8, found 0.6.3.*rollout.engine=hf"):
        VLLMRolloutEngine(model, tokenizer)


def test_no_cuda_names_the_config_key_and_suggests_hf(monkeypatch, model, tokenizer):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.10.2"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"rollout.engine=vllm needs a CUDA GPU.*rollout.engine=hf"):
        VLLMRolloutEngine(model, tokenizer)


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


@dataclasses.dataclass
class FakeEngineArgs:
    model: str = ""
    logprobs_mode: str = "raw_logprobs"


class FakeLLM:
    """Records what the engine does; generates ``prompt[-1] + 1, + 2, ...`` with log-prob -0.5 each."""

    instances = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.loaded = {}
        self.calls = []
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(model=SimpleNamespace(load_weights=self._load)))
        FakeLLM.instances.append(self)

    def _load(self, weights):
        self.loaded = dict(weights)
        return set(self.loaded)

    def collective_rpc(self, method, args=(), kwargs=None):
        self.calls.append("rpc")
        return [method(self.worker, *args, **(kwargs or {}))]

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


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.SimpleNamespace(__version__="0.10.2", LLM=FakeLLM, EngineArgs=FakeEngineArgs,
                                   SamplingParams=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    # Recorded first so that whatever the engine sets is undone after the test.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "unset")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    FakeLLM.instances = []
    return module


def test_builds_from_the_trainers_model_and_pushes_its_weights(fake_vllm, model, tokenizer):
    engine = VLLMRolloutEngine(model, tokenizer, gpu_memory_utilization=0.3, engine_kwargs={"max_num_seqs": 8})
    llm = FakeLLM.instances[-1]
    assert llm.kwargs["load_format"] == "dummy" and llm.kwargs["skip_tokenizer_init"] is True
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert llm.kwargs["gpu_memory_utilization"] == 0.3 and llm.kwargs["max_num_seqs"] == 8
    assert "distributed_executor_backend" not in llm.kwargs
    assert (Path(llm.kwargs["model"]) / "config.json").exists()  # config only; weights arrive by sync
    assert not list(Path(llm.kwargs["model"]).glob("*.safetensors"))
    assert set(llm.loaded) == set(model.state_dict())
    assert llm.calls == ["rpc", "reset_prefix_cache"]
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # engine core in this process

    VLLMRolloutEngine(model, tokenizer, model_path="/models/qwen", enable_prefix_caching=False)
    assert FakeLLM.instances[-1].kwargs["load_format"] == "auto"
    assert FakeLLM.instances[-1].kwargs["model"] == "/models/qwen"
    assert FakeLLM.instances[-1].calls == []  # weights come from the path


def test_external_launcher_under_torchrun(fake_vllm, monkeypatch, model, tokenizer):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    VLLMRolloutEngine(model, tokenizer, model_path="m", tensor_parallel_size=2, seed=10)
    assert FakeLLM.instances[-1].kwargs["distributed_executor_backend"] == "external_launcher"
    assert FakeLLM.instances[-1].kwargs["seed"] == 11  # ranks 2 and 3 form the second tensor-parallel group
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide.*WORLD_SIZE=4"):
        VLLMRolloutEngine(model, tokenizer, model_path="m", tensor_parallel_size=3)


def test_old_vllm_without_logprobs_mode_warns(fake_vllm, model, tokenizer):
    fake_vllm.EngineArgs = dataclasses.make_dataclass("OldEngineArgs", [("model", str, "")])
    with pytest.warns(UserWarning, match="temperature-1 log-probs"):
        engine = VLLMRolloutEngine(model, tokenizer, model_path="m")
    assert "logprobs_mode" not in FakeLLM.instances[-1].kwargs and not engine.logprobs_are_processed


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
    assert llm.calls == ["sleep1", "wake['weights']", "rpc", "reset_prefix_cache", "wake['kv_cache']", "generate"]
    with pytest.raises(TypeError, match="nn.Module or a state dict"):
        engine.update_weights("weights.safetensors")

    quiet = VLLMRolloutEngine(model, tokenizer, model_path="m", enable_sleep_mode=False)
    quiet.sleep()
    assert FakeLLM.instances[-1].calls == []


# ---------------------------------------------------------------------------
# Real vLLM on a GPU
# ---------------------------------------------------------------------------

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed (pip install 'rltk[vllm]' on a CUDA machine)")


def gpu_model(tokenizer, seed=0):
    # head size 32: a size every vLLM attention backend supports.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=256, max_position_embeddings=256,
                         initializer_range=0.3, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config).float().cuda()


@pytest.mark.gpu
@needs_vllm
def test_vllm_greedy_matches_hf_and_follows_weight_updates(tokenizer, encode):
    from rltk.rollout.hf import HFRolloutEngine

    model = gpu_model(tokenizer)
    engine = VLLMRolloutEngine(model, tokenizer, dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True)
    prompts = [encode(p) for p in ["12+3=", "7=", "abc de"]]
    params = SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=[])
    got = engine.generate(prompts, params)
    want = HFRolloutEngine(model, tokenizer).generate(prompts, params)
    for [g], [w] in zip(got, want):
        assert g.token_ids == w.token_ids and g.finish_reason == "length"
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-3)

    other = gpu_model(tokenizer, seed=1)
    engine.update_weights(other)
    want = HFRolloutEngine(other, tokenizer).generate(prompts, params)
    assert [g[0].token_ids for g in engine.generate(prompts, params)] == [w[0].token_ids for w in want]

    engine.sleep()
    engine.wake_up()
    assert [g[0].token_ids for g in engine.generate(prompts, params)] == [w[0].token_ids for w in want]


@pytest.mark.gpu
@needs_vllm
def test_vllm_sampled_logprobs_follow_the_filtered_distribution(tokenizer, encode):
    from .test_hf import reference_logprobs

    model = gpu_model(tokenizer)
    engine = VLLMRolloutEngine(model, tokenizer, dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True)
    if not engine.logprobs_are_processed:
        pytest.skip("this vllm has no logprobs_mode=processed_logprobs (needs >= 0.10.2)")
    prompt = encode("12+3=")
    params = SamplingParams(n=4, temperature=0.7, top_k=5, max_new_tokens=6, stop_token_ids=[], seed=0)
    cpu_model = copy.deepcopy(model).cpu()
    for completion in engine.generate([prompt], params)[0]:
        expected, _ = reference_logprobs(cpu_model, prompt, completion.token_ids, temperature=0.7, top_k=5)
        assert completion.logprobs == pytest.approx(expected.tolist(), abs=1e-3)
