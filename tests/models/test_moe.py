"""The tiny MoE default, routing recorded by the hf engine, replayed in the trainer's forward, and the MoE
metrics and load-balancing loss (rltk.models.moe, rltk.models.tiny, rltk.rollout.hf_routing)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from rltk.batch import Experience, collate
from rltk.training.rollouts.asynchronous.queue import ExperienceQueue
from rltk.models.loading import load_model, load_tokenizer
from rltk.models.moe import (RouterTrace, is_moe, load_balancing_loss, moe_routers, route, route_by_rank,
                             routing_metrics, routing_shape)
from rltk.models.tiny import build_char_tokenizer, build_tiny_model, build_tiny_moe_model, save_pretrained_dir
from rltk.rollout.base import SamplingParams
from rltk.rollout.hf import HFRolloutEngine
from rltk.models.critic import build_critic_from_policy
from rltk.training.step.micro_batches import run_logprobs, run_values

PROMPTS = ["12+3=", "7+1=", "45+45=", "9+9="]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_moe_model(tokenizer, seed=0).eval()


def routed_to_second_and_third(model):
    """The engine's routers pick their 2nd and 3rd most likely experts: its routing disagrees with the
    trainer's top-k on every token."""
    return route_by_rank(model, (1, 2))


def sampled_batch(model, tokenizer, engine_routing=contextlib.nullcontext):
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    engine = HFRolloutEngine(model, tokenizer)
    with engine_routing(model):
        groups = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=5, seed=7))
    experiences = [Experience(prompts[c.prompt_index], c.token_ids, 0.0, c.prompt_index,
                              rollout_logprobs=c.logprobs, routed_experts=c.routed_experts)
                   for group in groups for c in group]
    return experiences, collate(experiences, tokenizer.pad_token_id)


def trainer_logprobs(model, batch, *, replay: bool, pack: bool = False, trace: RouterTrace | None = None):
    width = batch["response_mask"].shape[1]
    with torch.no_grad():
        return run_logprobs(model, batch, width, trim=pack, pack=pack, share_prompts=False,
                            routed_experts=batch["routed_experts"] if replay else None, router_trace=trace)[0]


def test_tiny_moe_is_a_small_qwen3_moe_that_saves_and_reloads(tmp_path, tokenizer, model):
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert 100_000 <= sum(p.numel() for p in model.parameters()) <= 300_000
    assert routing_shape(model) == (2, 2, 8)
    assert not is_moe(build_tiny_model(tokenizer))
    folder = save_pretrained_dir(model, tokenizer, tmp_path / "moe")
    reloaded = load_model(folder).eval()
    ids = torch.tensor([tokenizer.encode("12+34=46", add_special_tokens=False)])
    assert load_tokenizer(folder).encode("12+34=46", add_special_tokens=False) == ids[0].tolist()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)


def test_engine_records_the_experts_the_trainer_would_pick(tokenizer, model):
    experiences, batch = sampled_batch(model, tokenizer)
    routed = batch["routed_experts"]  # [B, P + T, L, k]
    assert routed.shape == (*batch["input_ids"].shape, 2, 2)
    assert bool((routed[batch["attention_mask"] == 0] == -1).all())  # padding
    last = batch["attention_mask"].sum(-1) - 1 + (batch["attention_mask"] == 0).sum(-1) * 0
    trace = RouterTrace()
    own = trainer_logprobs(model, batch, replay=False, trace=trace)
    # same weights, same experts on (nearly) every token: the recorded routing is the trainer's own top-k
    rollout = batch["routed_experts"][:, :-1].reshape(-1, 2, 2)
    metrics = routing_metrics(trace.stacked("used"), trace.valid, 8, own=trace.stacked("own"), rollout=rollout)
    assert metrics["moe/topk_mismatch"] <= 0.02
    assert torch.allclose(own, batch["rollout_logprobs"], atol=1e-5)
    assert len(experiences[0].routed_experts) == len(experiences[0].prompt_ids) + len(experiences[0].response_ids)
    assert experiences[0].routed_experts[-1] == [[-1, -1], [-1, -1]] and last.numel() == len(experiences)


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_replay_gives_the_engines_logprobs_where_the_trainers_router_disagrees(tokenizer, model, pack):
    _, batch = sampled_batch(model, tokenizer, routed_to_second_and_third)
    mask = batch["response_mask"].bool()
    trace = RouterTrace()
    own = trainer_logprobs(model, batch, replay=False, pack=pack, trace=trace)
    replayed = trainer_logprobs(model, batch, replay=True, pack=pack)
    rollout = batch["rollout_logprobs"]
    # the trainer's own top-k set differs from the engine's on every recorded token (ranks 1-2 vs 2-3)
    if not pack:
        recorded = batch["routed_experts"][:, :-1].reshape(-1, 2, 2)
        metrics = routing_metrics(trace.stacked("used"), trace.valid, 8, own=trace.stacked("own"), rollout=recorded)
        assert metrics["moe/topk_mismatch"] == 1.0
        assert metrics["moe/topk_mismatch/layer_0"] == metrics["moe/topk_mismatch/layer_1"] == 1.0
    assert (own - rollout)[mask].abs().mean() > 1e-3  # without replay: another network (100x the tolerance below)
    assert torch.allclose(replayed[mask], rollout[mask], atol=1e-5)  # with replay: the engine's, to rounding


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_an_moe_critic_replays_the_rollouts_routing_too(tokenizer, model, pack):
    _, batch = sampled_batch(model, tokenizer, routed_to_second_and_third)
    critic = build_critic_from_policy(model, head_init_std=1.0).eval()  # the policy's routers, copied
    width, mask = batch["response_mask"].shape[1], batch["response_mask"].bool()
    with torch.no_grad():
        own = run_values(critic, batch, width, trim=pack, pack=pack)
        replayed = run_values(critic, batch, width, trim=pack, pack=pack, routed_experts=batch["routed_experts"])
        with routed_to_second_and_third(critic):  # the critic routed as the engine was: what replay must give
            engines = run_values(critic, batch, width, trim=pack, pack=pack)
    assert (own - engines)[mask].abs().max() > 1e-3  # its own top-k: other experts, other values
    assert torch.allclose(replayed[mask], engines[mask], atol=1e-5)


def test_replay_keeps_the_routers_gradient(tokenizer, model):
    _, batch = sampled_batch(model, tokenizer, routed_to_second_and_third)
    trained = build_tiny_moe_model(tokenizer, seed=0)
    width = batch["response_mask"].shape[1]
    logprobs = run_logprobs(trained, batch, width, trim=False, pack=False, share_prompts=False,
                            routed_experts=batch["routed_experts"])[0]
    (logprobs * batch["response_mask"]).sum().backward()
    for router in moe_routers(trained):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_replay_refuses_a_forward_it_does_not_align_with(model):
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match="not aligned"):
        with route(model, torch.zeros(3, 2, 2, dtype=torch.long)):
            model(ids)


def test_routing_travels_through_the_experience_queue(tmp_path, tokenizer, model):
    experiences, batch = sampled_batch(model, tokenizer)
    with ExperienceQueue(tmp_path / "queue.sqlite") as queue:
        queue.put(experiences, ids=[str(i) for i in range(len(experiences))], versions=0)
        taken = queue.take(len(experiences), step=1, version=0).experiences
    assert [e.routed_experts for e in taken] == [e.routed_experts for e in experiences]
    assert torch.equal(collate(taken, tokenizer.pad_token_id)["routed_experts"], batch["routed_experts"])


def test_collate_lays_routing_out_like_the_tokens():
    with_routing = Experience([5, 6], [7, 8, 1], 1.0, 0, routed_experts=[[[0]], [[1]], [[2]], [[3]], [[-1]]])
    without = Experience([5, 6, 9], [7], 0.0, 0)
    routed = collate([with_routing, without], pad_token_id=0)["routed_experts"][..., 0, 0]  # [B, P + T]
    assert routed.tolist() == [[-1, 0, 1, 2, 3, -1], [-1, -1, -1, -1, -1, -1]]
    with pytest.raises(ValueError, match="routed_experts has 2 entries for 2 prompt \\+ 3 response"):
        Experience([5, 6], [7, 8, 1], 1.0, 0, routed_experts=[[[0]], [[1]]])


def test_load_balance_metrics_and_loss_on_hand_made_routing():
    # 4 tokens, 1 layer, top-1 of 2 experts: 3 tokens on expert 0, 1 on expert 1; shares 3/4, 1/4
    used = torch.tensor([[[0]], [[0]], [[0]], [[1]]])
    valid = torch.ones(4, dtype=torch.bool)
    metrics = routing_metrics(used, valid, 2)
    entropy = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(2)
    assert metrics["moe/load_entropy"] == pytest.approx(entropy)
    assert metrics["moe/load_max_share"] == pytest.approx(0.75)
    # uniform router probabilities: aux = E * sum_e f_e * 1/E = sum_e f_e = k = 1, whatever the counts
    logits = torch.zeros(4, 1, 2)
    assert float(load_balancing_loss(logits, used, valid)) == pytest.approx(1.0)
    # probabilities (0.9, 0.1) on every token: aux = 2 * (3/4 * 0.9 + 1/4 * 0.1) = 1.4
    logits = torch.tensor([math.log(0.9), math.log(0.1)]).expand(4, 1, 2)
    assert float(load_balancing_loss(logits, used, valid)) == pytest.approx(1.4)
    # a padding token counts in neither
    padded = torch.cat([used, torch.tensor([[[1]]])]), torch.cat([valid, torch.tensor([False])])
    assert routing_metrics(*padded, 2)["moe/load_max_share"] == pytest.approx(0.75)
