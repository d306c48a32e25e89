"""Token-budget micro-batches: the plan (rltk.training.step.micro_batches) and the exactness of the update under it."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

import rltk
from rltk.batch import Experience, collate
from rltk.training.step.micro_batches import micro_batch_count, micro_batches, plan_micro_batches
from rltk.training.updates.ppo import batched_values, critic_update
from rltk.training.step.forward import ForwardSettings, batched_logprobs
from rltk.training.step.loss_components import LossComponents
from rltk.training.updates.rl import policy_update


# ---------------------------------------------------------------- the plan


def test_padded_plan_by_hand():
    # totals 10, 9, 4, 3 (prompt 2 each); budget 20: [10, 9] costs 2 x 10 = 20, [4, 3] costs 2 x 4 = 8
    prompts, responses = [2, 2, 2, 2], [8, 1, 7, 2]
    assert plan_micro_batches(prompts, responses, 20, packed=False) == [[0, 2], [1, 3]]
    # budget 19: row 0 alone (10), then [9, 4, 3]? 3 x 9 = 27 > 19, so [9, 4] = 18 and [3]
    assert plan_micro_batches(prompts, responses, 19, packed=False) == [[0], [2, 3], [1]]


def test_packed_plan_by_hand():
    prompts, responses = [1, 1, 1, 1, 1], [9, 7, 5, 3, 1]  # sizes 10, 8, 6, 4, 2: 30 tokens
    # budget 15: two bins cannot hold 30; LPT over 2 bins gives [10, 4] and [8, 6, 2] = 16 > 15; three fit
    assert micro_batch_count(prompts, responses, 15, packed=True) == 3
    assert plan_micro_batches(prompts, responses, 15, packed=True) == [[0], [1, 4], [2, 3]]


def test_a_row_over_the_budget_gets_a_micro_batch_to_itself():
    assert plan_micro_batches([4, 1], [100, 2], 10, packed=True) == [[0], [1]]
    assert plan_micro_batches([4, 1], [100, 2], 10, packed=False) == [[0], [1]]


def test_a_larger_count_spreads_the_rows_evenly():
    prompts, responses = [1] * 6, [9] * 6  # six rows of 10 tokens, budget 60: one micro-batch alone
    assert plan_micro_batches(prompts, responses, 60, packed=True) == [[0, 1, 2, 3, 4, 5]]
    assert plan_micro_batches(prompts, responses, 60, packed=True, count=3) == [[0, 3], [1, 4], [2, 5]]
    assert plan_micro_batches(prompts, responses, 60, packed=False, count=3) == [[0, 1], [2, 3], [4, 5]]
    # more micro-batches than rows: one row each, the rest are the caller's padding
    assert len(plan_micro_batches(prompts[:2], responses[:2], 60, packed=False, count=4)) == 2


def test_plan_refuses_a_bad_budget():
    with pytest.raises(ValueError, match="max_tokens=0 must be an integer >= 1"):
        plan_micro_batches([1], [1], 0, packed=True)


def _cost(prompts, responses, rows, packed):
    if packed:
        return sum(prompts[i] + responses[i] for i in rows)
    return len(rows) * (max(max(prompts[i] for i in rows), 1) + max(responses[i] for i in rows))


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 200)), min_size=0, max_size=40),
    budget=st.integers(1, 600),
    packed=st.booleans(),
    extra=st.integers(0, 5),
)
def test_plan_invariants(lengths, budget, packed, extra):
    """Every row exactly once; every micro-batch within the budget or a lone row; a larger count
    never gives more micro-batches than asked, nor breaks the budget."""
    prompts = [p for p, _ in lengths]
    responses = [r for _, r in lengths]
    fewest = micro_batch_count(prompts, responses, budget, packed=packed)
    for count in (None, fewest + extra):
        plan = plan_micro_batches(prompts, responses, budget, packed=packed, count=count)
        assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
        assert all(mb and mb == sorted(mb) for mb in plan)
        assert all(len(mb) == 1 or _cost(prompts, responses, mb, packed) <= budget for mb in plan)
        assert len(plan) <= (fewest if count is None else max(count, fewest))
    if lengths and not packed:  # the even spread: no micro-batch costs more than the fewest-bin plan's worst
        worst = max(_cost(prompts, responses, mb, False) for mb in plan_micro_batches(prompts, responses, budget,
                                                                                       packed=False))
        spread = plan_micro_batches(prompts, responses, budget, packed=False, count=fewest + extra)
        assert max(_cost(prompts, responses, mb, False) for mb in spread) <= worst


def test_micro_batches_without_a_budget_are_runs_of_rows():
    batch = _batch(seed=0, n=5)
    got = list(micro_batches(None, batch, micro_batch_size=2))
    assert [mb.rows.tolist() for mb in got] == [[0, 1], [2, 3], [4]]
    assert [mb.is_last for mb in got] == [False, False, True] and not any(mb.padding for mb in got)


# ---------------------------------------------------------------- exactness of the update


def _model(seed=0):
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=53)
    return transformers.Qwen2ForCausalLM(config)


def _batch(seed: int, n: int = 8) -> dict[str, torch.Tensor]:
    """Ragged rows: prompts of 2-6 tokens, responses of 1-20 with a tool token inside some."""
    g = torch.Generator().manual_seed(seed)
    experiences = []
    for i in range(n):
        prompt = torch.randint(1, 53, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        length = int(torch.randint(1, 21, (1,), generator=g))
        mask = [1] * length
        if length > 5:
            mask[2] = 0
        experiences.append(Experience(prompt, torch.randint(1, 53, (length,), generator=g).tolist(),
                                      float(torch.rand((), generator=g)), group_id=i // 4, response_mask=mask))
    batch = collate(experiences, pad_token_id=0)
    batch["old_logprobs"] = -torch.rand(batch["response_mask"].shape, generator=g) * batch["response_mask"]
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=g)
    batch["ref_logprobs"] = batch["old_logprobs"] - 0.1
    batch["values"] = torch.randn(batch["response_mask"].shape, generator=g) * batch["response_mask"]
    batch["returns"] = torch.randn(batch["response_mask"].shape, generator=g)
    return batch


def _grads_after(update, **micro) -> tuple[dict, dict[str, torch.Tensor]]:
    """Run ``update`` with a strategy whose step() keeps the gradient instead of stepping."""
    from rltk.strategies.accelerate_strategy import AccelerateStrategy

    class KeepGrads(AccelerateStrategy):
        def step(self):
            self.kept = {n: p.grad.detach().clone() for n, p in self.unwrap().named_parameters()}
            self.optimizer.zero_grad(set_to_none=True)
            return {}

    strategy = KeepGrads(cpu=True)
    strategy.setup(_model(), lr=1e-3, total_steps=4, weight_decay=0.0, warmup_steps=0, lr_schedule="constant",
                   grad_clip=None)
    metrics = update(strategy, **micro)
    return metrics, strategy.kept


MODES = [dict(max_tokens_per_micro_batch=60), dict(max_tokens_per_micro_batch=60, pack_sequences=True),
         dict(max_tokens_per_micro_batch=25, pack_sequences=True), dict(pack_sequences=True)]


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("mode", MODES, ids=["budget", "budget+pack", "small-budget+pack", "pack"])
def test_policy_gradient_under_a_token_budget_equals_padded(loss_agg, mode):
    batch = _batch(seed=1)
    agg = rltk.get_component("loss_agg", loss_agg)
    loss = LossComponents(policy_loss=rltk.get_component("policy_loss", "ppo_clip"), loss_agg=agg,
                          loss_agg_args={"norm_constant": 20.0} if loss_agg.endswith("norm") else {},
                          kl_penalty=rltk.get_component("kl_penalty_fn", "k3"), entropy_coef=0.01)

    def update(strategy, **micro):
        return policy_update(strategy, batch, loss, ForwardSettings(**micro), kl_coef=0.1, mini_batches=1,
                             ppo_epochs=1, generator=torch.Generator().manual_seed(0)).metrics

    padded_metrics, padded = _grads_after(update, micro_batch_size=3)
    metrics, grads = _grads_after(update, micro_batch_size=3, **mode)
    assert metrics.keys() == padded_metrics.keys()
    for key, value in padded_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    for name, grad in padded.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_a_wrong_normaliser_would_fail_the_gradient_check():
    """The equality above has teeth: per-micro-batch token means (no global counts) differ."""
    batch = _batch(seed=1)
    token_mean = rltk.get_component("loss_agg", "token-mean")

    def local_mean(loss_mat, mask, *, global_tokens=None, global_seqs=None):
        return token_mean(loss_mat, mask)  # ignores the global counts

    losses = [LossComponents(policy_loss=rltk.get_component("policy_loss", "ppo_clip"), loss_agg=agg)
              for agg in (token_mean, local_mean)]

    def update(strategy, loss, **micro):
        return policy_update(strategy, batch, loss, ForwardSettings(**micro), kl_coef=0.0, mini_batches=1,
                             ppo_epochs=1, generator=torch.Generator().manual_seed(0)).metrics

    _, right = _grads_after(lambda s, **m: update(s, losses[0], **m), micro_batch_size=8)
    _, wrong = _grads_after(lambda s, **m: update(s, losses[1], **m), micro_batch_size=8,
                            max_tokens_per_micro_batch=60)
    name = "model.embed_tokens.weight"
    assert (wrong[name] - right[name]).abs().max() > 1e-4


@pytest.mark.parametrize("mode", MODES, ids=["budget", "budget+pack", "small-budget+pack", "pack"])
def test_batched_logprobs_and_values_keep_the_row_order(mode):
    from rltk.models.critic import build_critic_from_policy

    batch = _batch(seed=2)
    model = _model()
    expected = batched_logprobs(model, batch, ForwardSettings(micro_batch_size=3), with_entropy=True)
    got = batched_logprobs(model, batch, ForwardSettings(micro_batch_size=3, **mode), with_entropy=True)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    critic = build_critic_from_policy(model, head_init_std=0.1)
    torch.testing.assert_close(batched_values(critic, batch, ForwardSettings(micro_batch_size=3, **mode)),
                               batched_values(critic, batch, ForwardSettings(micro_batch_size=3)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES[:2], ids=["budget", "budget+pack"])
def test_critic_gradient_under_a_token_budget_equals_padded(mode):
    from rltk.models.critic import build_critic_from_policy
    from rltk.strategies.accelerate_strategy import AccelerateStrategy

    batch = _batch(seed=3)
    grads = []
    for micro in (dict(micro_batch_size=3), dict(micro_batch_size=3, **mode)):
        class KeepGrads(AccelerateStrategy):
            def step(self):
                self.kept = {n: p.grad.detach().clone() for n, p in self.unwrap().named_parameters()}
                self.optimizer.zero_grad(set_to_none=True)
                return {}

        strategy = KeepGrads(cpu=True)
        strategy.setup(build_critic_from_policy(_model(), head_init_std=0.1), lr=1e-3, total_steps=4,
                       weight_decay=0.0, warmup_steps=0, lr_schedule="constant", grad_clip=None)
        critic_update(strategy, batch, ForwardSettings(**micro), loss_agg=rltk.get_component("loss_agg", "token-mean"),
                      clip_range=0.2, mini_batches=1, ppo_epochs=1, generator=torch.Generator().manual_seed(0))
        grads.append(strategy.kept)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-4, msg=name)
