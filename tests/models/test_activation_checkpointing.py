"""Gradient checkpointing (``model.gradient_checkpointing``) changes memory, never numbers.

Every test compares a model with activation checkpointing on against the same
model with it off, on the same batch and RNG state, and first checks that
checkpointing really ran: each decoder layer's MLP runs again inside the
backward pass (a recompute), once per layer and forward. Gradients must agree
to fp32 rounding (on CPU they come out bit for bit equal); a recompute that
drew other dropout masks, dropped the prompt's KV cache or ran in eval mode
would differ by orders of magnitude more, or fail the recompute count.
"""

from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager

import pytest
import torch
import transformers
from torch import nn

import rltk
from rltk.batch import Experience, collate
from rltk.models.activation_checkpointing import enable_activation_checkpointing
from rltk.models.logprobs import response_logprobs, response_logprobs_naive

VOCAB = 61
SMALL = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
    vocab_size=VOCAB, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
LAYERS = SMALL["num_hidden_layers"]


def qwen2(seed: int = 0) -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, tie_word_embeddings=True)).train()


def with_lora(model: nn.Module, seed: int = 1) -> nn.Module:
    """The model with rltk's LoRA (r=4 on every linear layer but the head) and adapter dropout on, so
    the recompute must replay its masks. B starts random, not zero, so that every adapter weight gets
    a gradient and the adapted model differs from its base (the KL reference)."""
    from rltk.models.lora import apply_lora

    model = apply_lora(model, {"r": 4, "alpha": 8.0, "dropout": 0.25, "target_modules": "all-linear"})
    torch.manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.2)
    return model.train()


def build(lora: bool, checkpointing: bool) -> nn.Module:
    model = qwen2()
    if lora:
        model = with_lora(model)
    if checkpointing:
        enable_activation_checkpointing(model)
    return model


def grouped_batch(seed: int = 0):
    """Two prompts x three responses (GRPO groups), prompts left-padded to P = 6 columns and
    responses right-padded to T = 5: rows of one group share their prompt."""
    gen = torch.Generator().manual_seed(seed)
    experiences = []
    for group, prompt_len in enumerate((6, 4)):
        prompt = torch.randint(3, VOCAB, (prompt_len,), generator=gen).tolist()
        for length in (5, 3, 1):
            response = torch.randint(3, VOCAB, (length,), generator=gen).tolist()
            experiences.append(Experience(prompt, response, score=float(length % 2), group_id=group))
    return collate(experiences, pad_token_id=0)


class RecomputeCounter:
    """Counts the MLP forwards of every decoder layer that run during a backward pass (recomputes)."""

    def __init__(self, model: nn.Module):
        self.in_backward = False
        self.recomputes = 0
        mlps = [m for name, m in model.named_modules() if name.endswith("mlp")]
        assert len(mlps) == LAYERS, [name for name, _ in model.named_modules()]
        # an instance attribute, not a forward hook: torch's checkpoint recompute skips module hooks
        for mlp in mlps:
            mlp.forward = self._counting(mlp.forward)

    def _counting(self, forward):
        def counted(*args, **kwargs):
            self.recomputes += self.in_backward
            return forward(*args, **kwargs)
        return counted

    @contextmanager
    def backward(self):
        self.in_backward = True
        try:
            yield
        finally:
            self.in_backward = False


def trainable_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_same_tensors(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str) -> None:
    """Each tensor within 1e-5 of its own largest entry: fp32 rounding of sums taken in another order
    (the plain pass may run a group's shared prompt once, the checkpointed one the whole batch);
    on CPU the two usually agree bit for bit. What checkpointing could break is far larger."""
    assert ours.keys() == ref.keys()
    for name, expected in ref.items():
        err = (ours[name] - expected).abs().max().item()
        assert err <= 1e-5 * max(expected.abs().max().item(), 1e-12), f"{what} {name}: max abs error {err:.3e}"


# --------------------------------------------------------------------------
# The log-prob paths policy updates use
# --------------------------------------------------------------------------


LOGPROB_PATHS = {
    "fused": lambda m, b, T: response_logprobs(m, b["input_ids"], b["attention_mask"], T, impl="torch",
                                               with_entropy=True, chunk_size=(4, 16)),
    "packed": lambda m, b, T: response_logprobs(m, b["input_ids"], b["attention_mask"], T, impl="torch",
                                                with_entropy=True, pack=True, chunk_size=(4, 16)),
    "naive": lambda m, b, T: response_logprobs_naive(m, b["input_ids"], b["attention_mask"], T, with_entropy=True),
}


def logprob_gradients(lora: bool, checkpointing: bool, path: str):
    model = build(lora, checkpointing)
    batch = grouped_batch()
    T = batch["response_mask"].shape[1]
    counter = RecomputeCounter(model)
    torch.manual_seed(7)  # the same dropout masks in both runs
    logprobs, entropy = LOGPROB_PATHS[path](model, batch, T)
    upstream = torch.linspace(-1.0, 2.0, logprobs.numel()).view_as(logprobs)
    loss = (logprobs * upstream * batch["response_mask"]).sum() + 0.3 * (entropy * batch["response_mask"]).sum()
    with counter.backward():
        loss.backward()
    return logprobs.detach(), trainable_grads(model), counter.recomputes, model


@pytest.mark.parametrize("path", sorted(LOGPROB_PATHS))
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_gradients_equal_the_plain_backward(lora, path):
    plain_logprobs, plain, plain_recomputes, _ = logprob_gradients(lora, checkpointing=False, path=path)
    ckpt_logprobs, ckpt, ckpt_recomputes, model = logprob_gradients(lora, checkpointing=True, path=path)

    assert plain_recomputes == 0
    assert ckpt_recomputes == LAYERS  # one forward, every layer recomputed once in its backward
    assert_same_tensors({"logprobs": ckpt_logprobs}, {"logprobs": plain_logprobs}, path)
    assert_same_tensors(ckpt, plain, f"{path} gradient")
    if lora:
        # only the adapters train, and each of them gets a gradient through the frozen layers
        assert ckpt and all("lora_" in name for name in ckpt)
        assert len(ckpt) == 2 * 7 * LAYERS  # A and B of q, k, v, o, gate, up, down per layer
        assert all(g.abs().sum() > 0 for g in ckpt.values())
        assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)
    else:
        assert all(g.abs().sum() > 0 for g in ckpt.values())


# --------------------------------------------------------------------------
# A whole GRPO update with a KL term, through rltk's policy_update
# --------------------------------------------------------------------------


def grpo_update(lora: bool, checkpointing: bool):
    """One GRPO update (PPO-clip, k3 KL in the loss, entropy bonus, 3 micro-batches) as the recipe
    runs it: old and reference log-probs without gradients, then one optimizer step."""
    from rltk.strategies.accelerate_strategy import AccelerateStrategy
    from rltk.training.step.reference import FrozenReference
    from rltk.training.step.forward import ForwardSettings, batched_logprobs
    from rltk.training.step.loss_components import LossComponents
    from rltk.training.updates.rl import policy_update

    class Recording(AccelerateStrategy):
        def backward(self, loss):
            with counter.backward():
                super().backward(loss)

        def step(self):
            self.grads = trainable_grads(self.unwrap())
            return super().step()

    model = build(lora, checkpointing)
    counter = RecomputeCounter(model)
    strategy = Recording(cpu=True)
    strategy.setup(model, lr=1e-2, total_steps=1, weight_decay=0.01, grad_clip=1.0)
    # the recipes' reference: a frozen copy, or under LoRA the policy with its adapters off
    reference = FrozenReference.for_stage(strategy, kl_coef=0.1)
    assert reference.shares_policy == lora
    batch = grouped_batch()
    settings = ForwardSettings(micro_batch_size=2, temperature=1.0, impl="torch", chunk_size=(4, 16))
    batch["old_logprobs"], _ = batched_logprobs(model, batch, settings)
    batch["ref_logprobs"] = reference.logprobs(batch, settings)
    batch["advantages"] = (torch.linspace(-1.0, 1.0, 6)[:, None] * batch["response_mask"]).float()
    loss = LossComponents(policy_loss=rltk.get_component("policy_loss", "ppo_clip"),
                          loss_agg=rltk.get_component("loss_agg", "token-mean"),
                          kl_penalty=rltk.get_component("kl_penalty_fn", "k3"), entropy_coef=0.01)
    torch.manual_seed(11)  # the same dropout masks in both runs
    metrics, _ = policy_update(strategy, batch, loss, settings, kl_coef=0.1, mini_batches=1, ppo_epochs=1,
                               generator=torch.Generator().manual_seed(0))
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return strategy.grads, weights, metrics, counter.recomputes, batch


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_update_with_kl_is_the_same_with_checkpointing(lora):
    plain_grads, plain_weights, plain_metrics, plain_recomputes, batch = grpo_update(lora, checkpointing=False)
    ckpt_grads, ckpt_weights, ckpt_metrics, ckpt_recomputes, _ = grpo_update(lora, checkpointing=True)

    # the no-grad passes (old and reference log-probs) run in eval mode: nothing to recompute;
    # each of the 3 micro-batches' training forwards recomputes every layer once
    assert plain_recomputes == 0
    assert ckpt_recomputes == 3 * LAYERS
    if lora:
        # the adapters start away from zero (init_lora_weights=False): the base model's log-probs differ
        assert (batch["ref_logprobs"] - batch["old_logprobs"]).abs().max() > 1e-2
    assert plain_metrics["kl_loss"] != 0.0
    assert_same_tensors(ckpt_grads, plain_grads, "gradient")
    # Adam's first step is lr * g / (|g| + eps), eps = 1e-8, on the gradient clipped to norm 1: where a
    # clipped entry is itself near eps, a rounding difference in g (compared above) moves the step by a
    # visible fraction of lr. Updated weights are compared where it is well above eps (almost everywhere).
    clip = min(1.0, 1.0 / plain_metrics["grad_norm"])
    settled = {name: plain_grads[name].abs() * clip > 1e-6 for name in plain_weights}
    assert sum(m.sum().item() for m in settled.values()) > 0.99 * sum(m.numel() for m in settled.values())
    assert_same_tensors({n: w[settled[n]] for n, w in ckpt_weights.items()},
                        {n: w[settled[n]] for n, w in plain_weights.items()}, "updated weight")
    for key in ("pg_loss", "kl_loss", "entropy", "grad_norm"):
        assert ckpt_metrics[key] == pytest.approx(plain_metrics[key], rel=1e-6), key


# --------------------------------------------------------------------------
# Generation on a checkpointed policy, and the critic
# --------------------------------------------------------------------------


def test_generation_from_a_checkpointed_policy_in_train_mode_is_unchanged():
    """Transformers drops the KV cache of a checkpointed layer in train mode; the hf engine samples in
    eval mode (and puts the policy back in train mode), so its samples and log-probs are unchanged."""
    from rltk.models.tiny import build_char_tokenizer
    from rltk.rollout.base import SamplingParams
    from rltk.rollout.hf import HFRolloutEngine

    tokenizer = build_char_tokenizer()
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, stop_token_ids=[], seed=3)
    prompts = [[5, 6, 7, 8], [9, 10]]
    out = {}
    for checkpointing in (False, True):
        model = build(lora=False, checkpointing=checkpointing)
        completions = HFRolloutEngine(model, tokenizer).generate(prompts, params)
        assert model.training
        out[checkpointing] = [(c.token_ids, c.logprobs) for group in completions for c in group]
    assert [ids for ids, _ in out[True]] == [ids for ids, _ in out[False]]
    for (_, ours), (_, ref) in zip(out[True], out[False]):
        assert ours == pytest.approx(ref, abs=1e-6)


def test_critic_gradients_equal_the_plain_backward():
    from rltk.models.critic import build_critic_from_policy

    batch = grouped_batch()
    grads = {}
    for checkpointing in (False, True):
        critic = build_critic_from_policy(qwen2(), head_init_std=0.5)
        torch.manual_seed(0)
        nn.init.normal_(critic.value_head.weight)  # a head of zeros would give the backbone no gradient
        if checkpointing:
            critic.gradient_checkpointing_enable()
        counter = RecomputeCounter(critic)
        values = critic(batch["input_ids"], batch["attention_mask"])
        with counter.backward():
            (values * torch.linspace(-1, 1, values.shape[1])).sum().backward()
        assert counter.recomputes == (LAYERS if checkpointing else 0)
        grads[checkpointing] = trainable_grads(critic)
    assert_same_tensors(grads[True], grads[False], "critic gradient")


# --------------------------------------------------------------------------
# Enabling it: through the config, for a model from a folder, and what fails
# --------------------------------------------------------------------------


def test_policy_from_a_folder_trains_in_train_mode_so_checkpointing_runs(tmp_path):
    """from_pretrained returns eval mode, where transformers never checkpoints: the policy builder must
    hand the recipes a train-mode model, or model.gradient_checkpointing=true would save nothing."""
    from rltk.config.loader import load_config
    from rltk.models.tiny import build_char_tokenizer, build_tiny_model, save_pretrained_dir
    from rltk.training.scaffold.setup import build_tokenizer_and_policy

    tokenizer = build_char_tokenizer()
    save_pretrained_dir(build_tiny_model(tokenizer, hidden_size=32, num_layers=LAYERS, num_heads=4, num_kv_heads=2,
                                         intermediate_size=64, seed=0), tokenizer, tmp_path / "policy")
    for checkpointing in (False, True):
        cfg = load_config([], [f"model.path={tmp_path / 'policy'}", f"model.gradient_checkpointing={checkpointing}"],
                          warn=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # transformers 5 deprecates gradient_checkpointing_enable
            _, policy = build_tokenizer_and_policy(cfg)
        assert policy.training
        counter = RecomputeCounter(policy)
        batch = grouped_batch()
        logprobs, _ = response_logprobs(policy, batch["input_ids"] % 40 + 3, batch["attention_mask"],
                                        batch["response_mask"].shape[1], impl="torch")
        with counter.backward():
            logprobs.sum().backward()
        assert counter.recomputes == (LAYERS if checkpointing else 0)


def test_a_model_without_checkpointing_support_names_the_config_key():
    with pytest.raises(ValueError, match=r"model\.gradient_checkpointing=true, but Linear offers no "
                                         r"activation_checkpointing_enable.*set model\.gradient_checkpointing=false"):
        enable_activation_checkpointing(nn.Linear(2, 2))
