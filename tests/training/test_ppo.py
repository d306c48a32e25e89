"""Critic mechanics: batched values, the critic update, explained variance, one checkpoint for two models."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

import rltk
from rltk.algorithms.aggregation import token_mean
from rltk.batch import Experience, collate
from rltk.checkpoint import CheckpointManager
from rltk.config.loader import load_config
from rltk.errors import ConfigError
from rltk.models.critic import build_critic_from_policy, response_values
from rltk.strategies.accelerate_strategy import AccelerateStrategy
from rltk.training.step.forward import ForwardSettings
from rltk.training.updates.ppo import (
    CRITIC_SUBDIR,
    PolicyAndCritic,
    batched_values,
    check_critic_config,
    critic_update,
    explained_variance,
)

VOCAB = 61


def qwen2(seed: int = 0) -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )
    return transformers.Qwen2ForCausalLM(config)


def rollout_batch(returns_by_row: list[list[float]]) -> dict[str, torch.Tensor]:
    """Rows with prompts of 1-3 tokens and the given per-token returns; values start at 0."""
    experiences = [
        Experience(prompt_ids=[3 + i % 5] * (1 + i % 3), response_ids=[10 + i + t for t in range(len(r))],
                   score=0.0, group_id=i)
        for i, r in enumerate(returns_by_row)
    ]
    batch = collate(experiences, pad_token_id=0)
    returns = torch.zeros_like(batch["response_mask"])
    for i, r in enumerate(returns_by_row):
        returns[i, : len(r)] = torch.tensor(r)
    batch["returns"] = returns
    batch["values"] = torch.zeros_like(returns)
    return batch


RETURNS = [[1.0, 1.0, 1.0], [0.0, 0.0], [1.0, 0.5, 0.25, 0.0], [0.0], [1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]


def critic_strategy(lr: float = 1e-2, seed: int = 0, total_steps: int = 100) -> AccelerateStrategy:
    strategy = AccelerateStrategy(cpu=True)
    strategy.setup(build_critic_from_policy(qwen2(seed)), lr=lr, total_steps=total_steps, grad_clip=None)
    return strategy


def value_loss(critic, batch) -> float:
    T = batch["response_mask"].shape[1]
    with torch.no_grad():
        values = response_values(critic, batch["input_ids"], batch["attention_mask"], T)
    return token_mean(0.5 * (values - batch["returns"]).square(), batch["response_mask"]).item()


def test_first_value_loss_of_a_zero_head_is_half_the_mean_squared_return():
    strategy = critic_strategy()
    batch = rollout_batch(RETURNS)
    metrics, explained = critic_update(strategy, batch, ForwardSettings(micro_batch_size=2), loss_agg=token_mean,
                                       clip_range=0.2, mini_batches=1, ppo_epochs=1)
    # V = V_old = 0 before the step, so clipping is inactive and the loss is 0.5 * mean(R^2) over the 16 tokens:
    # 0.5 * (3 + 0 + 1 + 0.25 + 0.0625 + 0 + 0 + 2 + 0) / 16
    assert metrics["critic/vf_loss"] == pytest.approx(0.5 * 6.3125 / 16, rel=1e-6)
    assert metrics["critic/vf_clip_frac"] == 0.0 and metrics["critic/values_mean"] == 0.0
    assert metrics["critic/lr"] == pytest.approx(1e-2)
    # R - V = R, so nothing of the returns' variance is explained by a zero critic
    assert metrics["critic/explained_var"] == explained == pytest.approx(0.0, abs=1e-12)


def test_critic_update_fits_the_returns_of_a_fixed_batch():
    strategy = critic_strategy(lr=1e-2)
    batch = rollout_batch(RETURNS)
    generator = torch.Generator().manual_seed(0)
    before = value_loss(strategy.unwrap(), batch)
    for _ in range(20):
        batch["values"] = batched_values(strategy.unwrap(), batch, ForwardSettings(micro_batch_size=4))
        metrics = critic_update(strategy, batch, ForwardSettings(micro_batch_size=2), loss_agg=token_mean, clip_range=0.2,
                                mini_batches=2, ppo_epochs=2, generator=generator).metrics
    after = value_loss(strategy.unwrap(), batch)
    assert after < 0.2 * before, f"value loss {before:.4f} -> {after:.4f}"
    assert metrics["critic/explained_var"] > 0.5
    assert strategy.optimizer_steps == 20 * 2 * 2  # one step per mini-batch and epoch


def test_micro_batching_does_not_change_the_update():
    """Global normalisers: one micro-batch per sequence gives the gradient of the whole mini-batch."""
    batch = rollout_batch(RETURNS)
    batch["values"] = torch.where(batch["response_mask"] > 0, 0.3, 0.0)  # V_old != V: clipping is active
    params = []
    for micro_batch_size in (1, 6):
        strategy = critic_strategy(lr=1e-3)
        metrics = critic_update(strategy, batch, ForwardSettings(micro_batch_size=micro_batch_size),
                                loss_agg=token_mean, clip_range=0.2,
                                mini_batches=1, ppo_epochs=1).metrics
        params.append(torch.cat([p.detach().flatten() for p in strategy.unwrap().parameters()]))
        assert metrics["critic/vf_clip_frac"] > 0
    torch.testing.assert_close(params[0], params[1], rtol=1e-5, atol=1e-7)


def test_batched_values_match_response_values_and_keep_the_mode():
    critic = build_critic_from_policy(qwen2(), head_init_std=0.2)
    batch = rollout_batch(RETURNS)
    values = batched_values(critic, batch, ForwardSettings(micro_batch_size=4))
    assert critic.training  # restored
    critic.eval()
    with torch.no_grad():
        expected = response_values(critic, batch["input_ids"], batch["attention_mask"], 4)
    torch.testing.assert_close(values, expected)
    assert not values.requires_grad
    assert (values[batch["response_mask"] == 0] == 0).all()


def test_explained_variance_by_hand():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    returns = torch.tensor([[1.0, 2.0, 4.0, 99.0]])
    values = torch.tensor([[1.0, 2.0, 3.0, -99.0]])
    # Var(R) = 42/27, Var(R - V) = Var([0, 0, 1]) = 6/27 -> 1 - 6/42; the masked column is ignored
    assert explained_variance(values, returns, mask) == pytest.approx(1 - 6 / 42)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert math.isnan(explained_variance(values, returns, torch.zeros_like(mask)))


@settings(max_examples=50, deadline=None, derandomize=True, database=None)
@given(
    data=st.lists(st.tuples(st.floats(-5, 5), st.floats(-5, 5), st.booleans()), min_size=2, max_size=12),
    shift=st.floats(-10, 10),
)
def test_explained_variance_ignores_a_common_shift_and_masked_tokens(data, shift):
    values = torch.tensor([[v for v, _, _ in data]], dtype=torch.float64)
    returns = torch.tensor([[r for _, r, _ in data]], dtype=torch.float64)
    mask = torch.tensor([[float(m) for _, _, m in data]])
    ev = explained_variance(values, returns, mask)
    if mask.sum() == 0:
        assert math.isnan(ev)
        return
    if returns[mask > 0].var(unbiased=False) > 1e-6:  # away from the Var(R) floor
        assert explained_variance(values + shift, returns + shift, mask) == pytest.approx(ev, rel=1e-6, abs=1e-6)
    garbage = torch.where(mask > 0, values, 1e6)  # what sits on padding never counts
    assert explained_variance(garbage, returns, mask) == pytest.approx(ev, rel=1e-9, abs=1e-9)
    assert ev <= 1.0 + 1e-12  # explaining more than all of the variance is impossible


def test_critic_update_errors_name_the_problem():
    strategy = critic_strategy()
    batch = rollout_batch(RETURNS)
    with pytest.raises(ValueError, match="has 6 sequences, fewer than trainer.mini_batches=7"):
        critic_update(strategy, batch, ForwardSettings(micro_batch_size=2), loss_agg=token_mean, clip_range=0.2,
                      mini_batches=7, ppo_epochs=1)
    del batch["returns"]
    with pytest.raises(KeyError, match=r"lacks \['returns'\]"):
        critic_update(strategy, batch, ForwardSettings(micro_batch_size=2), loss_agg=token_mean, clip_range=0.2,
                      mini_batches=1, ppo_epochs=1)


def test_policy_and_critic_share_one_checkpoint_and_resume_exactly(tmp_path):
    batch = rollout_batch(RETURNS)

    def build():
        policy = AccelerateStrategy(cpu=True)
        policy.setup(qwen2(seed=1), lr=1e-3, total_steps=10)
        return PolicyAndCritic(policy, critic_strategy(lr=1e-2))

    def train_critic(pair, steps):
        for _ in range(steps):
            critic_update(pair.critic, batch, ForwardSettings(micro_batch_size=6), loss_agg=token_mean, clip_range=None,
                          mini_batches=1, ppo_epochs=1)

    straight = build()
    train_critic(straight, 2)
    ckpt = CheckpointManager(tmp_path / "checkpoints")
    path = ckpt.save(2, straight, {"stage_step": 2})
    assert (path / "model" / "model.safetensors").is_file()  # the policy where every checkpoint has it
    assert (path / CRITIC_SUBDIR / "model" / "value_model.json").is_file()
    assert (path / CRITIC_SUBDIR / "optimizer.pt").is_file()
    train_critic(straight, 1)

    resumed = build()  # fresh weights and optimizer, then restored
    assert ckpt.load(path, resumed) == {"stage_step": 2}
    assert resumed.critic.optimizer_steps == 2
    train_critic(resumed, 1)
    for a, b in zip(straight.critic.unwrap().parameters(), resumed.critic.unwrap().parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_checkpoint_without_critic_is_refused(tmp_path):
    policy = AccelerateStrategy(cpu=True)
    policy.setup(qwen2(), lr=1e-3, total_steps=10)
    path = CheckpointManager(tmp_path).save(1, policy, {})
    with pytest.raises(FileNotFoundError, match="no 'critic/' folder.*checkpoint.resume=never"):
        PolicyAndCritic(policy, critic_strategy()).load(path)


def test_ppo_preset_is_registered_with_gae_and_kl_in_the_reward():
    preset = rltk.get_component("algorithm", "ppo")
    assert preset["advantage_fn"] == "gae" and preset["advantage_fn_args"] == {"gamma": 1.0, "lam": 0.95}
    assert (preset["kl_penalty_fn"], preset["kl_in"], preset["policy_loss"]) == ("k1", "reward", "ppo_clip")
    cfg = load_config([], ["algorithm.name=ppo"])
    assert cfg.algorithm.advantage_fn == "gae" and cfg.algorithm.kl_coef == preset["kl_coef"] > 0


@pytest.mark.parametrize("override, key", [
    ("critic.warmup_steps=10", "critic.warmup_steps"),
    ("critic.lr=0", "critic.lr"),
    ("critic.value_clip=-0.1", "critic.value_clip"),
    ("trainer.warmup_steps=8", "trainer.warmup_steps"),
    ("critic.head_init_std=-1", "critic.head_init_std"),
])
def test_critic_config_errors_name_the_key(override, key):
    overrides = ["algorithm.name=ppo", "trainer.total_steps=10", "critic.warmup_steps=3", override]
    cfg = load_config([], overrides, validate=False)
    with pytest.raises(ConfigError, match=f"'{key}'"):
        check_critic_config(cfg)
    with pytest.raises(ConfigError, match=f"'{key}'"):  # `rltk validate` runs the same check
        load_config([], overrides)
    check_critic_config(load_config([], ["algorithm.name=ppo", "trainer.total_steps=10", "critic.warmup_steps=9"]))
    assert OmegaConf.select(cfg, "critic.model_path") is None
