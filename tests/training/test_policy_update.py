"""policy_update in one process: mini-batches of any rollout size, and the errors it gives."""

from __future__ import annotations

import math

import pytest
import torch

import rltk
from rltk.batch import collate, slice_batch
from rltk.training.step.forward import ForwardSettings, batched_logprobs
from rltk.training.step.estimator import compute_advantages
from rltk.training.step.loss_components import LossComponents
from rltk.training.updates.rl import policy_update
from tests.training.rl_step_helpers import one_process_strategy, worker


def _batch(strategy, rows: int):
    batch = collate(worker.local_experiences(0, 0, 1)[:rows], pad_token_id=0)
    batch["old_logprobs"], _ = batched_logprobs(strategy.unwrap(), batch, ForwardSettings(micro_batch_size=2))
    compute_advantages(rltk.get_component("advantage_fn", "grpo"), batch, {})
    return batch


LOSS = LossComponents(policy_loss=rltk.get_component("policy_loss", "ppo_clip"),
                      loss_agg=rltk.get_component("loss_agg", "token-mean"))


def test_a_batch_that_mini_batches_do_not_divide_is_cut_into_near_equal_parts():
    # A sample strategy that filters groups leaves any number of rows: 5 rows in 2 mini-batches are
    # one step on 3 rows, then one on 2, in the order the generator shuffles them.
    strategy, reference = one_process_strategy(), one_process_strategy()
    batch = _batch(strategy, rows=5)
    policy_update(strategy, batch, LOSS, ForwardSettings(micro_batch_size=2), kl_coef=0.0, mini_batches=2,
                  ppo_epochs=1, generator=torch.Generator().manual_seed(7))
    order = torch.randperm(5, generator=torch.Generator().manual_seed(7))
    parts = order.tensor_split(2)
    assert [len(p) for p in parts] == [3, 2]
    for part in parts:
        policy_update(reference, slice_batch(batch, part), LOSS, ForwardSettings(micro_batch_size=2), kl_coef=0.0,
                      mini_batches=1, ppo_epochs=1, generator=torch.Generator().manual_seed(0))
    assert strategy.optimizer_steps == reference.optimizer_steps == 2
    for name, value in reference.full_state_dict().items():
        torch.testing.assert_close(strategy.full_state_dict()[name], value, atol=1e-6, rtol=0, msg=name)


def test_fewer_rows_than_mini_batches_names_the_config_keys():
    strategy = one_process_strategy()
    batch = _batch(strategy, rows=3)
    with pytest.raises(ValueError, match=r"has 3 sequences, fewer than trainer.mini_batches=4"):
        policy_update(strategy, batch, LOSS, ForwardSettings(micro_batch_size=2), kl_coef=0.0, mini_batches=4,
                      ppo_epochs=1)


def test_the_k3_unbiased_loss_term_is_weighted_by_the_ratio_to_the_old_policy():
    # Tokens sampled by an older policy: old = current - 0.5, so pi / pi_old = e^0.5 on every token,
    # and ref = current - 0.3, so k3 = e^-0.3 + 0.3 - 1 on every token. The logged term is the token
    # mean of their product; a call without old_logprobs would take the ratio as 1.
    strategy = one_process_strategy()
    batch = _batch(strategy, rows=4)
    current, _ = batched_logprobs(strategy.unwrap(), batch, ForwardSettings(micro_batch_size=2))
    batch["old_logprobs"] = current - 0.5
    batch["ref_logprobs"] = current - 0.3
    loss = LossComponents(policy_loss=rltk.get_component("policy_loss", "ppo_clip"),
                          loss_agg=rltk.get_component("loss_agg", "token-mean"),
                          kl_penalty=rltk.get_component("kl_penalty_fn", "k3_unbiased"), kl_in="loss")
    metrics, _ = policy_update(strategy, batch, loss, ForwardSettings(micro_batch_size=2), kl_coef=0.1,
                               mini_batches=1, ppo_epochs=1)
    k3 = math.exp(-0.3) + 0.3 - 1
    assert metrics["kl_loss"] == pytest.approx(math.exp(0.5) * k3, rel=1e-4)

    # an estimator without the argument is called as before
    loss.kl_penalty = rltk.get_component("kl_penalty_fn", "k3")
    batch["old_logprobs"] = current  # the policy moved one step; ref stays 0.3 below the old log-probs
    metrics, _ = policy_update(strategy, batch, loss, ForwardSettings(micro_batch_size=2), kl_coef=0.1,
                               mini_batches=1, ppo_epochs=1)
    assert 0 < metrics["kl_loss"] < 1.0
