"""old_logprobs_pass: the behaviour policy's log-probs, and sum_v pi(v)^2 only for an estimator that names it."""

from __future__ import annotations


import pytest
import torch

import rltk
from rltk.batch import collate
from rltk.models.logprobs import positions_from_mask
from rltk.training.step.forward import ForwardSettings, batched_logprobs, old_logprobs_pass
from rltk.training.step.estimator import Estimator, compute_advantages
from tests.training.rl_step_helpers import worker


SETTINGS = ForwardSettings(micro_batch_size=3, temperature=0.8)


def fill_old_logprobs(policy, batch, adv_fn, **kwargs):
    """The pass's tensors written into the batch, under the names the loop gives them."""
    batch["old_logprobs"], sum_pi_squared = old_logprobs_pass(
        policy, batch, SETTINGS, with_sum_pi_squared=Estimator.of(adv_fn).names("sum_pi_squared"), **kwargs)
    if sum_pi_squared is not None:
        batch["sum_pi_squared"] = sum_pi_squared


def _batch():
    batch = collate(worker.local_experiences(0, 0, 1)[:5], pad_token_id=0)
    batch["rollout_logprobs"] = torch.full_like(batch["rollout_logprobs"], -1.5) * batch["response_mask"]
    return batch


class _NoForward(torch.nn.Module):
    def forward(self, *args, logits_to_keep=None, **kwargs):
        raise AssertionError("no forward pass was needed")


def test_only_an_estimator_that_names_the_field_asks_for_it():
    def asks(name):
        return Estimator.of(rltk.get_component("advantage_fn", name)).names("sum_pi_squared")

    assert asks("optimal_token_baseline")
    assert not asks("grpo") and not asks("gdpo")


def test_sum_pi_squared_is_that_of_the_logits_at_the_sampling_temperature():
    policy = worker.shared.tiny_qwen2(seed=0)
    batch = _batch()
    fill_old_logprobs(policy, batch, rltk.get_component("advantage_fn", "optimal_token_baseline"),
                      use_rollout_logprobs=False)
    T = batch["response_mask"].shape[1]
    with torch.no_grad():
        logits = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        position_ids=positions_from_mask(batch["attention_mask"])).logits[:, -(T + 1) : -1]
    by_hand = (logits.double() / 0.8).softmax(-1).square().sum(-1)
    valid = batch["attention_mask"][:, -T:].bool()
    assert batch["sum_pi_squared"].shape == batch["response_mask"].shape
    torch.testing.assert_close(batch["sum_pi_squared"].double(), torch.where(valid, by_hand, 0.0), atol=1e-6,
                               rtol=1e-5)
    expected_old, _ = batched_logprobs(policy, batch, SETTINGS)
    torch.testing.assert_close(batch["old_logprobs"], expected_old, atol=0, rtol=0)
    # the estimator runs on what the pass filled
    compute_advantages(rltk.get_component("advantage_fn", "optimal_token_baseline"), batch, {})
    assert torch.isfinite(batch["advantages"]).all()


def test_other_estimators_get_no_extra_field():
    batch = _batch()
    fill_old_logprobs(worker.shared.tiny_qwen2(seed=0), batch, rltk.get_component("advantage_fn", "grpo"),
                      use_rollout_logprobs=False)
    assert "sum_pi_squared" not in batch and batch["old_logprobs"].shape == batch["response_mask"].shape


def test_rollout_logprobs_as_old_with_and_without_the_statistic():
    batch = _batch()
    fill_old_logprobs(_NoForward(), batch, rltk.get_component("advantage_fn", "grpo"), use_rollout_logprobs=True)
    assert batch["old_logprobs"] is batch["rollout_logprobs"] and "sum_pi_squared" not in batch
    # The engine reports no distribution: the policy still gives sum_pi_squared, the old log-probs
    # stay the engine's.
    batch = _batch()
    policy = worker.shared.tiny_qwen2(seed=0)
    fill_old_logprobs(policy, batch, rltk.get_component("advantage_fn", "optimal_token_baseline"),
                      use_rollout_logprobs=True)
    assert batch["old_logprobs"] is batch["rollout_logprobs"]
    *_, expected = batched_logprobs(policy, batch, SETTINGS, with_sum_pi_squared=True)
    torch.testing.assert_close(batch["sum_pi_squared"], expected, atol=0, rtol=0)
    with pytest.raises(AssertionError, match="no forward"):
        fill_old_logprobs(_NoForward(), _batch(), rltk.get_component("advantage_fn", "optimal_token_baseline"),
                          use_rollout_logprobs=True)
