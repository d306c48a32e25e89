"""The value model: alignment of response values with rltk.batch, building from a policy, folders."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from torch import nn

from rltk.batch import Experience, collate
from rltk.models.critic import (
    VALUE_MODEL_FILE,
    ValueModel,
    build_critic_from_policy,
    load_value_model,
    response_values,
)
from rltk.models.logprobs import base_model

VOCAB = 61
SMALL = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, vocab_size=VOCAB, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


def qwen2(seed: int = 0) -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, tie_word_embeddings=True)).eval()


class PrefixSumBackbone(nn.Module):
    """A causal 'backbone' whose hidden state at s is [sum of real tokens up to s, position id of s].

    Values computed from it can be checked by hand: they reveal exactly which
    tokens a position has read and which position id it was given.
    """

    def forward(self, input_ids, attention_mask, position_ids, use_cache=False):
        real = input_ids.float() * attention_mask.float()
        return (torch.stack([real.cumsum(-1), position_ids.float()], dim=-1),)


def hand_checkable_critic() -> ValueModel:
    critic = ValueModel(PrefixSumBackbone(), hidden_size=2)
    with torch.no_grad():
        critic.value_head.weight.copy_(torch.tensor([[1.0, 100.0]]))  # V = prefix sum + 100 * position
    return critic


def two_row_batch():
    """Row 0: prompt [5, 6, 7], response [8, 9]; row 1: prompt [3], response [4, 2, 10]. P = 3, T = 3."""
    experiences = [
        Experience(prompt_ids=[5, 6, 7], response_ids=[8, 9], score=1.0, group_id=0),
        Experience(prompt_ids=[3], response_ids=[4, 2, 10], score=0.0, group_id=0),
    ]
    return collate(experiences, pad_token_id=0)


def test_response_values_are_the_states_before_each_response_token():
    batch = two_row_batch()
    # input_ids: [[5, 6, 7, 8, 9, 0], [0, 0, 3, 4, 2, 10]]
    values = response_values(hand_checkable_critic(), batch["input_ids"], batch["attention_mask"], 3)
    # Row 0, t=0: the state after the prompt (5+6+7=18) at position 2; t=1: read 8 too, position 3;
    # t=2 is response padding -> 0.
    # Row 1 (prompt left-padded by 2): t=0 read [3] at position 0; t=1 read 3+4 at position 1;
    # t=2 read 3+4+2 at position 2. The row's last token (10) is never read: no state follows it.
    assert values.tolist() == [[18.0 + 200.0, 26.0 + 300.0, 0.0], [3.0 + 0.0, 7.0 + 100.0, 9.0 + 200.0]]
    assert values.dtype == torch.float32


def test_response_values_of_a_real_model_ignore_padding():
    """Batched, padded values equal each row run alone without any padding."""
    critic = build_critic_from_policy(qwen2(), head_init_std=0.5).eval()
    experiences = [
        Experience(prompt_ids=[11, 12, 13, 14], response_ids=[20, 21], score=0.0, group_id=0),
        Experience(prompt_ids=[15], response_ids=[22, 23, 24, 25], score=0.0, group_id=1),
        Experience(prompt_ids=[16, 17], response_ids=[26], score=0.0, group_id=2),
    ]
    batch = collate(experiences, pad_token_id=0)
    T = batch["response_mask"].shape[1]
    with torch.no_grad():
        batched = response_values(critic, batch["input_ids"], batch["attention_mask"], T)
        for i, e in enumerate(experiences):
            ids = torch.tensor([e.prompt_ids + e.response_ids])
            alone = critic(ids, torch.ones_like(ids))[0]  # [S_i]
            p, t = len(e.prompt_ids), len(e.response_ids)
            torch.testing.assert_close(batched[i, :t], alone[p - 1 : p - 1 + t], rtol=1e-5, atol=1e-5)
            assert batched[i, t:].abs().sum() == 0  # response padding


def test_built_critic_copies_the_backbone_and_starts_at_zero():
    policy = qwen2()
    critic = build_critic_from_policy(policy)
    ids = torch.tensor([[4, 9, 16, 25, 36]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        assert critic(ids, mask).abs().max() == 0  # zero-initialised head: V = 0 everywhere
        expected_hidden = base_model(policy)(input_ids=ids, attention_mask=mask).last_hidden_state
        got_hidden = critic.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got_hidden, expected_hidden)
    # A copy, not a view: training the critic never moves the policy.
    policy_ptrs = {p.data_ptr() for p in policy.parameters()}
    assert not policy_ptrs & {p.data_ptr() for p in critic.parameters()}
    assert all(p.requires_grad for p in critic.parameters()) and critic.training
    assert critic.value_head.in_features == SMALL["hidden_size"]
    assert not any("lm_head" in name for name, _ in critic.named_parameters())


def test_value_gradient_reaches_the_backbone_once_the_head_is_nonzero():
    critic = build_critic_from_policy(qwen2(), head_init_std=0.1)
    ids = torch.tensor([[4, 9, 16, 25, 36]])
    critic(ids, torch.ones_like(ids)).sum().backward()
    assert critic.backbone.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0
    assert critic.value_head.bias.grad.item() == pytest.approx(5.0)  # dV/db = 1 per position


def test_save_and_load_round_trip(tmp_path):
    critic = build_critic_from_policy(qwen2(), head_init_std=0.3).eval()
    critic.save_pretrained(tmp_path / "critic")
    meta = json.loads((tmp_path / "critic" / VALUE_MODEL_FILE).read_text())
    assert meta["hidden_size"] == SMALL["hidden_size"] and meta["format"] == "rltk-value-model-v1"
    loaded = load_value_model(tmp_path / "critic").eval()
    ids = torch.tensor([[0, 0, 7, 8, 9], [3, 4, 5, 6, 7]])
    mask = (ids != 0).long()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, mask), critic(ids, mask))


def test_training_strategy_checkpoint_of_a_critic_is_a_loadable_folder(tmp_path):
    from rltk.strategies.accelerate_strategy import AccelerateStrategy

    critic = build_critic_from_policy(qwen2(), head_init_std=0.3)
    strategy = AccelerateStrategy(cpu=True)
    strategy.setup(critic, lr=1e-3, total_steps=2)
    strategy.save(tmp_path / "ckpt")
    loaded = load_value_model(tmp_path / "ckpt" / "model").eval()
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, torch.ones_like(ids)), critic.eval()(ids, torch.ones_like(ids)))


def test_load_from_a_causal_lm_folder_gives_its_backbone_and_a_fresh_head(tmp_path):
    policy = qwen2(seed=3)
    policy.save_pretrained(tmp_path / "lm")
    critic = load_value_model(tmp_path / "lm")
    assert critic.value_head.weight.abs().sum() == 0
    for name, tensor in base_model(policy).state_dict().items():
        torch.testing.assert_close(critic.backbone.state_dict()[name], tensor)


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="critic.model_path='.*missing'"):
        load_value_model(tmp_path / "missing")
    with pytest.raises(ValueError, match="hidden_size"):
        ValueModel(PrefixSumBackbone())
    with pytest.raises(ValueError, match="head_init_std=-1"):
        ValueModel(PrefixSumBackbone(), hidden_size=2, head_init_std=-1)
    with pytest.raises(ValueError, match="response_width=4 must be an int in \\[0, S=4\\)"):
        response_values(hand_checkable_critic(), torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4), 4)

    class Logits(nn.Module):  # a full causal LM returns [B, S, V] logits under another name, or [B, S]
        def forward(self, input_ids, **_):
            return input_ids.float()

    with pytest.raises(RuntimeError, match="decoder stack"):
        ValueModel(Logits(), hidden_size=2)(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2))


def test_value_head_runs_in_fp32_under_autocast():
    critic = build_critic_from_policy(qwen2(), head_init_std=0.3).eval()
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        reference = critic(ids, mask)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = critic(ids, mask)
    assert mixed.dtype == torch.float32
    # only the backbone ran in bf16 (8-bit mantissa): the values agree to bf16's precision
    torch.testing.assert_close(mixed, reference, rtol=0.05, atol=0.05)
