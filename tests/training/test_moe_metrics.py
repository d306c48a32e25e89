"""The MoE step metrics (rltk.training.step.moe_metrics) and the load-balancing loss in the policy update."""

from __future__ import annotations

import pytest
import torch

import rltk
from rltk.models.moe import moe_routers
from rltk.models.tiny import build_char_tokenizer
from rltk.models.tiny import build_tiny_moe_model
from rltk.training.step.estimator import compute_advantages
from rltk.training.step.forward import ForwardSettings, batched_logprobs
from rltk.training.step.loss_components import LossComponents
from rltk.training.step.moe_metrics import moe_step_metrics
from rltk.training.updates.rl import policy_update
from tests.models.test_moe import routed_to_second_and_third, sampled_batch


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.mark.parametrize("pack, budget", [(False, None), (False, 40), (True, 40)],
                         ids=["padded", "token-budget-trimmed", "packed"])
def test_metrics_see_a_disagreeing_router_and_replay_closing_the_gap(tokenizer, pack, budget):
    # a token budget trims each micro-batch's all-padding columns, packing lays its tokens end to end: the
    # recorded routing must follow the tokens either way
    model = build_tiny_moe_model(tokenizer, seed=0)
    _, batch = sampled_batch(model, tokenizer, routed_to_second_and_third)
    settings = ForwardSettings(micro_batch_size=5, pack_sequences=pack, max_tokens_per_micro_batch=budget,
                               share_prompts=False)
    metrics = moe_step_metrics(model, batch, settings)
    assert metrics["moe/topk_mismatch"] == 1.0  # ranks 2-3 at rollout, 1-2 in the trainer, on every token
    assert metrics["moe/mismatch_kl_replay"] < 1e-9 < 1e-6 < metrics["moe/mismatch_kl_own_routing"]
    assert metrics["moe/logprob_gap_replay"] < 1e-5 < 1e-3 < metrics["moe/logprob_gap_own_routing"]
    assert 0 < metrics["moe/load_entropy"] <= 1 and 1 / 8 <= metrics["moe/load_max_share"] <= 1
    assert model.training  # handed back in the mode it came in


def test_metrics_of_a_rollout_that_routed_like_the_trainer(tokenizer):
    model = build_tiny_moe_model(tokenizer, seed=0)
    _, batch = sampled_batch(model, tokenizer)
    metrics = moe_step_metrics(model, batch, ForwardSettings(micro_batch_size=64, share_prompts=False))
    assert metrics["moe/topk_mismatch"] <= 0.02
    assert metrics["moe/logprob_gap_own_routing"] < 1e-5 and metrics["moe/logprob_gap_replay"] < 1e-5
    batch.pop("routed_experts")
    assert moe_step_metrics(model, batch, ForwardSettings(micro_batch_size=64)) == {}


def test_the_load_balancing_loss_is_an_opt_in_term_of_the_update(tokenizer):
    from rltk.strategies.accelerate_strategy import AccelerateStrategy

    def update(coef: float):
        strategy = AccelerateStrategy(cpu=True)
        strategy.setup(build_tiny_moe_model(tokenizer, seed=0), lr=1e-2, total_steps=10)
        _, batch = sampled_batch(strategy.unwrap(), tokenizer)
        batch["scores"] = torch.arange(len(batch["scores"]), dtype=torch.float32) % 2
        settings = ForwardSettings(micro_batch_size=6, share_prompts=False, routing_replay=True)
        batch["old_logprobs"], _ = batched_logprobs(strategy.unwrap(), batch, settings)
        compute_advantages(rltk.get_component("advantage_fn", "grpo"), batch, {})
        loss = LossComponents(policy_loss=rltk.get_component("policy_loss", "ppo_clip"),
                              loss_agg=rltk.get_component("loss_agg", "token-mean"), router_aux_loss_coef=coef)
        result = policy_update(strategy, batch, loss, settings, kl_coef=0.0, mini_batches=1, ppo_epochs=1)
        return result.metrics, [r.weight.detach().clone() for r in moe_routers(strategy.unwrap())]

    off, routers_off = update(0.0)
    on, routers_on = update(10.0)
    assert "router_aux_loss" not in off
    # k = 2 at perfect balance, up to E = 8 when every token takes the same experts
    assert 2.0 <= on["router_aux_loss"] <= 8.0
    assert on["pg_loss"] == pytest.approx(off["pg_loss"], abs=1e-6)  # same forward, same policy loss
    assert any(not torch.equal(a, b) for a, b in zip(routers_on, routers_off))  # the term moved the routers
