"""Critic mechanics of PPO: value predictions, the critic update, and a checkpoint of both models.

The policy side of PPO is :func:`rltk.training.updates.rl.policy_update`; this module
adds what a learned value function needs:

* :func:`batched_values` — the critic's ``V(s_t)`` for every response token of a
  rollout batch, without gradients (the ``values`` batch field GAE reads);
* :func:`critic_update` — epochs over mini-batches of PPO's clipped value loss
  (:func:`rltk.algorithms.value.clipped_value_loss`), normalised by global
  counts exactly like the policy update (both run
  :func:`rltk.training.updates.update_loop.optimizer_epochs`);
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
from typing import Any, Callable, NamedTuple

import torch
from omegaconf import DictConfig

import rltk
from rltk.algorithms.value import clipped_value_loss
# The critic section is checked by config validation (a lower layer); re-exported for recipes.
from rltk.config.validation import check_critic_config
from rltk.models.critic import ValueModel, build_critic_from_policy, load_value_model
from rltk.training.step.forward import ForwardSettings
from rltk.training.step.micro_batches import MicroBatch
from rltk.training.updates.update_loop import MicroLoss, MiniBatch, optimizer_epochs, shares, updates_per_step

__all__ = [
    "CRITIC_SUBDIR",
    "CriticUpdate",
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
    lockstep (see :func:`rltk.training.step.forward.batched_logprobs`). ``settings``: how rows are cut into
    micro-batches (rows or a token budget, packed or not; :mod:`rltk.training.step.micro_batches`).

    Shape: batch tensors (B, P + T) -> (B, T) fp32 on the batch's device.
    """
    was_training = critic.training
    critic.eval()
    B, T = batch["response_mask"].shape
    device = next(critic.parameters()).device
    out = torch.zeros(B, T, dtype=torch.float32, device=batch["input_ids"].device)
    try:
        for mb in settings.micro_batches(strategy, batch):
            data = {k: mb.data[k].to(device) for k in ("input_ids", "attention_mask", "routed_experts") if k in mb.data}
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


class CriticUpdate(NamedTuple):
    """What :func:`critic_update` returns: its metrics, and how much of the returns' variance the critic explained."""

    #: ``critic/*``: the loss, clip fraction and mean value, the step info, and ``critic/explained_var``
    metrics: dict[str, float]
    #: :func:`explained_variance` of the batch's ``values`` (the critic as it was when the batch was collected)
    explained_var: float


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
) -> CriticUpdate:
    """PPO epochs over mini-batches of the clipped value loss; one critic optimizer step per mini-batch.

    Per micro-batch, with ``V`` the critic's current values, ``V_old =
    batch["values"]`` and ``R = batch["returns"]``::

        l_t  = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)
        L    = loss_agg(l, response_mask; global_tokens, global_seqs)

    ``global_tokens`` / ``global_seqs`` are the mini-batch's counts summed over
    micro-batches and ranks, so the summed gradient equals that of one large
    batch whatever the micro-batch size and process count (the loop of
    :func:`rltk.training.updates.update_loop.optimizer_epochs`, as in
    :func:`rltk.training.updates.rl.policy_update`). ``clip_range=None`` is the plain
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
            packed or not: :mod:`rltk.training.step.micro_batches`). Same loss and gradient.
        generator: shuffles the sequences into mini-batches each epoch.

    Returns:
        :class:`CriticUpdate`, whose metrics are ``critic/vf_loss`` (mini-batch loss, averaged over
        optimizer steps), ``critic/vf_clip_frac``, ``critic/values_mean`` (token-weighted),
        ``critic/grad_norm``, ``critic/lr``, ``critic/skipped`` (means over steps) and
        ``critic/explained_var`` of ``batch["values"]`` against the returns (the critic as it was
        when the batch was collected).

    Shape: (B, T) fields -> ({name: float}, float).
    """
    missing = [k for k in ("input_ids", "attention_mask", "response_mask", "values", "returns") if k not in batch]
    if missing:
        raise KeyError(
            f"critic_update: the batch lacks {missing} (has {sorted(batch)}); fill 'values' with batched_values() "
            "and 'returns' with the advantage estimator before updating the critic"
        )
    micro_loss = functools.partial(_micro_value_loss, strategy=strategy, settings=settings,
                                   loss_agg=loss_agg, loss_agg_args=dict(loss_agg_args or {}), clip_range=clip_range,
                                   width=batch["response_mask"].shape[1])
    metrics = optimizer_epochs(strategy, batch, micro_loss, settings, epochs=ppo_epochs, mini_batches=mini_batches,
                               generator=generator)
    explained = explained_variance(batch["values"], batch["returns"], batch["response_mask"], strategy)
    return CriticUpdate({**{f"critic/{k}": v for k, v in metrics.items()}, "critic/explained_var": explained},
                        explained)


def _micro_value_loss(mb: dict[str, torch.Tensor], micro: MicroBatch, *, mini: MiniBatch, strategy,
                      settings: ForwardSettings, loss_agg: Callable, loss_agg_args: dict, clip_range: float | None,
                      width: int) -> MicroLoss:
    """One micro-batch's share of :func:`critic_update`'s loss, and its shares of the metrics."""
    values = settings.values(strategy.model, mb, width)
    loss, metrics = clipped_value_loss(
        values=values, old_values=mb["values"], returns=mb["returns"],
        response_mask=mb["response_mask"], loss_agg=mini.loss_agg(loss_agg, **loss_agg_args), clip_range=clip_range,
    )

    def read_shares() -> dict[str, float]:
        # the loss is already this micro-batch's share; the means are token-weighted to add up to the mini-batch's
        weight = mini.token_share(mb["response_mask"])
        return {**shares({"vf_loss": loss}), **shares({k: metrics[k] for k in ("vf_clip_frac", "values_mean")}, weight)}

    return MicroLoss(loss, read_shares)


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
    from rltk.training.scaffold.setup import args_of

    args = {k: v for k, v in args_of(cfg, "strategy").items() if k != "seed"}
    strategy = rltk.get_component("training_strategy", cfg.strategy)(**args)
    t, c = cfg.trainer, cfg.critic
    per_step = updates_per_step(cfg)
    strategy.setup(critic, lr=c.lr, total_steps=total_steps * per_step, weight_decay=t.weight_decay,
                   betas=tuple(t.betas), warmup_steps=c.lr_warmup_steps * per_step, lr_schedule=t.lr_schedule,
                   min_lr_ratio=t.min_lr_ratio, grad_clip=t.grad_clip)
    return strategy
