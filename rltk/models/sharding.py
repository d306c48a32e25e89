"""Whole tensors from modules whose parameters a rank holds only a shard of.

Two kinds of sharded parameters exist in rltk's engines:

* DeepSpeed ZeRO-3 parameters (they carry ``ds_id``): outside their module's
  forward ``param.data`` is empty and the rank's partition sits in
  ``param.ds_tensor``; ``deepspeed.zero.GatheredParameters`` makes them whole.
* FSDP2 ``DTensor`` parameters with a sharded placement:
  ``DTensor.full_tensor()`` makes them whole.

Making a tensor whole is a collective: every rank must ask for the same
tensors in the same order. :func:`iter_full_state` walks a module's state dict
in its (rank-independent) order and gathers one tensor at a time, so the
extra memory is one full tensor, never the whole model.
"""

from __future__ import annotations

from typing import Iterator

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
    """Whether this rank may hold only part of ``tensor`` (a ZeRO-3 parameter or a DTensor)."""
    return is_zero3_parameter(tensor) or is_dtensor(tensor)


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
    for name, tensor in module.state_dict(keep_vars=True).items():
        if is_zero3_parameter(tensor):
            import deepspeed

            with deepspeed.zero.GatheredParameters([tensor]):
                yield name, tensor.detach()
        elif is_dtensor(tensor):
            yield name, tensor.full_tensor().detach()
        else:
            yield name, tensor.detach()
