"""``strategy_args.expert_parallel_size``: what a data-parallel strategy does to split a MoE's experts.

The dispatch itself is :mod:`rltk.models.parallel.expert_parallel`; this is the strategy's side: the expert
groups from :class:`~rltk.strategies.layout.ParallelLayout` (``EP`` consecutive data ranks), the sharding of
the model before DDP wraps it (DDP must leave the expert slices alone: they differ between ranks), and the
gradient step's reduction and norm. Combines with DDP (plain data parallel), routing replay and the router's
load-balancing loss; FSDP2, ZeRO, sequence and tensor parallel are refused (not built).
"""

from __future__ import annotations

import torch
from torch import nn

from rltk.errors import ConfigError
from rltk.strategies.layout import ParallelLayout

KEY = "strategy_args.expert_parallel_size"


def check_expert_parallel_size(size) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"{KEY}: {size!r} is not a whole number of ranks >= 1 (1: experts replicated)")
    return size


class ExpertParallelism:
    """The expert slices of one strategy's model and how their gradients are reduced."""

    def __init__(self, size: int, world_size: int, rank: int):
        self.layout = ParallelLayout(world_size=world_size, expert_parallel_size=size)
        self.size, self.world_size, self.rank = size, world_size, rank
        self.params: list[nn.Parameter] = []

    def shard(self, model: nn.Module) -> None:
        """Keep this rank's experts in ``model`` (in place) and tell DDP to leave them alone. Collective."""
        from rltk.models.moe import is_moe, routing_shape
        from rltk.models.parallel.expert_parallel import make_expert_shard, shard_experts

        if not is_moe(model):
            raise ConfigError(f"{KEY}={self.size}: the policy {type(model).__name__} is a dense model, it has no "
                              f"experts to split; set {KEY}=1 or train a mixture of experts "
                              "(model.tiny.moe.num_experts=8, or a model.path of an MoE)")
        experts = routing_shape(model)[2]
        if experts % self.size:
            raise ConfigError(f"{KEY}={self.size} does not divide the model's {experts} experts per layer: "
                              f"choose a divisor of {experts}")
        groups = sorted({tuple(self.layout.expert_group_ranks(r)) for r in range(self.world_size)})
        shard = make_expert_shard([list(g) for g in groups], self.rank)
        self.params = shard_experts(model, shard)
        names = {id(p): name for name, p in model.named_parameters()}
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [names[id(p)] for p in self.params])

    def reduce_and_clip(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Reduce the expert gradients (DDP reduced the rest), then clip all to the global norm; returns it."""
        from rltk.models.parallel.expert_parallel import global_grad_norm, reduce_expert_gradients

        reduce_expert_gradients(self.params, self.layout.data_world_size)
        norm = global_grad_norm(params)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm
