"""Mixture-of-experts policies: find the routers, record and replay their choices, and measure them.

**Routers.** A sparse MoE block of transformers 5.x (Qwen3-MoE, Qwen2-MoE and the architectures that share
their code) has a ``gate`` module, the router, called once per forward on the block's tokens flattened to
``[n, D]``, returning ``(router_logits [n, E], weights [n, k], indices [n, k])``. :func:`moe_routers` finds
them in layer order; ``L`` below is their number (the sparse layers), ``k`` the experts per token, ``E``
the experts per layer.

**Routing replay** (R3, "rollout routing replay": Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by
Aligning Training and Inference Routers", arXiv:2510.11370). A token's log-prob depends on which experts it
went through. The rollout engine and the trainer run different kernels (and after an update, the sampler
is one version behind), so their routers can pick different top-k sets for the same token; the importance
ratio ``pi_theta / pi_old`` is then the ratio of two different networks for that token, and for whole blocks
of tokens at once. Replay records the experts each token used while the engine sampled it
(``routed_experts``, ``[B, P + T, L, k]``, see :mod:`rltk.batch`) and makes every training-side forward of
those tokens (old, reference and current log-probs) route them the same way: :func:`route` patches each
router's output so the indices are the recorded ones.

The weights of the picked experts are still the trainer's own: ``softmax(router_logits)`` of *this* forward
gathered at the replayed indices (renormalised over them when the router renormalises its top-k). That is
R3's choice: the expert *set* is fixed to the rollout's, so the ratio compares the same sub-network, while
the router's logits stay in the graph, so the router keeps a gradient (replaying the rollout's weights too
would freeze the router and the weights would be stale after the first update). The alternative of the
"routing replay" variants in verl and slime that record the *old policy's* routing in the trainer (R2)
leaves the rollout/trainer gap in place; R3 closes it.

Entries of ``-1`` in a replay tensor mean "not recorded": such a token is routed by the trainer's own
top-k (padding, the last sampled token, which the engine never ran, expert data with no rollout).

**Metrics** (:func:`routing_metrics`): the fraction of tokens whose trainer-side top-k set differs from the
rollout's, per layer; the experts' load balance (entropy of the share of assignments over experts, over
``log E``, and the largest share); :func:`load_balancing_loss` is the Switch Transformer auxiliary loss.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from rltk.models.wrappers import unwrap_model

__all__ = ["RouterTrace", "is_moe", "load_balancing_loss", "moe_routers", "route", "route_by_rank",
           "routing_metrics", "routing_shape"]


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The routers (``gate`` of each sparse MoE block) of ``model``, in layer order; empty for a dense model."""
    inner = unwrap_model(model)
    routers = []
    for module in inner.modules():
        gate = getattr(module, "gate", None)
        if isinstance(gate, nn.Module) and isinstance(getattr(module, "experts", None), nn.Module) \
                and hasattr(gate, "top_k"):
            routers.append(gate)
    return routers


def is_moe(model: nn.Module) -> bool:
    """Whether ``model`` has MoE routers rltk can record and replay."""
    return bool(moe_routers(model))


def routing_shape(model: nn.Module) -> tuple[int, int, int]:
    """``(L, k, E)``: sparse layers, experts per token, experts per layer of ``model``'s routers."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError(f"{type(unwrap_model(model)).__name__} has no MoE routers (a dense model)")
    return len(routers), int(routers[0].top_k), int(routers[0].weight.shape[0])


@dataclass
class RouterTrace:
    """What the routers computed in the forwards run under :func:`route` (per router, in call order).

    Attributes:
        logits: ``[n, E]`` router logits of each call (with gradient where the forward has one).
        own: ``[n, k]`` the trainer's own top-k of each call (before any replay).
        used: ``[n, k]`` the experts the tokens went through (the replayed ones under replay).
        valid: set by the caller: ``[n]`` bool, the rows that are real tokens (not padding).
        rollout: set by the caller: ``[n, L, k]`` the recorded routing aligned with the rows (None: none).
        replay: whether a forward given recorded routing replays it (False: it only aligns it into
            ``rollout``, to compare the trainer's own routing with it).
    """

    logits: list[list[torch.Tensor]] = field(default_factory=list)
    own: list[list[torch.Tensor]] = field(default_factory=list)
    used: list[list[torch.Tensor]] = field(default_factory=list)
    valid: torch.Tensor | None = None
    rollout: torch.Tensor | None = None
    replay: bool = True

    def stacked(self, name: str) -> torch.Tensor:
        """``name`` (``logits`` / ``own`` / ``used``) of every call, concatenated: ``[n, L, E or k]``."""
        per_router = [torch.cat(calls) for calls in getattr(self, name)]
        return torch.stack(per_router, dim=1)


@contextlib.contextmanager
def route(model: nn.Module, replay: torch.Tensor | None = None,
          trace: RouterTrace | None = None) -> Iterator[None]:
    """Forwards of ``model`` inside this block route by ``replay`` and/or record into ``trace``.

    ``replay``: ``[n, L, k]`` int expert indices, row ``i`` for the ``i``-th token the routers see, over
    all forwards in the block (each router consumes its column's rows in call order; a forward that runs
    more tokens than are left is a RuntimeError). ``-1`` in a row: that token keeps its own top-k. The
    weights are the trainer's softmax at the replayed experts (module docstring). Hooks are removed on
    exit, even on error.
    """
    routers = moe_routers(model)
    if not routers:
        raise ValueError(f"route(): {type(unwrap_model(model)).__name__} has no MoE routers to replay or trace")
    if replay is not None and (replay.dim() != 3 or replay.shape[1] != len(routers)):
        raise ValueError(f"route(): replay must be [n, L={len(routers)}, k], got {tuple(replay.shape)}")
    if trace is not None:
        trace.logits, trace.own, trace.used = ([[] for _ in routers] for _ in range(3))
    cursor = [0] * len(routers)
    handles = [router.register_forward_hook(_router_hook(layer, replay, trace, cursor))
               for layer, router in enumerate(routers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _router_hook(layer: int, replay: torch.Tensor | None, trace: RouterTrace | None, cursor: list[int]):
    def hook(module: nn.Module, args, output):
        if not (isinstance(output, tuple) and len(output) == 3):
            raise RuntimeError(f"{type(module).__name__} returned {type(output).__name__}, not (logits, weights, "
                               "indices): rltk records and replays only routers of that form")
        logits, weights, own = output
        used = own
        if replay is not None:
            n, start = logits.shape[0], cursor[layer]
            if start + n > replay.shape[0]:
                raise RuntimeError(f"routing replay: router {layer} saw {start + n} tokens but the replay holds "
                                   f"{replay.shape[0]}; the forward and the recorded routing are not aligned")
            given = replay[start:start + n, layer].to(own.device)  # [n, k]
            cursor[layer] = start + n
            used = torch.where((given < 0).any(-1, keepdim=True), own, given.to(own.dtype))
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            weights = probs.gather(-1, used)
            if getattr(module, "norm_topk_prob", False):
                weights = weights / weights.sum(-1, keepdim=True)
            weights = weights.to(logits.dtype)
        if trace is not None:
            trace.logits[layer].append(logits)
            trace.own[layer].append(own.detach())
            trace.used[layer].append(used.detach())
        return (logits, weights, used) if replay is not None else output

    return hook


@contextlib.contextmanager
def route_by_rank(model: nn.Module, ranks: tuple[int, ...] = (1, 2)) -> Iterator[None]:
    """Forwards inside this block route every token to the experts of the given ``ranks`` of its router's
    softmax (0: the most likely) instead of its top-k, weighted by the softmax there (renormalised).

    A stand-in for an engine whose routing disagrees with the trainer's, exaggerated to every token (real
    kernels that break near-ties differently flip some): the tests and ``benchmarks/moe.py`` sample with it.
    """
    def hook(module, args, output):
        logits = output[0]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        picked = probs.topk(max(ranks) + 1, dim=-1).indices[:, list(ranks)]
        weights = probs.gather(-1, picked)
        return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), picked

    handles = [router.register_forward_hook(hook) for router in moe_routers(model)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def topk_differs(own: torch.Tensor, rollout: torch.Tensor) -> torch.Tensor:
    """``[n, L]`` bool: the trainer's top-k *set* differs from the rollout's (order ignored). ``[n, L, k]`` each."""
    return (own.sort(-1).values != rollout.to(own.dtype).sort(-1).values).any(-1)


def expert_shares(indices: torch.Tensor, valid: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[L, E]``: each expert's share of the top-k assignments of the ``valid`` tokens, per layer.

    Shape: ``indices`` ``[n, L, k]``, ``valid`` ``[n]`` bool.
    """
    picked = indices[valid]  # [m, L, k]
    counts = torch.zeros(indices.shape[1], num_experts, dtype=torch.float32, device=indices.device)
    counts.scatter_add_(1, picked.permute(1, 0, 2).reshape(indices.shape[1], -1).long(),
                        torch.ones(indices.shape[1], picked.shape[0] * picked.shape[2], device=indices.device))
    return counts / counts.sum(-1, keepdim=True).clamp(min=1)


def routing_metrics(used: torch.Tensor, valid: torch.Tensor, num_experts: int, *,
                    own: torch.Tensor | None = None, rollout: torch.Tensor | None = None) -> dict[str, float]:
    """The MoE metrics of one set of routed tokens (``[n, L, k]`` indices, ``valid`` ``[n]`` bool).

    * ``moe/load_entropy`` (mean over layers) and ``moe/load_entropy/layer_<l>``: the entropy of the
      experts' shares of the assignments, over ``log E`` (1: perfectly balanced, 0: one expert takes all);
    * ``moe/load_max_share``: the largest share of any expert (``1/E`` balanced), mean over layers;
    * with ``own`` and ``rollout`` (``[n, L, k]``; tokens whose rollout row holds ``-1`` are not counted):
      ``moe/topk_mismatch`` (mean over layers) and ``moe/topk_mismatch/layer_<l>``, the fraction of
      tokens whose trainer-side top-k set differs from the rollout's.
    """
    shares = expert_shares(used, valid, num_experts)  # [L, E]
    entropy = -(shares * shares.clamp(min=1e-12).log()).sum(-1) / math.log(num_experts)  # [L]
    metrics = {"moe/load_entropy": float(entropy.mean()), "moe/load_max_share": float(shares.max(-1).values.mean())}
    for layer, value in enumerate(entropy.tolist()):
        metrics[f"moe/load_entropy/layer_{layer}"] = value
    if own is not None and rollout is not None:
        counted = valid & (rollout >= 0).all(-1).all(-1)  # [n]
        differs = topk_differs(own[counted], rollout[counted]).float()  # [m, L]
        per_layer = differs.mean(0) if differs.shape[0] else torch.zeros(used.shape[1])
        metrics["moe/topk_mismatch"] = float(per_layer.mean())
        for layer, value in enumerate(per_layer.tolist()):
            metrics[f"moe/topk_mismatch/layer_{layer}"] = value
    return metrics


def load_balancing_loss(logits: torch.Tensor, used: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The Switch Transformer load-balancing loss, averaged over layers (Fedus et al. 2021, arXiv:2101.03961,
    eq. 4-6; top-k counting as in transformers' ``load_balancing_loss_func``)::

        aux = E * sum_e f_e * P_e,   f_e = (1/N) sum_t 1[e in topk(t)],   P_e = (1/N) sum_t softmax(z_t)_e

    over the ``N`` valid tokens; ``f`` carries no gradient, ``P`` does (through the router logits ``z``).
    Perfect balance gives ``k`` (each ``f_e = k/E``, ``P_e = 1/E``); all tokens on the same experts, up to ``E``.

    Shape: ``logits`` ``[n, L, E]``, ``used`` ``[n, L, k]``, ``valid`` ``[n]`` bool -> scalar.
    """
    num_experts = logits.shape[-1]
    probs = torch.softmax(logits[valid].float(), dim=-1)  # [N, L, E]
    tokens = max(int(probs.shape[0]), 1)
    fraction = expert_shares(used, valid, num_experts) * used.shape[-1]  # [L, E]: assignments / N
    mean_prob = probs.sum(0) / tokens  # [L, E]
    return num_experts * (fraction * mean_prob).sum(-1).mean()
