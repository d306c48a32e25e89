"""Whole tensors from modules whose parameters a rank holds only a shard of.

Three kinds of sharded parameters exist in rltk's engines:

* DeepSpeed ZeRO-3 parameters (they carry ``ds_id``): outside their module's
  forward ``param.data`` is empty and the rank's partition sits in
  ``param.ds_tensor``; ``deepspeed.zero.GatheredParameters`` makes them whole.
* FSDP2 ``DTensor`` parameters with a sharded placement:
  ``DTensor.full_tensor()`` makes them whole.
* Expert-parallel slices of a MoE's experts (:mod:`rltk.models.parallel.expert_parallel`; they carry
  their ``ExpertShard``): an all-gather over the expert group makes them whole.

Making a tensor whole is a collective: every rank must ask for the same
tensors in the same order. :func:`iter_full_state` walks a module's state dict
in its (rank-independent) order and gathers one tensor at a time, so the
extra memory is one full tensor, never the whole model.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import torch
from torch import nn


def is_zero3_parameter(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a parameter managed (partitioned) by DeepSpeed ZeRO-3."""
    return hasattr(tensor, "ds_id")


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (FSDP2's sharded parameters)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed support
        return False
    return isinstance(tensor, DTensor)


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether this rank may hold only part of ``tensor`` (a ZeRO-3 parameter, a DTensor, an expert slice)."""
    from rltk.models.parallel.expert_parallel import expert_shard_of

    return is_zero3_parameter(tensor) or is_dtensor(tensor) or expert_shard_of(tensor) is not None


def has_sharded_parameters(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is sharded (see :func:`is_sharded`)."""
    return any(is_sharded(p) for p in module.parameters())


def iter_full_state(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, whole tensor)`` for every entry of ``module.state_dict()``. Collective if sharded.

    Sharded tensors are gathered one at a time; a yielded tensor is valid only
    until the next item is requested (a ZeRO-3 parameter is partitioned again
    then), so copy it out if you keep it. Every rank must consume the whole
    iterator: stopping early on one rank leaves the others waiting in a gather.
    """
    from rltk.models.parallel.expert_parallel import expert_shard_of, gather_expert_tensor

    for name, tensor in module.state_dict(keep_vars=True).items():
        if is_zero3_parameter(tensor):
            import deepspeed

            with deepspeed.zero.GatheredParameters([tensor]):
                yield name, tensor.detach()
        elif is_dtensor(tensor):
            yield name, tensor.full_tensor().detach()
        elif expert_shard_of(tensor) is not None:
            yield name, gather_expert_tensor(tensor, expert_shard_of(tensor))
        else:
            yield name, tensor.detach()


# --------------------------------------------------------------------------
# Plain copies of a module an engine has converted in place
# --------------------------------------------------------------------------


def weightless_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters live on the ``meta`` device (no memory).

    Buffers and every other attribute (config, generation config) are copied
    for real; parameters shared between submodules stay shared. Take it before
    an engine converts the module (ZeRO-3 partitions it, FSDP2 swaps its class
    and parameters): it is the structure :func:`rebuild_module` fills.
    """
    memo: dict[int, Any] = {}
    for param in module.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    return copy.deepcopy(module, memo)


def rebuild_module(skeleton: nn.Module, state: dict[str, torch.Tensor], *, buffers_from: nn.Module,
                   device: torch.device, original_dtypes: bool) -> nn.Module:
    """A plain module: a copy of ``skeleton`` (see :func:`weightless_copy`) holding ``state``.

    Parameters get fresh storage on ``device``, in the skeleton's dtypes when
    ``original_dtypes`` else in ``state``'s; tied parameters stay tied. Buffers
    are copied from the live module ``buffers_from`` (they are never sharded).
    """
    module = copy.deepcopy(skeleton)
    live_buffers = dict(buffers_from.named_buffers(remove_duplicate=False))
    made: dict[int, nn.Parameter] = {}  # tied parameters appear under several names: make each once
    for name, param in list(module.named_parameters(remove_duplicate=False)):
        if id(param) not in made:
            dtype = param.dtype if original_dtypes else state[name].dtype
            made[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device),
                                           requires_grad=param.requires_grad)
        _set_tensor(module, name, made[id(param)])
    for name, buffer in list(module.named_buffers(remove_duplicate=False)):
        if name in live_buffers and buffer is not None:
            dtype = buffer.dtype if original_dtypes else live_buffers[name].dtype
            _set_tensor(module, name, live_buffers[name].detach().to(device, dtype, copy=True))
    with torch.no_grad():
        module.load_state_dict(state, strict=True)
    return module


def _set_tensor(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put ``tensor`` in place of the parameter or buffer ``name`` (dotted) of ``module``."""
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    if attr in owner._parameters:
        owner._parameters[attr] = tensor
    else:
        owner._buffers[attr] = tensor
