"""The policy-gradient update shared by the GRPO-family recipes.

Pure mechanics (micro-batching, global normalisers, loss assembly); every
algorithmic choice arrives as a component from the registry.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from rltk.algorithms.aggregation import loss_agg_normalisers, masked_mean
from rltk.batch import slice_batch
from rltk.models.logprobs import response_logprobs
from rltk.registry import call_with_fields


@dataclass
class LossComponents:
    """The registry components and arguments one policy update needs."""

    policy_loss: Callable
    loss_agg: Callable
    policy_loss_args: dict = field(default_factory=dict)
    loss_agg_args: dict = field(default_factory=dict)
    kl_penalty: Callable | None = None
    kl_penalty_args: dict = field(default_factory=dict)
    kl_in: str = "loss"
    entropy_coef: float = 0.0

    @classmethod
    def from_config(cls, cfg) -> "LossComponents":
        """The ``algorithm.*`` choices of a config, looked up in the registry."""
        from rltk import get_component
        from rltk.training.setup import args_of

        a = cfg.algorithm
        return cls(
            policy_loss=get_component("policy_loss", a.policy_loss),
            policy_loss_args=args_of(cfg, "algorithm.policy_loss"),
            loss_agg=get_component("loss_agg", a.loss_agg),
            loss_agg_args=args_of(cfg, "algorithm.loss_agg"),
            kl_penalty=get_component("kl_penalty_fn", a.kl_penalty_fn),
            kl_penalty_args=args_of(cfg, "algorithm.kl_penalty_fn"),
            kl_in=a.kl_in,
            entropy_coef=a.entropy_coef,
        )


def build_kl_controller(cfg):
    """``algorithm.kl_controller``: a fixed coefficient or the adaptive target-KL rule."""
    from rltk.algorithms.kl import AdaptiveKLController, FixedKLController

    a = cfg.algorithm
    if a.kl_controller == "adaptive":
        return AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon)
    return FixedKLController(a.kl_coef)


@torch.no_grad()
def batched_logprobs(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    micro_batch_size: int,
    temperature: float,
    impl: str = "auto",
    chunk_size: int | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Response log-probs (and entropy) of ``model`` for a whole batch, without gradients.

    Shape: returns ``[B, T]`` tensors on the batch's device.
    """
    was_training = model.training
    model.eval()  # no dropout: old and reference log-probs must be deterministic
    T = batch["response_mask"].shape[1]
    logprobs, entropies = [], []
    for start in range(0, batch["input_ids"].shape[0], micro_batch_size):
        mb = slice_batch(batch, slice(start, start + micro_batch_size))
        lp, ent = response_logprobs(
            model, mb["input_ids"], mb["attention_mask"], T,
            temperature=temperature, impl=impl, with_entropy=with_entropy, chunk_size=chunk_size,
        )
        logprobs.append(lp.float())
        if with_entropy:
            entropies.append(ent.float())
    model.train(was_training)
    return torch.cat(logprobs), (torch.cat(entropies) if with_entropy else None)


def compute_advantages(adv_fn: Callable, batch: dict[str, torch.Tensor], args: dict) -> None:
    """Fill ``batch["advantages"]`` and ``batch["returns"]`` with the configured estimator.

    The estimator receives exactly the batch fields its signature names.
    """
    params = inspect.signature(adv_fn).parameters
    missing = [
        n for n, p in params.items()
        if p.default is inspect.Parameter.empty and n not in batch and n not in args
        and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    if missing:
        raise ValueError(
            f"advantage function needs batch field(s) {missing} that this recipe does not provide "
            f"(available: {sorted(batch)}); choose another algorithm.advantage_fn "
            f"(e.g. 'values' needs the ppo recipe's critic)"
        )
    advantages, returns = call_with_fields(adv_fn, batch, args)
    batch["advantages"] = advantages.float()
    batch["returns"] = returns.float()


def rollout_metrics(batch: dict[str, torch.Tensor], workflow, sample_strategy, elapsed: float) -> dict[str, float]:
    """What every RL step logs about its rollout batch: reward, accuracy, lengths, throughput,
    plus the workflow's, reward functions' and sample strategy's own counters."""
    return {
        "reward": batch["scores"].mean().item(),
        "accuracy": (batch["scores"] >= 1).float().mean().item(),
        "response_length": batch["response_lengths"].float().mean().item(),
        "tokens_per_s": batch["attention_mask"].sum().item() / elapsed,
        "time/step_s": elapsed,
        **workflow.metrics(),
        **{f"reward_fn/{k}": v for k, v in workflow.reward.stats().items()},
        **sample_strategy.metrics(),
    }


def _mean_metrics(acc: dict[str, float], new: dict[str, Any], weight: float) -> None:
    for k, v in new.items():
        v = float(v.detach().item() if isinstance(v, torch.Tensor) else v)
        acc[k] = acc.get(k, 0.0) + v * weight


def policy_update(
    strategy,
    batch: dict[str, torch.Tensor],
    loss: LossComponents,
    *,
    kl_coef: float,
    mini_batches: int,
    ppo_epochs: int,
    micro_batch_size: int,
    temperature: float,
    impl: str = "auto",
    chunk_size: int | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, float]:
    """PPO-style epochs over mini-batches of a rollout batch; one optimizer step per mini-batch.

    Each micro-batch's loss is aggregated with the mini-batch's *global* token
    and sequence counts (summed over micro-batches and ranks), so the summed
    gradient equals that of one large batch whatever the micro-batch size and
    process count. The total loss of a micro-batch is

        L = policy_loss + kl_coef * agg(KL(pi || pi_ref))   (when kl_in == "loss")
            - entropy_coef * agg(H(pi))
    """
    B = batch["input_ids"].shape[0]
    T = batch["response_mask"].shape[1]
    if B % mini_batches:
        raise ValueError(f"rollout batch of {B} sequences is not divisible into {mini_batches} mini-batches")
    mini_size = B // mini_batches
    metrics: dict[str, float] = {}
    n_updates = 0
    for _ in range(ppo_epochs):
        order = torch.randperm(B, generator=generator)
        for m in range(mini_batches):
            mini = slice_batch(batch, order[m * mini_size : (m + 1) * mini_size])
            local = loss_agg_normalisers(mini["response_mask"])
            counts = torch.tensor([float(local["global_tokens"]), float(local["global_seqs"])], dtype=torch.float64)
            global_tokens, global_seqs = strategy.all_reduce_sum(counts).tolist()
            agg = functools.partial(
                loss.loss_agg, global_tokens=global_tokens, global_seqs=global_seqs, **loss.loss_agg_args
            )
            step_metrics: dict[str, float] = {}
            starts = list(range(0, mini_size, micro_batch_size))
            for i, start in enumerate(starts):
                mb = {k: v.to(strategy.device) for k, v in slice_batch(mini, slice(start, start + micro_batch_size)).items()}
                weight = mb["response_mask"].sum().item() / max(global_tokens, 1.0)
                with strategy.accumulate(i == len(starts) - 1):
                    with strategy.autocast():
                        logprobs, entropy = response_logprobs(
                            strategy.model, mb["input_ids"], mb["attention_mask"], T,
                            temperature=temperature, impl=impl, with_entropy=True, chunk_size=chunk_size,
                        )
                        pg_loss, pg_metrics = loss.policy_loss(
                            logprobs=logprobs, old_logprobs=mb["old_logprobs"], advantages=mb["advantages"],
                            response_mask=mb["response_mask"], loss_agg=agg, **loss.policy_loss_args,
                        )
                        total = pg_loss
                        entropy_term = agg(entropy, mb["response_mask"])
                        if loss.entropy_coef:
                            total = total - loss.entropy_coef * entropy_term
                        mask = mb["response_mask"]
                        mean_entropy = masked_mean(entropy.detach(), mask)
                        parts = {"pg_loss": pg_loss.detach(), "entropy": mean_entropy}
                        if kl_coef > 0 and loss.kl_in == "loss":
                            kl = loss.kl_penalty(logprobs, mb["ref_logprobs"], **loss.kl_penalty_args)
                            kl_term = agg(kl, mb["response_mask"])
                            total = total + kl_coef * kl_term
                            parts["kl_loss"] = kl_term.detach()
                    # backward outside autocast (torch's advice) but inside accumulate,
                    # whose no-sync must cover it
                    strategy.backward(total)
                # pg_loss and kl_loss are this micro-batch's share of the mini-batch sum already;
                # per-micro ratios (clip fraction, approx KL) are token-weighted averages.
                _mean_metrics(step_metrics, {k: v for k, v in parts.items() if k != "entropy"}, 1.0)
                _mean_metrics(step_metrics, {"entropy": parts["entropy"]}, weight)
                _mean_metrics(step_metrics, pg_metrics, weight)
            step_info = strategy.step()
            _mean_metrics(step_metrics, step_info, 1.0)
            _mean_metrics(metrics, step_metrics, 1.0)
            n_updates += 1
    return {k: v / n_updates for k, v in metrics.items()}
