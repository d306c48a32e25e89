import dataclasses

import pytest
import torch

from rltk.rollout.base import Completion, RolloutEngine, SamplingParams, cut_at_stop, validate_prompt_ids


def test_sampling_params_defaults():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_new_tokens) == (1, 1.0, 1.0, 0, 64)
    assert p.stop_token_ids is None and p.greedy is False and p.seed is None


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("n", 0, ">= 1"),
        ("n", 2.0, ">= 1"),
        ("n", True, ">= 1"),
        ("temperature", 0.0, "greedy=True"),
        ("temperature", -1.0, "> 0"),
        ("temperature", float("inf"), "finite"),
        ("temperature", "hot", "number"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_k", -1, "0 turns top-k off"),
        ("max_new_tokens", 0, ">= 1"),
        ("stop_token_ids", [1, -2], "bad: [-2]"),
        ("stop_token_ids", "eos", "list of token ids"),
        ("greedy", "yes", "true or false"),
        ("seed", 1.5, "integer or None"),
    ],
)
def test_sampling_params_errors_name_the_field_and_valid_range(field, value, fragment):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert f"SamplingParams.{field}" in str(info.value)
    if field in ("n", "temperature", "top_p", "top_k", "max_new_tokens"):
        assert f"(config key rollout.{field})" in str(info.value)
    assert fragment in str(info.value)


def test_sampling_params_normalises_types_and_replace_revalidates():
    p = SamplingParams(temperature=2, top_p=1, stop_token_ids=(3, 4))
    assert p.temperature == 2.0 and isinstance(p.temperature, float)
    assert p.stop_token_ids == [3, 4]
    greedy = dataclasses.replace(p, n=1, greedy=True)
    assert greedy.greedy and greedy.n == 1 and greedy.stop_token_ids == [3, 4]
    with pytest.raises(ValueError, match="SamplingParams.n"):
        dataclasses.replace(p, n=0)


def test_completion_checks_lengths_and_finish_reason():
    Completion(0, [5, 1], [-0.5, -0.1], "stop")
    with pytest.raises(ValueError, match="2 logprobs for 1 tokens"):
        Completion(0, [5], [-0.5, -0.1], "stop")
    with pytest.raises(ValueError, match="'stop', 'length'"):
        Completion(0, [5], [-0.5], "eos")


def test_cut_at_stop_keeps_the_first_stop_token_and_drops_padding():
    ids, lps, reason = cut_at_stop([7, 8, 1, 0, 0], [-1.0, -2.0, -3.0, 0.0, 0.0], [1, 9], max_new_tokens=5)
    assert (ids, lps, reason) == ([7, 8, 1], [-1.0, -2.0, -3.0], "stop")
    ids, lps, reason = cut_at_stop([7, 9, 1], [-1.0, -2.0, -3.0], [1, 9], max_new_tokens=3)
    assert (ids, reason) == ([7, 9], "stop")  # the earliest of several stop ids
    ids, lps, reason = cut_at_stop([7, 8, 6], [-1.0, -2.0, -3.0], [1], max_new_tokens=3)
    assert (ids, lps, reason) == ([7, 8, 6], [-1.0, -2.0, -3.0], "length")
    # A stop token beyond max_new_tokens does not count.
    ids, _, reason = cut_at_stop([7, 8, 1], [-1.0, -2.0, -3.0], [1], max_new_tokens=2)
    assert (ids, reason) == ([7, 8], "length")


def test_validate_prompt_ids():
    assert validate_prompt_ids([[1, 2], torch.tensor([3])]) == [[1, 2], [3]]
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] is empty"):
        validate_prompt_ids([[1], []])
    with pytest.raises(TypeError, match=r"prompt_ids\[0\] must be a list of token ids, got str"):
        validate_prompt_ids(["hello"])
    with pytest.raises(TypeError, match="non-negative integer"):
        validate_prompt_ids([[1, -3]])
    with pytest.raises(TypeError, match="one per prompt"):
        validate_prompt_ids("hello")


def test_rollout_engine_is_abstract_and_sleep_defaults_to_no_op():
    with pytest.raises(TypeError):
        RolloutEngine()

    class Echo(RolloutEngine):
        def generate(self, prompt_ids, params):
            return [[Completion(i, ids[:1], [0.0], "length")] * params.n for i, ids in enumerate(prompt_ids)]

        def update_weights(self, state_dict_or_model):
            pass

    engine = Echo()
    assert engine.sleep() is None and engine.wake_up() is None
    out = engine.generate([[4, 5], [6]], SamplingParams(n=2))
    assert [[c.token_ids for c in g] for g in out] == [[[4], [4]], [[6], [6]]]


def test_stop_tokens_come_from_the_request_then_the_tokenizer_then_the_model_config():
    from types import SimpleNamespace

    from rltk.rollout.base import stop_token_ids

    tokenizer, config = SimpleNamespace(eos_token_id=2), SimpleNamespace(eos_token_id=[7, 9])
    assert stop_token_ids(SamplingParams(stop_token_ids=[5]), tokenizer, config) == [5]
    assert stop_token_ids(SamplingParams(stop_token_ids=[]), tokenizer, config) == []  # asked for none
    assert stop_token_ids(SamplingParams(), tokenizer, config) == [2]
    assert stop_token_ids(SamplingParams(), None, config) == [7, 9]
    assert stop_token_ids(SamplingParams(), None, None) == []
