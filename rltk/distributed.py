"""The process and its peers: rank and world, gathers outside a strategy, launcher arguments, seeds,
and the share of the node's cores a process takes.

Everything here works with or without a process group (one process is rank 0 of a world of 1),
and is what the training loop, the strategies and the recipes' argument parsing share, so the
rank has one source: ``RANK`` before a process group exists, the group once it does.
"""

from __future__ import annotations

import math
import os
import random
import socket
from typing import Any

import numpy as np
import torch

# here for the launcher's users, defined without torch so that the `rltk` command starts without it
from rltk.argv import strip_local_rank_argument  # noqa: F401


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


LOOPBACK_NAMES = ("localhost", "ip6-localhost")


def is_loopback_address(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) names this machine's loopback."""
    import ipaddress

    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def start_loopback_process_group(timeout_s: float = 1800.0) -> bool:
    """Start the default process group from the launcher's variables with its store on the loopback only;
    True if it was started here.

    torch's ``env://`` rendezvous makes rank 0's TCPStore listen on every interface (``::``) whatever
    ``MASTER_ADDR`` says, so a run told to stay on 127.0.0.1 would still open a port to the network. When
    ``MASTER_ADDR`` is a loopback address, rank 0 binds the store's socket to it and hands it to the store
    (``master_listen_fd``); Accelerate and DeepSpeed then adopt the group. Nothing happens when a group
    exists, when no launcher variables are set, when ``MASTER_ADDR`` is another machine's (the store must
    be reachable from it), or under torchrun, whose agent holds the store (``TORCHELASTIC_USE_AGENT_STORE``).
    """
    import datetime

    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return False
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if any(name not in os.environ for name in needed) or not is_loopback_address(os.environ["MASTER_ADDR"]):
        return False
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return False
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1" if host.lower() in LOOPBACK_NAMES else host.strip("[]"), port))
        listener.listen(max(64, world_size))
        # the store owns the descriptor from here on; the Python object must not close it
        store = dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=listener.detach())
    else:
        store = dist.TCPStore(host, port, world_size, False, timeout)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return True


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (``seed`` is ``cfg.seed``, validated to 0 .. 2**32 - 1, plus a rank)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # numpy refuses 2**32 and above, which cfg.seed + rank may reach
    torch.manual_seed(seed)  # every CUDA device too


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a one-machine rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def available_cores() -> int:
    """The CPU cores this process may run on: its affinity mask, capped by a cgroup v2 CPU quota
    (``/sys/fs/cgroup/cpu.max``, a container's ``--cpus``), which ``os.cpu_count()`` ignores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):  # no cgroup v2 here, or a format this does not know: the mask alone
        pass
    return max(1, cores)


def limit_torch_threads() -> int:
    """Cap torch's intra-op threads at this process's share of the cores it may use; return the count.

    torch starts one thread per physical core of the machine, which under a CPU quota or an affinity
    mask, or with several training processes on one node (``LOCAL_WORLD_SIZE``), is more threads than
    cores: every parallel region then waits for a thread the scheduler has parked, and steps that take
    milliseconds take seconds. ``OMP_NUM_THREADS``, when set, is the user's choice and is left alone.
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    share = max(1, available_cores() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if torch.get_num_threads() > share:
        torch.set_num_threads(share)
    return torch.get_num_threads()


def share_cores(processes: int) -> int | None:
    """Torch threads for each of ``processes`` processes that run side by side on this process's cores
    (the trainer and its rollout producers), or None when ``OMP_NUM_THREADS`` is set (the user's choice).

    Each taking every core would put ``processes`` times more threads than cores to work: the
    oversubscription :func:`limit_torch_threads` exists to avoid, which made an asynchronous step on
    2 cores several times slower than a synchronous one.
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, available_cores() // local // max(1, processes))


def ensure_single_process_environment() -> None:
    """Fill in the rendezvous variables for a process started without a launcher.

    ``torchrun`` and the ``deepspeed`` launcher export ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``;
    ``deepspeed.init_distributed`` needs them even for one process. When none of
    ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` is set (and no MPI launcher is
    detected), this sets a one-process world on ``127.0.0.1`` with a free port.
    A partly set environment is an error naming what is missing.
    """
    rank_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    present = [name for name in rank_vars if name in os.environ]
    if not present:
        if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:
            return  # MPI launch: deepspeed.init_distributed discovers ranks itself
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_local_port()))
        return
    missing = [name for name in (*rank_vars, "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if "LOCAL_RANK" in missing and os.environ.get("WORLD_SIZE") == "1":
        os.environ["LOCAL_RANK"] = "0"
        missing.remove("LOCAL_RANK")
    if os.environ.get("WORLD_SIZE") == "1":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_ADDR" in missing:
            missing.remove("MASTER_ADDR")
        if "MASTER_PORT" in missing:
            os.environ["MASTER_PORT"] = str(free_local_port())
            missing.remove("MASTER_PORT")
    if missing:
        raise RuntimeError(
            f"DeepSpeedStrategy: the distributed environment is incomplete: {', '.join(present)} "
            f"{'is' if len(present) == 1 else 'are'} set but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not. Start the script with a launcher "
            "(`torchrun --nproc_per_node N script.py` or `deepspeed --num_gpus N script.py`), or unset "
            "RANK/WORLD_SIZE/LOCAL_RANK to run a single process."
        )
