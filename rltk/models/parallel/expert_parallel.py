"""Expert parallelism: a mixture of experts whose experts are split over ``EP`` ranks, tokens sent to them.

Each MoE block's experts (``experts.gate_up_proj`` ``[E, 2I, D]`` and ``experts.down_proj`` ``[E, D, I]`` in
Qwen3-MoE / Qwen2-MoE, every parameter stacked over the experts in dim 0) are cut into ``EP`` consecutive
slices: rank ``j`` of an expert group holds experts ``j * E/EP .. (j + 1) * E/EP - 1``. The router stays
replicated, so a rank routes its own tokens as one process would (routing replay patches the router's output
and therefore the dispatch too, :mod:`rltk.models.moe`). Then, per block (the dispatch of Megatron's
``MoEAlltoAllTokenDispatcher``, DeepSpeed-MoE and torchtitan's expert parallel, without capacity limits or
dropped tokens)::

    sort the n*k (token, expert) assignments by expert      -> counts c[e], rows to rank e // (E/EP)
    all-to-all of the counts                                 -> how many rows each rank sends here, per expert
    all-to-all of the rows (variable split sizes)            -> this rank's experts' inputs
    the block's own expert forward on them (top-1, weight 1) -> one output row per assignment
    the reverse all-to-all                                   -> each output back on its token's rank
    out[t] = sum_k w[t, k] * y[t, k]                         (weights applied where the router ran)

The routing weights are applied on the token's own rank, so their gradient (the router's) never travels.
The backward of an all-to-all is the all-to-all with the split sizes swapped (:class:`_AllToAll`).

**Gradients.** An expert's gradient on its holder sums the contributions of every token of its expert group;
the holders of the same slice in other expert groups (the *expert-data* group) see other tokens, so expert
gradients are summed over that group, while every other parameter is averaged over all data ranks as before
(:func:`reduce_expert_gradients`). A global gradient norm counts each expert slice once
(:func:`global_grad_norm`).

**Whole weights.** Sharded expert parameters carry their :class:`ExpertShard`; :mod:`rltk.models.sharding`
gathers them (all-gather along dim 0 over the expert group) where whole tensors are needed: exports, the
rollout engine's copy, checkpoints (which therefore hold whole experts and resume at any layout).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ExpertShard", "expert_shard_of", "gather_expert_tensor", "global_grad_norm", "local_expert_slice",
           "make_expert_shard", "reduce_expert_gradients", "shard_experts", "unsharded_copy"]

SHARD_ATTRIBUTE = "_rltk_expert_shard"


@dataclass(frozen=True, eq=False)
class ExpertShard:
    """Which experts this rank holds and the process groups that tie them to the others.

    Attributes:
        size: ranks an expert group splits the experts over (``EP``).
        rank: this rank's place in its expert group (``0 .. EP-1``): it holds that slice.
        group: the expert group (its ``EP`` ranks exchange tokens).
        data_group: the ranks holding the same slice in the other expert groups (``None`` when there is
            only one expert group): expert gradients are summed over it.
    """

    size: int
    rank: int
    group: Any
    data_group: Any = None

    def __deepcopy__(self, memo):  # process groups are shared, never copied (a module copy keeps its shard)
        return self


def make_expert_shard(expert_groups: list[list[int]], rank: int) -> ExpertShard:
    """The :class:`ExpertShard` of ``rank`` from every expert group of the run (lists of global ranks, each
    ``EP`` long, together covering the world). Collective: every rank must call it with the same lists."""
    size = len(expert_groups[0])
    mine = None
    for ranks in expert_groups:  # new_group is collective over the world: all ranks create all groups in order
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = (ranks.index(rank), group)
    data_group = None
    for slot in range(size):
        ranks = [group_ranks[slot] for group_ranks in expert_groups]
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if mine is not None and slot == mine[0]:
            data_group = group
    if mine is None:
        raise ValueError(f"rank {rank} is in none of the expert groups {expert_groups}")
    return ExpertShard(size=size, rank=mine[0], group=mine[1], data_group=data_group)


def expert_shard_of(tensor: torch.Tensor) -> ExpertShard | None:
    """The :class:`ExpertShard` of a sharded expert parameter, ``None`` for any other tensor."""
    return getattr(tensor, SHARD_ATTRIBUTE, None)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with variable split sizes whose backward sends the gradients back the same way.

    Written here because torch's own autograd version (``torch.distributed.nn.functional``) is deprecated.
    """

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send: list[int], receive: list[int], group) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        out = rows.new_empty((sum(receive), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=receive, input_split_sizes=send,
                               group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad.contiguous(), ctx.receive, ctx.send, ctx.group), None, None, None


class ExpertParallelExperts:
    """Mixed in front of a block's experts class: the same parameters (this rank's slice) and the same
    expert forward, run on the tokens sent here (module docstring). ``num_experts`` is the local count."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        shard: ExpertShard = getattr(self, SHARD_ATTRIBUTE)
        local = self.num_experts
        tokens, top_k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # [n*k] assignments, expert-major (so destination-major)
        token_of = order // top_k
        counts = torch.bincount(flat, minlength=local * shard.size)  # [E]
        arriving = torch.empty_like(counts)  # [EP * local]: from each source rank, per local expert
        dist.all_to_all_single(arriving, counts, group=shard.group)
        send = counts.view(shard.size, local).sum(1).tolist()
        receive = arriving.view(shard.size, local).sum(1).tolist()
        received = _AllToAll.apply(hidden_states[token_of], send, receive, shard.group)
        # Rows arrive grouped by source rank, then by expert: each row's local expert, top-1 with weight 1
        local_index = torch.repeat_interleave(
            torch.arange(local, device=flat.device).repeat(shard.size), arriving)[:, None]
        ones = torch.ones(local_index.shape, dtype=top_k_weights.dtype, device=top_k_weights.device)
        outputs = super().forward(received, local_index, ones)
        if received.requires_grad and not outputs.requires_grad:
            # No token reached this rank's experts: keep the graph joined, or this rank would skip the
            # backward all-to-all the other ranks wait in
            outputs = outputs + received.sum() * 0
        returned = _AllToAll.apply(outputs, receive, send, shard.group)  # [n*k, D] in `order`
        weights = top_k_weights.reshape(-1)[order].to(returned.dtype)
        combined = torch.zeros_like(hidden_states)
        return combined.index_add_(0, token_of, (returned * weights[:, None]).to(combined.dtype))


def _expert_modules(model: nn.Module) -> list[nn.Module]:
    from rltk.models.moe import moe_routers

    blocks = [module for module in model.modules()
              if any(getattr(module, "gate", None) is router for router in moe_routers(model))]
    return [block.experts for block in blocks]


def shard_experts(model: nn.Module, shard: ExpertShard) -> list[nn.Parameter]:
    """Keep this rank's slice of every MoE block's experts and dispatch their tokens (in place).

    Returns the sharded parameters (the ones :func:`reduce_expert_gradients` reduces). A ``ValueError`` when
    an experts module is not of the stacked form this splits (every parameter ``[E, ...]``, a
    ``num_experts`` attribute and a ``forward(hidden, top_k_index, top_k_weights)``), or ``E`` is not a
    multiple of ``EP``.
    """
    experts = _expert_modules(model)
    if not experts:
        raise ValueError(f"{type(model).__name__} has no MoE blocks to split experts over")
    sharded = []
    for module in experts:
        total = getattr(module, "num_experts", None)
        params = list(module.named_parameters(recurse=False))
        if not isinstance(total, int) or not params or any(p.shape[0] != total for _, p in params) \
                or len(params) != len(list(module.parameters())):
            raise ValueError(f"{type(module).__name__}: expert parallelism splits experts stored stacked "
                             "(every parameter [num_experts, ...]); this model keeps them otherwise")
        if total % shard.size:
            raise ValueError(f"{total} experts do not split over strategy_args.expert_parallel_size={shard.size}")
        local = total // shard.size
        for name, param in params:
            piece = nn.Parameter(param.detach()[shard.rank * local:(shard.rank + 1) * local].clone(),
                                 requires_grad=param.requires_grad)
            setattr(piece, SHARD_ATTRIBUTE, shard)
            setattr(module, name, piece)
            sharded.append(piece)
        module.num_experts = local
        module.__class__ = _parallel_class(type(module))
        setattr(module, SHARD_ATTRIBUTE, shard)
    return sharded


_PARALLEL_CLASSES: dict[type, type] = {}


def _parallel_class(cls: type) -> type:
    if issubclass(cls, ExpertParallelExperts):
        return cls
    if cls not in _PARALLEL_CLASSES:
        _PARALLEL_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallelExperts, cls), {})
    return _PARALLEL_CLASSES[cls]


def gather_expert_tensor(tensor: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """The whole ``[E, ...]`` tensor from every rank's ``[E/EP, ...]`` slice. Collective over the expert group."""
    pieces = [torch.empty_like(tensor) for _ in range(shard.size)]
    dist.all_gather(pieces, tensor.detach().contiguous(), group=shard.group)
    return torch.cat(pieces)


def local_expert_slice(full: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """This rank's slice of a whole ``[E, ...]`` tensor (no communication)."""
    local = full.shape[0] // shard.size
    return full[shard.rank * local:(shard.rank + 1) * local]


def unsharded_copy(model: nn.Module) -> nn.Module:
    """A plain copy of ``model`` with whole experts and the block's own forward. Collective (all-gathers)."""
    plain = copy.deepcopy(model)
    # The strategy told DDP to leave the slices alone; a DDP wrapping the whole copy must not (a later stage)
    plain.__dict__.pop("_ddp_params_and_buffers_to_ignore", None)
    for module in _expert_modules(plain):
        if not isinstance(module, ExpertParallelExperts):
            continue
        shard = getattr(module, SHARD_ATTRIBUTE)
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(gather_expert_tensor(param, shard), requires_grad=param.requires_grad))
        module.num_experts *= shard.size
        module.__class__ = type(module).__mro__[2]  # (ExpertParallelX, ExpertParallelExperts, X, ...)
        delattr(module, SHARD_ATTRIBUTE)
    return plain


def reduce_expert_gradients(params: list[nn.Parameter], data_world_size: int) -> None:
    """Turn each expert slice's local gradient into its share of the global one, as DDP does for the rest.

    The strategy's backward scales losses by ``data_world_size`` so that DDP's average over data ranks is a
    sum; an expert slice's local gradient already sums over its expert group, so it is summed over the
    expert-data group and divided by ``data_world_size``. Collective; a slice no token reached has no
    gradient and takes part with zeros.
    """
    for param in params:
        if not param.requires_grad:  # frozen (a LoRA run's base): nothing to reduce
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        shard = expert_shard_of(param)
        if shard.data_group is not None:
            dist.all_reduce(param.grad, group=shard.data_group)
        param.grad.div_(data_world_size)


def global_grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all gradients of the whole model: replicated parameters counted once, each expert slice
    once (summed over its expert group). Collective over the expert group."""
    plain = [p.grad for p in params if p.grad is not None and expert_shard_of(p) is None]
    experts = [p for p in params if p.grad is not None and expert_shard_of(p) is not None]
    total = sum((g.detach().double().pow(2).sum() for g in plain), torch.zeros((), dtype=torch.float64))
    expert_total = sum((p.grad.detach().double().pow(2).sum() for p in experts), torch.zeros((), dtype=torch.float64))
    if experts:
        dist.all_reduce(expert_total, group=expert_shard_of(experts[0]).group)
    return (total + expert_total).sqrt()
