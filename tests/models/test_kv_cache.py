"""The KV-cache keyword on both sides of transformers 5.24's ``past_key_values`` -> ``cache`` rename,
and the faster paths that depend on it: they run on a plain model, with no deprecation warning, and
where they cannot run the reason is logged once."""

from __future__ import annotations

import functools
import logging
import warnings

import pytest
import torch
import transformers
from transformers.masking_utils import create_causal_mask

from rltk.models.activation_checkpointing import enable_activation_checkpointing
from rltk.models.kv_cache import cache_keyword
from rltk.models.logprobs import prompt_sharing_applies, prompt_sharing_blocker, shared_prompt_hidden_states
from rltk.rollout.hf_sampling import sampling_blocker

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, vocab_size=53, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def renamed(old: str, new: str):
    """A stand-in for transformers' ``deprecate_kwarg``: maps ``old`` onto ``new``, keeps the signature."""
    def wrap(fn):
        @functools.wraps(fn)
        def mapped(*args, **kwargs):
            if old in kwargs:
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)
        return mapped
    return wrap


def test_cache_keyword_reads_the_declared_name_on_either_side_of_the_rename():
    def before(input_ids, past_key_values=None, **kwargs): ...

    @renamed("past_key_values", "cache")
    def after(input_ids, cache=None, **kwargs): ...

    def neither(input_ids, **kwargs): ...

    assert cache_keyword(before) == "past_key_values"
    assert cache_keyword(after) == "cache"  # the wrapper's own signature would say (*args, **kwargs)
    assert cache_keyword(neither) is None
    assert cache_keyword(len) is None  # no Python signature


def test_the_installed_transformers_declares_one_of_the_two_names():
    # Fails the day a release renames the argument again: every fast path below would turn off.
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL))
    assert cache_keyword(model.forward) in ("cache", "past_key_values")
    assert cache_keyword(model.model.forward) == cache_keyword(model.forward)
    assert cache_keyword(create_causal_mask) == cache_keyword(model.forward)


@pytest.mark.parametrize("config_cls, model_cls", [(transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                                                   (transformers.LlamaConfig, transformers.LlamaForCausalLM)],
                         ids=["qwen2", "llama"])
def test_a_plain_model_shares_prompts_and_samples_with_the_engines_loop(config_cls, model_cls):
    model = model_cls(config_cls(**SMALL)).eval()
    assert prompt_sharing_blocker(model) is None
    assert sampling_blocker(model) is None


def test_the_shared_prompt_pass_sends_the_cache_under_the_declared_name():
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL)).eval()
    input_ids = torch.randint(3, 53, (4, 9))
    input_ids[2:, :5] = input_ids[:2, :5]  # rows 0/2 and 1/3 share a prompt of 5
    input_ids[1] = input_ids[0]
    input_ids[3, :5] = input_ids[0, :5]
    with warnings.catch_warnings():
        # transformers maps a renamed keyword with a FutureWarning: passing the old name would raise here
        warnings.simplefilter("error", FutureWarning)
        assert shared_prompt_hidden_states(model, input_ids, torch.ones_like(input_ids), 5) is not None


def test_prompt_sharing_that_cannot_run_says_why_once(caplog):
    from rltk import notices

    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL))
    enable_activation_checkpointing(model)
    notices._said.clear()
    with caplog.at_level(logging.WARNING, logger="rltk"):
        assert not prompt_sharing_applies(model)
        assert not prompt_sharing_applies(model)
    said = [r.getMessage() for r in caplog.records if "prompt" in r.getMessage()]
    assert said == ["rows that share a prompt run it in full: gradient checkpointing is on, "
                    "and transformers turns the KV cache off under it"]


def test_a_decoder_that_takes_no_cache_is_named_in_the_reason():
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL))

    class NoCacheDecoder(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False): ...

    model.model = NoCacheDecoder()
    assert "NoCacheDecoder.forward declares neither `cache`" in prompt_sharing_blocker(model)
