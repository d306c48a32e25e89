"""The process and its peers: rank and world, gathers outside a strategy, launcher arguments, seeds.

Everything here works with or without a process group (one process is rank 0 of a world of 1),
and is what the training loop, the strategies and the recipes' argument parsing share, so the
rank has one source: ``RANK`` before a process group exists, the group once it does.
"""

from __future__ import annotations

import os
import random
import socket
from typing import Any

import numpy as np
import torch


def process_rank() -> int:
    """This process's rank under torchrun / deepspeed / accelerate launchers (0 when alone)."""
    return int(os.environ.get("RANK", "0"))


def process_group() -> tuple[int, int]:
    """(world size, rank) of the default process group, (1, 0) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def every_rank(obj: Any) -> list:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank (``[obj]`` without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def end_process_group() -> None:
    """Every rank waits for the others, then the process group ends: a rank that exits while a
    peer still talks to it occasionally aborts (gloo's "terminate called without an active exception")."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (``seed`` is ``cfg.seed``, validated to 0 .. 2**32 - 1, plus a rank)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # numpy refuses 2**32 and above, which cfg.seed + rank may reach
    torch.manual_seed(seed)  # every CUDA device too


def strip_local_rank_argument(argv: list[str]) -> list[str]:
    """``argv`` without the ``--local_rank=N`` / ``--local_rank N`` the ``deepspeed`` launcher appends.

    The launcher also exports ``LOCAL_RANK``; the value is copied there when
    the variable is missing, so nothing is lost. Call it before parsing a
    recipe's arguments: ``args = parse(strip_local_rank_argument(sys.argv[1:]))``.
    """
    kept: list[str] = []
    skip_next = False
    for i, arg in enumerate(argv):
        if skip_next:
            skip_next = False
            continue
        if arg.startswith(("--local_rank=", "--local-rank=")):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
        elif arg in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            skip_next = True
        else:
            kept.append(arg)
    return kept


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a one-machine rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
