"""The on-policy update: old log-probs taken from the training forward instead of a pass before it.

With one epoch over one mini-batch, skipping the no-grad recompute must change nothing: the same losses,
metrics, gradients and weights as the path that recomputes, and the batch ends up with the same
``old_logprobs``.
"""

from __future__ import annotations


import pytest
import torch

import rltk
from rltk.batch import collate
from rltk.training.step.forward import ForwardSettings, batched_logprobs
from rltk.training.step.estimator import compute_advantages
from rltk.training.step.loss_components import LossComponents
from rltk.training.updates.rl import old_logprobs_from_update, policy_update
from tests.training.rl_step_helpers import one_process_strategy, worker


def _record_gradients(strategy) -> list[dict[str, torch.Tensor]]:
    """Wrap ``strategy.step`` so that each call first records every parameter's gradient."""
    seen: list[dict[str, torch.Tensor]] = []
    step = strategy.step

    def recording_step():
        seen.append({n: p.grad.detach().clone() for n, p in strategy.unwrap().named_parameters()
                     if p.grad is not None})
        return step()

    strategy.step = recording_step
    return seen


def _batch(rows: int):
    # 5 rows in micro-batches of 2: three micro-batches, the last one short, in shuffled order
    batch = collate(worker.local_experiences(0, 0, 1)[:rows], pad_token_id=0)
    compute_advantages(rltk.get_component("advantage_fn", "grpo"), batch, {})
    return batch


CASES = {
    "ppo_clip, token-mean": ("ppo_clip", "token-mean", None, 0.0, 0.0),
    "ppo_clip, seq-mean-token-mean": ("ppo_clip", "seq-mean-token-mean", None, 0.0, 0.0),
    "ppo_clip, seq-mean-token-sum-norm, entropy": ("ppo_clip", "seq-mean-token-sum-norm", None, 0.0, 0.01),
    "gspo": ("gspo", "seq-mean-token-mean", None, 0.0, 0.0),
    "cispo": ("cispo", "token-mean", None, 0.0, 0.0),
    "ppo_clip + k3_unbiased KL in the loss": ("ppo_clip", "token-mean", "k3_unbiased", 0.1, 0.0),
}


# how the update cuts its micro-batches: a token budget groups rows by length (not runs of the shuffled
# order), so the on-policy write-back must follow each micro-batch's own rows
LAYOUTS = {
    "rows": {},
    "token budget": {"max_tokens_per_micro_batch": 40},
    "token budget, packed": {"max_tokens_per_micro_batch": 40, "pack_sequences": True},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_taking_old_logprobs_from_the_training_forward_gives_the_recompute_path_s_update(case, layout):
    policy_loss, agg, kl_name, kl_coef, entropy_coef = CASES[case]
    loss = LossComponents(
        policy_loss=rltk.get_component("policy_loss", policy_loss), loss_agg=rltk.get_component("loss_agg", agg),
        loss_agg_args={"norm_constant": 8.0} if agg == "seq-mean-token-sum-norm" else {},
        kl_penalty=rltk.get_component("kl_penalty_fn", kl_name) if kl_name else None,
        kl_in="loss", entropy_coef=entropy_coef,
    )
    recompute, reuse = one_process_strategy(), one_process_strategy()
    grads_recompute, grads_reuse = _record_gradients(recompute), _record_gradients(reuse)
    with_old, without_old = _batch(5), _batch(5)
    with_old["old_logprobs"], _ = batched_logprobs(recompute.unwrap(), with_old, ForwardSettings(micro_batch_size=2))
    if kl_name:
        with_old["ref_logprobs"] = without_old["ref_logprobs"] = with_old["old_logprobs"] - 0.3
    settings = ForwardSettings(micro_batch_size=2, **LAYOUTS[layout])
    common = dict(kl_coef=kl_coef, mini_batches=1, ppo_epochs=1)
    metrics_recompute, _ = policy_update(recompute, with_old, loss, settings, **common,
                                         generator=torch.Generator().manual_seed(3))
    metrics_reuse, taken_old = policy_update(reuse, without_old, loss, settings, **common,
                                             generator=torch.Generator().manual_seed(3))

    # the update hands back the old log-probs, row for row those of the recompute (rows were shuffled)
    assert "old_logprobs" not in without_old  # and writes nothing into the batch
    torch.testing.assert_close(taken_old, with_old["old_logprobs"], atol=1e-6, rtol=0)
    assert set(metrics_reuse) == set(metrics_recompute)
    for name, value in metrics_recompute.items():
        assert metrics_reuse[name] == pytest.approx(value, abs=1e-6), name
    assert len(grads_reuse) == len(grads_recompute) == 1
    assert set(grads_reuse[0]) == set(grads_recompute[0])
    for name, grad in grads_recompute[0].items():
        torch.testing.assert_close(grads_reuse[0][name], grad, atol=1e-7, rtol=1e-5, msg=name)
    for name, value in recompute.full_state_dict().items():
        torch.testing.assert_close(reuse.full_state_dict()[name], value, atol=1e-6, rtol=0, msg=name)


def test_on_policy_the_ratio_is_one_so_nothing_is_clipped():
    # pi_old = pi_theta.detach(): ratio 1 on every token, so the PPO clip never binds and the policy loss
    # is -agg(A) (token-mean of the advantages over response tokens), a number read off the batch.
    strategy = one_process_strategy()
    batch = _batch(4)
    loss = LossComponents(policy_loss=rltk.get_component("policy_loss", "ppo_clip"),
                          loss_agg=rltk.get_component("loss_agg", "token-mean"))
    metrics, _ = policy_update(strategy, batch, loss, ForwardSettings(micro_batch_size=2), kl_coef=0.0,
                               mini_batches=1, ppo_epochs=1)
    mask = batch["response_mask"]
    expected = -float((batch["advantages"] * mask).sum() / mask.sum())
    assert metrics["pg_loss"] == pytest.approx(expected, abs=1e-6)
    assert metrics["clip_frac"] == 0.0
    assert metrics["ratio_mean"] == 1.0  # exactly: exp(x - x) on every token
    assert metrics["approx_kl"] == 0.0


@pytest.mark.parametrize("ppo_epochs, mini_batches", [(2, 1), (1, 2)])
def test_a_batch_without_old_logprobs_is_refused_off_policy(ppo_epochs, mini_batches):
    strategy = one_process_strategy()
    loss = LossComponents(policy_loss=rltk.get_component("policy_loss", "ppo_clip"),
                          loss_agg=rltk.get_component("loss_agg", "token-mean"))
    with pytest.raises(ValueError, match=rf"needs trainer.ppo_epochs=1 and trainer.mini_batches=1 "
                                         rf"\(got {ppo_epochs} and {mini_batches}\)"):
        policy_update(strategy, _batch(4), loss, ForwardSettings(micro_batch_size=2), kl_coef=0.0,
                      mini_batches=mini_batches, ppo_epochs=ppo_epochs)


def _decide(advantage="grpo", *, correction=None, log_metrics=False, kl_in="loss", **overrides):
    loss = LossComponents(policy_loss=rltk.get_component("policy_loss", "ppo_clip"),
                          loss_agg=rltk.get_component("loss_agg", "token-mean"), kl_in=kl_in,
                          rollout_correction=correction or {}, log_mismatch_metrics=log_metrics)
    args = {"ppo_epochs": 1, "mini_batches": 1, "use_rollout_logprobs": False, "kl_coef": 0.0, **overrides}
    return old_logprobs_from_update(loss, rltk.get_component("advantage_fn", advantage), **args)


def test_the_recompute_is_skipped_only_when_nothing_needs_old_logprobs_before_the_update():
    assert _decide() is True
    assert _decide(kl_coef=0.05) is True  # the KL loss term and its metric can take them after the update
    assert _decide(ppo_epochs=2) is False  # the second epoch trains a policy that has moved
    assert _decide(mini_batches=2) is False
    assert _decide(use_rollout_logprobs=True) is False  # the engine's log-probs are the old ones
    assert _decide(kl_coef=0.05, kl_in="reward") is False  # the penalty enters the rewards before advantages
    assert _decide(kl_coef=0.0, kl_in="reward") is True  # no penalty, no reference
    assert _decide("optimal_token_baseline") is False  # sum_pi_squared comes from the old-log-prob pass
    assert _decide(log_metrics=True) is False  # mismatch metrics compare old and rollout log-probs first
    assert _decide(correction={"tis": "token"}) is False


def test_an_estimator_that_names_old_logprobs_keeps_the_recompute():
    def uses_old(token_rewards, response_mask, old_logprobs):
        """Advantages that read old_logprobs."""
        return token_rewards, token_rewards

    loss = LossComponents(policy_loss=rltk.get_component("policy_loss", "ppo_clip"),
                          loss_agg=rltk.get_component("loss_agg", "token-mean"))
    assert old_logprobs_from_update(loss, uses_old, ppo_epochs=1, mini_batches=1, use_rollout_logprobs=False,
                                    kl_coef=0.0) is False
