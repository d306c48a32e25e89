"""Per-token policy versions of an asynchronous run, below the servers: reading vLLM's version spans, moving
the workflow's record into the queue, the names a server loads the trainer's weights file under, and the
producer's weights follower (direct load, and the fallback through its module)."""

from __future__ import annotations

import types

import pytest
import torch

from rltk.batch import Experience
from rltk.rollout.base import POLICY_VERSIONS, Completion, RolloutEngine
from rltk.rollout.vllm_server import VLLMServerEngine, _choice_tokens, _savable_names, token_versions
from rltk.training.rollouts.engine_weights import weights_file_version, write_weights_file
from rltk.training.rollouts.asynchronous.producer import WeightsFollower, experience_versions
from tests.rollout.conftest import build_model


def test_version_spans_become_one_version_per_token():
    # vLLM's weight_versions: contiguous [start, end) spans of output tokens, labelled with the version string
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert token_versions(spans, 5, default=0) == [3, 3, 4, 4, 4]
    # a label rltk never set ("default": a server not yet loaded by rltk) and tokens no span covers: the
    # version the request was sent under
    assert token_versions([{"version": "default", "start": 0, "end": 2}], 3, default=7) == [7, 7, 7]
    assert token_versions(None, 2, default=1) == [1, 1]


def test_an_answers_choice_gives_tokens_logprobs_and_versions():
    choice = {"token_ids": [5, 6], "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -1.25}]},
              "weight_versions": [{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 2}]}
    assert _choice_tokens(choice, 0) == ([5, 6], [-0.5, -1.25], [2, 3])
    with pytest.raises(Exception, match="1 log-probs for 2 tokens"):
        _choice_tokens({**choice, "logprobs": {"content": [{"logprob": -0.5}]}}, 0)


def test_a_completion_checks_its_versions_length():
    assert Completion(0, [1, 2], [-1.0, -1.0], "length", versions=[0, 1]).versions == [0, 1]
    with pytest.raises(ValueError, match="1 versions for 2 tokens"):
        Completion(0, [1, 2], [-1.0, -1.0], "length", versions=[0])


def test_the_workflows_record_moves_into_the_queue_and_the_rest_count_from_the_batch_start():
    recorded = Experience(prompt_ids=[1], response_ids=[4, 5, 6], score=1.0, group_id=0,
                          info={"prompt": "x", POLICY_VERSIONS: [2, 2, 3]})
    unrecorded = Experience(prompt_ids=[1], response_ids=[4, 5], score=0.0, group_id=0, info={"prompt": "y"})
    assert experience_versions([recorded, unrecorded], version=2) == [[2, 2, 3], [2, 2]]
    assert recorded.info == {"prompt": "x"}  # stored once, beside the experience, not inside it


def test_the_trainers_file_loads_as_is_with_the_tied_head_named_once():
    """safetensors' save_model keeps one name of tied tensors (lm_head.weight for a Qwen2): the server gets the
    other name as an alias; a file with names the model does not have (LoRA adapters) is not loadable as is."""
    model = build_model(50, seed=0)
    engine = types.SimpleNamespace(model=model)
    engine.server_weights = lambda weights: VLLMServerEngine.server_weights(engine, weights)
    names = set(model.state_dict())
    tied = {"lm_head.weight", "model.embed_tokens.weight"}
    assert _savable_names(model.state_dict())["lm_head.weight"] == ["model.embed_tokens.weight"]
    as_saved = names - {"model.embed_tokens.weight"}
    assert VLLMServerEngine._aliases(engine, as_saved) == {"model.embed_tokens.weight": "lm_head.weight"}
    assert VLLMServerEngine._aliases(engine, names) == {}
    assert VLLMServerEngine._aliases(engine, names - tied) is None  # neither name: nothing to alias
    assert VLLMServerEngine._aliases(engine, names | {"base_model.model.lora_A.weight"}) is None


class _ModuleEngine(RolloutEngine):
    """An engine that samples from the producer's module (as ``hf`` does): the follower loads into the module."""

    samples_from_module = True

    def generate(self, prompt_ids, params):
        raise AssertionError("the follower never generates")

    def update_weights(self, state_dict_or_model, *, version=None, interrupt=False):
        raise AssertionError("the module is the engine's: nothing to send")


class _ServerEngine(RolloutEngine):
    """Records what a vllm_server engine was asked to load; ``loadable`` False plays a LoRA policy's file."""

    loads_weight_files = True

    def generate(self, prompt_ids, params):
        raise AssertionError("the follower never generates")

    def __init__(self, loadable=True):
        self.loadable, self.calls, self.continued = loadable, [], 0

    def load_weights_file(self, path, version, *, interrupt=False):
        self.calls.append(("file", weights_file_version(path), version, interrupt, path))
        return self.loadable

    def update_weights(self, module, *, version=None, interrupt=False):
        self.calls.append(("module", version, interrupt, float(next(module.parameters()).detach().sum())))


def test_the_follower_has_the_servers_load_a_link_to_the_published_file(tmp_path):
    path = tmp_path / "policy.safetensors"
    trained = build_model(50, seed=1)
    write_weights_file(trained, path, 4)
    engine, policy = _ServerEngine(), build_model(50, seed=0)
    follower = WeightsFollower(engine, policy, path)
    assert engine.track_versions is True
    assert follower.follow() and follower.version == 4
    [(kind, file_version, version, interrupt, loaded)] = engine.calls
    # a hard link (the trainer may rename a newer file over the path meanwhile), removed afterwards
    assert (kind, file_version, version, interrupt) == ("file", 4, 4, False) and loaded != str(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy.safetensors"]
    assert not follower.follow()  # nothing newer
    write_weights_file(trained, path, 5)
    assert follower.follow(interrupt=True) and engine.calls[-1][:4] == ("file", 5, 5, True)
    assert follower.take_counters() == {"async/weight_loads_mid_batch": 0.0, "async/continued_samples": 0.0}


def test_a_file_the_servers_cannot_load_goes_through_the_producers_module(tmp_path):
    path = tmp_path / "policy.safetensors"
    trained = build_model(50, seed=1)
    write_weights_file(trained, path, 2)
    engine, policy = _ServerEngine(loadable=False), build_model(50, seed=0)
    assert WeightsFollower(engine, policy, path).follow(interrupt=True)
    want = float(next(trained.parameters()).detach().sum())
    assert engine.calls[-1] == ("module", 2, True, pytest.approx(want))


def test_the_hf_engine_samples_from_the_module_the_follower_loads(tmp_path):
    path = tmp_path / "policy.safetensors"
    trained, policy = build_model(50, seed=1), build_model(50, seed=0)
    write_weights_file(trained, path, 3)
    follower = WeightsFollower(_ModuleEngine(), policy, path)
    assert follower.follow() and follower.version == 3
    for a, b in zip(trained.parameters(), policy.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert follower.take_counters() == {}
    with follower.during_generation(poll_s=0.01):  # no servers to interrupt: nothing runs beside it
        pass
