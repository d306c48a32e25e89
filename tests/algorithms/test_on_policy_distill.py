"""on_policy_distill: minus the per-token reverse KL of the student's own samples (+ a task advantage)."""

import pytest
import torch

import rltk
from rltk.algorithms.advantages import on_policy_distill

OLD = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, -7.0]])
TEACHER = torch.tensor([[-0.5, -2.5, -0.5], [-1.0, -4.0, -9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # row 1's last column is padding
REWARDS = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])  # scores 1 and 0, one group
GROUPS = torch.tensor([0, 0])


def test_the_advantage_is_the_teachers_log_prob_minus_the_students():
    adv, returns = on_policy_distill(old_logprobs=OLD, teacher_logprobs=TEACHER, response_mask=MASK,
                                     token_rewards=REWARDS, group_ids=GROUPS)
    # -(log pi_old - log pi_T): the teacher likes token 0 of row 0 more (+0.5), token 1 less (-0.5);
    # the padding column gets 0 however far apart the two log-probs are there
    assert adv.tolist() == [[0.5, -0.5, 0.0], [2.0, -3.0, 0.0]]
    assert returns.tolist() == adv.tolist() and returns.data_ptr() != adv.data_ptr()
    assert adv.dtype == torch.float32


def test_task_coef_adds_the_rewards_group_advantage():
    # Dr. GRPO on scores 1 and 0: R - mean = +0.5 and -0.5 on every policy token; x task_coef 0.5 = +-0.25
    adv, _ = on_policy_distill(old_logprobs=OLD, teacher_logprobs=TEACHER, response_mask=MASK,
                               token_rewards=REWARDS, group_ids=GROUPS, task_coef=0.5, norm_by_std=False)
    assert adv.tolist() == [[0.75, -0.25, 0.25], [1.75, -3.25, 0.0]]
    # with the std: (R - mean) / (std + eps), std = sqrt(0.5) (Bessel): +-0.5 / sqrt(0.5) = +-0.7071, x 0.5
    adv, _ = on_policy_distill(old_logprobs=OLD, teacher_logprobs=TEACHER, response_mask=MASK,
                               token_rewards=REWARDS, group_ids=GROUPS, task_coef=0.5)
    assert adv[0, 0].item() == pytest.approx(0.5 + 0.5 * 0.5 ** 0.5, abs=1e-5)
    assert adv[1, 1].item() == pytest.approx(-3.0 - 0.5 * 0.5 ** 0.5, abs=1e-5)


def test_its_expected_policy_gradient_is_the_reverse_kl_gradient():
    # One position, a 7-token vocabulary: weighting each token's policy-loss gradient -A(y) grad log p(y) by
    # its probability p(y) (the expectation over the student's samples) gives exactly grad KL(p || q):
    # grad KL = sum_y p(y) (log p(y) - log q(y)) grad log p(y), since sum_y p(y) grad log p(y) = 0.
    logits = torch.randn(7, generator=torch.Generator().manual_seed(0), requires_grad=True)
    teacher = torch.log_softmax(torch.randn(7, generator=torch.Generator().manual_seed(1)), -1)
    logp = torch.log_softmax(logits, -1)
    V = logp.numel()
    adv, _ = on_policy_distill(old_logprobs=logp.detach()[:, None], teacher_logprobs=teacher[:, None],
                               response_mask=torch.ones(V, 1), token_rewards=torch.zeros(V, 1),
                               group_ids=torch.zeros(V, dtype=torch.int64))  # [V, 1]: one row per sampled token
    (policy_gradient,) = torch.autograd.grad(-(logp.exp().detach() * adv[:, 0] * logp).sum(), logits,
                                             retain_graph=True)
    (kl_gradient,) = torch.autograd.grad((logp.exp() * (logp - teacher)).sum(), logits)
    assert torch.allclose(policy_gradient, kl_gradient, atol=1e-6)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="task_coef must be a number >= 0"):
        on_policy_distill(old_logprobs=OLD, teacher_logprobs=TEACHER, response_mask=MASK, token_rewards=REWARDS,
                          group_ids=GROUPS, task_coef=-1.0)
    with pytest.raises(ValueError, match="teacher_logprobs has shape"):
        on_policy_distill(old_logprobs=OLD, teacher_logprobs=TEACHER[:, :2], response_mask=MASK,
                          token_rewards=REWARDS, group_ids=GROUPS)


def test_it_is_registered():
    assert rltk.get_component("advantage_fn", "on_policy_distill") is on_policy_distill
