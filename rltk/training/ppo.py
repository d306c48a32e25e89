"""Critic mechanics of PPO: value predictions, the critic update, and a checkpoint of both models.

The policy side of PPO is :func:`rltk.training.rl.policy_update`; this module
adds what a learned value function needs:

* :func:`batched_values` — the critic's ``V(s_t)`` for every response token of a
  rollout batch, without gradients (the ``values`` batch field GAE reads);
* :func:`critic_update` — epochs over mini-batches of PPO's clipped value loss
  (:func:`rltk.algorithms.value.clipped_value_loss`), normalised by global
  counts exactly like the policy update;
* :func:`explained_variance` — how much of the returns' variance the critic
  explains, over the whole (all-rank) batch;
* :class:`PolicyAndCritic` — two training strategies saved into, and restored
  from, one checkpoint folder, so a run resumes with the critic's weights,
  optimizer and schedule too;
* :func:`build_critic`, :func:`build_critic_strategy`, :func:`check_critic_config`
  — the config side, for recipes.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig

import rltk
from rltk.algorithms.aggregation import loss_agg_normalisers
from rltk.algorithms.value import clipped_value_loss
from rltk.batch import slice_batch
# The critic section is checked by config validation (a lower layer); re-exported for recipes.
from rltk.config.validation import check_critic_config
from rltk.models.critic import ValueModel, build_critic_from_policy, load_value_model
from rltk.training.forward import ForwardSettings
from rltk.training.ranks import check_mini_batches

__all__ = [
    "CRITIC_SUBDIR",
    "PolicyAndCritic",
    "batched_values",
    "build_critic",
    "build_critic_strategy",
    "check_critic_config",
    "critic_update",
    "explained_variance",
    "updates_per_step",
]

#: Where :class:`PolicyAndCritic` keeps the critic's strategy state inside a checkpoint.
CRITIC_SUBDIR = "critic"


@torch.no_grad()
def batched_values(critic: torch.nn.Module, batch: dict[str, torch.Tensor], settings: ForwardSettings, *,
                   strategy=None) -> torch.Tensor:
    """The critic's value of the state before each response token, for a whole batch, without gradients.

    Runs in eval mode (no dropout: these are the ``old_values`` the clipped
    value loss compares against, and GAE's baseline) and restores the mode.
    Values on response padding are 0 (see :func:`rltk.models.critic.response_values`).
    Pass the ``strategy`` that shards ``critic`` to keep ranks' forwards in
    lockstep (see :func:`rltk.training.forward.batched_logprobs`). ``settings``: how rows are cut into
    micro-batches (rows or a token budget, packed or not; :mod:`rltk.training.micro_batches`).

    Shape: batch tensors (B, P + T) -> (B, T) fp32 on the batch's device.
    """
    was_training = critic.training
    critic.eval()
    B, T = batch["response_mask"].shape
    device = next(critic.parameters()).device
    out = torch.zeros(B, T, dtype=torch.float32, device=batch["input_ids"].device)
    try:
        for mb in settings.micro_batches(strategy, batch):
            data = {k: mb.data[k].to(device) for k in ("input_ids", "attention_mask")}
            values = settings.values(critic, data, T)
            if not mb.padding:
                out[mb.rows.to(out.device)] = values.float().to(out.device)  # a token-budget plan reorders rows
    finally:
        critic.train(was_training)
    return out


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, strategy=None) -> float:
    """``1 - Var(R - V) / Var(R)`` over the mask tokens of every rank.

    1 is a perfect critic, 0 one no better than predicting the mean return,
    below 0 one that is worse than that. Sums are all-reduced through
    ``strategy`` (when given) so every rank reports the number for the global
    batch. ``Var(R)`` is floored at 1e-8: a batch of identical returns gives
    ``1 - Var(R - V) / 1e-8`` rather than NaN. Returns ``nan`` for a batch
    with no mask tokens.

    Shape: (B, T) each -> float.
    """
    on = mask > 0
    returns = torch.where(on, returns.double(), 0.0)
    errors = torch.where(on, returns - values.double(), 0.0)
    sums = torch.stack([on.sum().double(), returns.sum(), returns.square().sum(), errors.sum(), errors.square().sum()])
    if strategy is not None:
        sums = strategy.all_reduce_sum(sums)
    n, sum_r, sum_r2, sum_e, sum_e2 = sums.tolist()
    if n == 0:
        return math.nan
    var_r = max(sum_r2 / n - (sum_r / n) ** 2, 0.0)
    var_e = max(sum_e2 / n - (sum_e / n) ** 2, 0.0)
    return 1.0 - var_e / max(var_r, 1e-8)


def critic_update(
    strategy,
    batch: dict[str, torch.Tensor],
    settings: ForwardSettings,
    *,
    loss_agg: Callable,
    clip_range: float | None,
    mini_batches: int,
    ppo_epochs: int,
    generator: torch.Generator | None = None,
    loss_agg_args: dict[str, Any] | None = None,
) -> dict[str, float]:
    """PPO epochs over mini-batches of the clipped value loss; one critic optimizer step per mini-batch.

    Per micro-batch, with ``V`` the critic's current values, ``V_old =
    batch["values"]`` and ``R = batch["returns"]``::

        l_t  = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)
        L    = loss_agg(l, response_mask; global_tokens, global_seqs)

    ``global_tokens`` / ``global_seqs`` are the mini-batch's counts summed over
    micro-batches and ranks, so the summed gradient equals that of one large
    batch whatever the micro-batch size and process count (the convention of
    :func:`rltk.training.rl.policy_update`). ``clip_range=None`` is the plain
    squared error.

    Args:
        strategy: the critic's training strategy (set up with a :class:`ValueModel`).
        batch: a rollout batch with ``input_ids``, ``attention_mask``,
            ``response_mask``, ``values`` and ``returns`` (``[B, *]`` each).
        loss_agg: a registered loss aggregation (e.g. ``token-mean``); its own
            arguments go in ``loss_agg_args``.
        clip_range: value clip ``c`` in reward units, or ``None``.
        mini_batches: optimizer steps per epoch; must divide ``B``.
        ppo_epochs: passes over the batch.
        settings: how rows are cut into micro-batches (rows, or a token budget,
            packed or not: :mod:`rltk.training.micro_batches`). Same loss and gradient.
        generator: shuffles the sequences into mini-batches each epoch.

    Returns:
        ``critic/vf_loss`` (mini-batch loss, averaged over optimizer steps),
        ``critic/vf_clip_frac``, ``critic/values_mean`` (token-weighted),
        ``critic/grad_norm``, ``critic/lr``, ``critic/skipped`` (means over
        steps) and ``critic/explained_var`` of ``batch["values"]`` against
        the returns (the critic as it was when the batch was collected).

    Shape: (B, T) fields -> {name: float}.
    """
    B = batch["input_ids"].shape[0]
    T = batch["response_mask"].shape[1]
    if mini_batches < 1:
        raise ValueError(f"critic_update: mini_batches must be at least 1, got {mini_batches} (trainer.mini_batches)")
    missing = [k for k in ("input_ids", "attention_mask", "response_mask", "values", "returns") if k not in batch]
    if missing:
        raise KeyError(
            f"critic_update: the batch lacks {missing} (has {sorted(batch)}); fill 'values' with batched_values() "
            "and 'returns' with the advantage estimator before updating the critic"
        )
    loss_agg_args = dict(loss_agg_args or {})
    check_mini_batches(strategy, B, mini_batches)
    totals: dict[str, float] = {}
    n_updates = 0
    for _ in range(ppo_epochs):
        order = torch.randperm(B, generator=generator)
        for rows in order.tensor_split(mini_batches):  # sizes may differ by one row (see check_mini_batches)
            mini = slice_batch(batch, rows)
            local = loss_agg_normalisers(mini["response_mask"])
            counts = torch.tensor([float(local["global_tokens"]), float(local["global_seqs"])], dtype=torch.float64)
            global_tokens, global_seqs = strategy.all_reduce_sum(counts).tolist()
            agg = functools.partial(loss_agg, global_tokens=global_tokens, global_seqs=global_seqs, **loss_agg_args)
            step = {"critic/vf_loss": 0.0, "critic/vf_clip_frac": 0.0, "critic/values_mean": 0.0}
            # as many micro-batches as the busiest rank; padding ones have zero weight (see policy_update)
            for micro in settings.micro_batches(strategy, mini, fallback=batch):
                is_last, padding = micro.is_last, micro.padding
                mb = {k: v.to(strategy.device) for k, v in micro.data.items()}
                # token-weighted so per-micro means add up to the mini-batch mean
                weight = mb["response_mask"].sum().item() / max(global_tokens, 1.0)
                with strategy.accumulate(is_last):
                    with strategy.autocast():
                        values = settings.values(strategy.model, mb, T)
                        loss, metrics = clipped_value_loss(
                            values=values, old_values=mb["values"], returns=mb["returns"],
                            response_mask=mb["response_mask"], loss_agg=agg, clip_range=clip_range,
                        )
                    # backward outside autocast but inside accumulate, whose no-sync must cover it
                    strategy.backward(loss * 0.0 if padding else loss)
                if padding:
                    continue
                step["critic/vf_loss"] += loss.item()  # already this micro-batch's share of the mini-batch loss
                step["critic/vf_clip_frac"] += metrics["vf_clip_frac"].item() * weight
                step["critic/values_mean"] += metrics["values_mean"].item() * weight
            if strategy.world_size > 1:  # every rank's shares add up to the global numbers
                names = sorted(step)
                summed = strategy.all_reduce_sum(torch.tensor([step[k] for k in names], dtype=torch.float64))
                step = dict(zip(names, summed.tolist()))
            info = strategy.step()
            for key, value in info.items():
                step[f"critic/{key}"] = float(value)
            for key, value in step.items():
                totals[key] = totals.get(key, 0.0) + value
            n_updates += 1
    result = {k: v / n_updates for k, v in totals.items()}
    result["critic/explained_var"] = explained_variance(batch["values"], batch["returns"], batch["response_mask"],
                                                        strategy)
    return result


def updates_per_step(cfg: DictConfig) -> int:
    """Optimizer steps one RL step takes: ``trainer.mini_batches * trainer.ppo_epochs``."""
    return cfg.trainer.mini_batches * cfg.trainer.ppo_epochs


# --------------------------------------------------------------------------
# One checkpoint for two models
# --------------------------------------------------------------------------


class PolicyAndCritic:
    """The policy's and the critic's strategies, seen by :class:`rltk.checkpoint.CheckpointManager` as one.

    ``save(dir)`` writes the policy strategy into ``dir`` (so ``dir/model`` is
    the policy, as in every rltk checkpoint) and the critic strategy into
    ``dir/critic``; both land inside the manager's temporary folder before its
    atomic rename, so a checkpoint either has both or does not exist.
    ``load(dir)`` restores both (call after both ``setup``).
    """

    def __init__(self, policy, critic):
        self.policy = policy
        self.critic = critic

    @property
    def rank(self) -> int:
        return self.policy.rank

    @property
    def world_size(self) -> int:
        return self.policy.world_size

    def barrier(self) -> None:
        self.policy.barrier()

    def checkpoint_globals(self) -> list:
        """What either strategy's checkpoint files may pickle besides tensors and plain data."""
        from rltk.checkpoint import strategy_checkpoint_globals

        return strategy_checkpoint_globals(self.policy) + strategy_checkpoint_globals(self.critic)

    def save(self, directory: str | Path) -> None:
        """Write both strategies' full state (collective)."""
        directory = Path(directory)
        self.policy.save(directory)
        self.critic.save(directory / CRITIC_SUBDIR)

    def load(self, directory: str | Path) -> None:
        """Restore both strategies from a folder written by :meth:`save` (collective)."""
        directory = Path(directory)
        if not (directory / CRITIC_SUBDIR).is_dir():
            raise FileNotFoundError(
                f"checkpoint '{directory}' has no '{CRITIC_SUBDIR}/' folder, so the critic cannot be restored: it was "
                "not written by a recipe with a critic (e.g. the grpo recipe). Resume it with that recipe, or start "
                "over with checkpoint.resume=never."
            )
        self.policy.load(directory)
        self.critic.load(directory / CRITIC_SUBDIR)


# --------------------------------------------------------------------------
# From the config
# --------------------------------------------------------------------------


def build_critic(cfg: DictConfig, policy: torch.nn.Module) -> ValueModel:
    """The critic of a run: ``critic.model_path`` loaded, or (null) a copy of ``policy``'s backbone.

    Copying the policy as the RL stage starts gives the critic the
    representation the supervised warm-up built, with a fresh value head.
    """
    c = cfg.critic
    if c.model_path:
        critic = load_value_model(c.model_path, dtype=cfg.model.dtype, head_init_std=c.head_init_std)
    else:
        critic = build_critic_from_policy(policy, head_init_std=c.head_init_std)
    if cfg.model.gradient_checkpointing:
        critic.gradient_checkpointing_enable()
    return critic


def build_critic_strategy(cfg: DictConfig, critic: ValueModel, *, total_steps: int):
    """The configured training strategy for the critic, with its own AdamW and schedule.

    Same engine and arguments as the policy's (``strategy``, ``strategy_args``)
    except ``seed``: a second strategy must not reseed the process mid-run.
    Learning rate and warm-up come from ``critic.lr`` / ``critic.lr_warmup_steps``
    (in RL steps, scaled to optimizer steps); weight decay, betas, clipping and
    the schedule's shape from ``trainer``.
    """
    from rltk.training.setup import args_of

    args = {k: v for k, v in args_of(cfg, "strategy").items() if k != "seed"}
    strategy = rltk.get_component("training_strategy", cfg.strategy)(**args)
    t, c = cfg.trainer, cfg.critic
    per_step = updates_per_step(cfg)
    strategy.setup(critic, lr=c.lr, total_steps=total_steps * per_step, weight_decay=t.weight_decay,
                   betas=tuple(t.betas), warmup_steps=c.lr_warmup_steps * per_step, lr_schedule=t.lr_schedule,
                   min_lr_ratio=t.min_lr_ratio, grad_clip=t.grad_clip)
    return strategy
