"""Weights over a torch.distributed group of their own: the wire format both ends of a broadcast share.

The trainer (rank 0) and each inference worker (ranks 1..) join a process group made for the weights alone:
a ``TCPStore`` the trainer hosts, a ``PrefixStore`` over it, and a ``ProcessGroupGloo`` (CPU tensors) or
``ProcessGroupNCCL`` (CUDA tensors) built on it directly. No default group is created or touched, so the
trainer's own ``torch.distributed`` world (DDP, FSDP, DeepSpeed) and vLLM's inside the server never see it.

One update is a list of **pieces**, each one tensor of the model in Hugging Face names, either **dense** (its
bytes) or **sparse** (``nnz`` flat indices, int32 or int64, then ``nnz`` values: the elements that differ, bit
for bit, from the version the receiver holds). Pieces are packed into **buckets** of at most ``bucket_bytes``
(a piece larger than that travels alone in a bucket of its own size), each piece aligned to
:data:`ALIGN` bytes so that it can be viewed in its dtype; each bucket is one ``broadcast`` of a uint8
tensor. The layout (names, dtypes, shapes, ``nnz``) travels beside the bytes (over HTTP for a vLLM server)
and both ends compute the same offsets from it (:func:`bucket_layout`).

A delta (:func:`encode_delta`) is exact by construction: elements are compared as integers of the dtype's
width (so ``-0.0`` differs from ``0.0`` and a NaN payload is kept), and the receiver writes the new values at
the changed positions of its own copy (:func:`apply_piece`); a tensor whose changed fraction exceeds the
density threshold is sent dense. This is the idea of slime's and verl's delta syncs (a few percent of the
elements change in an RL step); the receiver's copy costs it one more copy of the weights.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any, Iterable, Iterator

#: Every piece starts at a multiple of this many bytes in its bucket (the widest dtype's size, int64/float64).
ALIGN = 16
GLOO = "gloo"
NCCL = "nccl"
BACKENDS = (GLOO, NCCL)
#: The store prefix of one group; a later group on the same store (a reconnect) takes the next generation.
PREFIX = "rltk-weights"

_INT_OF_WIDTH = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


class GroupError(RuntimeError):
    """A weight group did not form; ``missing`` holds the ranks that never announced themselves."""

    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing


# ---------------------------------------------------------------------------------------------- the group

def store(address: str, port: int, world_size: int, *, is_master: bool, timeout_s: float):
    """The group's rendezvous: the trainer hosts it (``is_master``; ``port`` 0 picks a free one, read back as
    ``.port``), the workers connect to it. On a loopback ``address`` the host's socket is bound to it: torch's
    own store listens on every interface whatever the address (:func:`rltk.distributed.start_loopback_process_group`)."""
    import socket

    import torch.distributed as dist

    from rltk.distributed import is_loopback_address

    timeout = timedelta(seconds=timeout_s)
    if not is_master or not is_loopback_address(address):
        return dist.TCPStore(address, port, world_size, is_master, timeout, wait_for_workers=False)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1" if address.lower() == "localhost" else address.strip("[]"), port))
    listener.listen(max(64, world_size))
    port = listener.getsockname()[1]
    # the store owns the descriptor from here on; the Python object must not close it
    return dist.TCPStore(address, port, world_size, True, timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())


def join(rendezvous, backend: str, rank: int, world_size: int, timeout_s: float, *, address: str,
         generation: int = 0):
    """This process's member of the group (``rank`` of ``world_size``) on the store ``rendezvous``.

    Blocks until every rank joined, at most ``timeout_s`` (then :class:`GroupError` naming the ranks that did
    not announce themselves). Gloo binds to ``address`` where it is the loopback, so that a group of this
    machine's processes never listens on another interface.
    """
    import torch.distributed as dist

    from rltk.distributed import is_loopback_address

    prefixed = dist.PrefixStore(f"{PREFIX}/{generation}", rendezvous)
    prefixed.set(f"joined/{rank}", "1")
    timeout = timedelta(seconds=timeout_s)
    try:
        if backend == GLOO:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            host = address if is_loopback_address(address) else ""
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            return dist.ProcessGroupGloo(prefixed, rank, world_size, options)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    except Exception as exc:  # gloo's and NCCL's rendezvous errors are RuntimeErrors, or DistStoreErrors
        missing = [r for r in range(world_size) if not _announced(prefixed, r)]
        raise GroupError(f"the weight group ({backend}, {world_size} ranks) did not form within {timeout_s:g} s: "
                         f"{'ranks ' + str(missing) + ' never joined' if missing else 'every rank joined'} "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})", missing) from None


def _announced(prefixed, rank: int) -> bool:
    try:
        return bool(prefixed.check([f"joined/{rank}"]))
    except Exception:  # the store's host is gone
        return False


def broadcast(group, tensor, timeout_s: float) -> None:
    """``tensor`` from rank 0 to every member (in place on the receivers), within ``timeout_s``."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    options.timeout = timedelta(seconds=timeout_s)
    group.broadcast([tensor], options).wait()


def device_of(backend: str, device: Any = None):
    """Where a bucket lives: the CPU for gloo, the CUDA device for NCCL."""
    import torch

    if backend == GLOO:
        return torch.device("cpu")
    return torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())


# ---------------------------------------------------------------------------------------------- the layout

def piece(name: str, tensor, nnz: int | None = None) -> dict:
    """A piece's description: a dense tensor, or a sparse one of ``nnz`` changed elements."""
    entry = {"name": name, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
    if nnz is not None:
        entry["nnz"] = int(nnz)
        entry["index_dtype"] = index_dtype_name(tensor.numel())
    return entry


def index_dtype_name(numel: int) -> str:
    return "int32" if numel < 2**31 else "int64"


def _itemsize(dtype_name: str) -> int:
    import torch

    return torch.empty((), dtype=getattr(torch, dtype_name)).element_size()


def piece_bytes(entry: dict) -> int:
    """The bytes a piece takes in its bucket (indices then values for a sparse one), before alignment."""
    width = _itemsize(entry["dtype"])
    if "nnz" not in entry:
        return math.prod(entry["shape"]) * width
    return entry["nnz"] * (_itemsize(entry["index_dtype"]) + width)


def _aligned(size: int) -> int:
    return (size + ALIGN - 1) // ALIGN * ALIGN


def bucket_layout(pieces: list[dict], bucket_bytes: int) -> list[list[tuple[dict, int]]]:
    """``pieces`` in order, cut into buckets of at most ``bucket_bytes``: each bucket a list of ``(piece, offset)``.

    A piece larger than ``bucket_bytes`` is a bucket on its own. Both ends call this on the same pieces.
    """
    buckets: list[list[tuple[dict, int]]] = []
    used = bucket_bytes  # forces a first bucket
    for entry in pieces:
        size = _aligned(piece_bytes(entry))
        if used + size > bucket_bytes and used > 0:
            buckets.append([])
            used = 0
        buckets[-1].append((entry, used))
        used += size
    return buckets


def bucket_size(bucket: list[tuple[dict, int]]) -> int:
    entry, offset = bucket[-1]
    return offset + piece_bytes(entry)


def _bytes(tensor):
    return tensor.detach().contiguous().reshape(-1).view(__import__("torch").uint8)


def pack(bucket: list[tuple[dict, int]], payloads: dict[str, tuple], device) -> Any:
    """One bucket's bytes: each piece's payload (``(dense tensor,)`` or ``(indices, values)``) at its offset."""
    import torch

    buffer = torch.empty(bucket_size(bucket), dtype=torch.uint8, device=device)
    for entry, offset in bucket:
        for part in payloads[entry["name"]]:
            raw = _bytes(part)
            buffer[offset: offset + raw.numel()].copy_(raw, non_blocking=True)
            offset += raw.numel()
    return buffer


def unpack(bucket: list[tuple[dict, int]], buffer) -> Iterator[tuple[dict, tuple]]:
    """Views into a received bucket: ``(piece, (tensor,))`` for a dense piece, ``(piece, (indices, values))``."""
    import torch

    for entry, offset in bucket:
        dtype = getattr(torch, entry["dtype"])
        if "nnz" not in entry:
            size = piece_bytes(entry)
            yield entry, (buffer[offset: offset + size].view(dtype).view(entry["shape"]),)
            continue
        nnz = entry["nnz"]
        index_size = nnz * _itemsize(entry["index_dtype"])
        indices = buffer[offset: offset + index_size].view(getattr(torch, entry["index_dtype"]))
        values = buffer[offset + index_size: offset + index_size + nnz * _itemsize(entry["dtype"])].view(dtype)
        yield entry, (indices, values)


# ---------------------------------------------------------------------------------------------- deltas

def _as_bits(tensor):
    import torch

    width = tensor.element_size()
    return tensor.reshape(-1).view(getattr(torch, _INT_OF_WIDTH[width]))


def encode_delta(name: str, new, base, density_threshold: float) -> tuple[dict, tuple] | None:
    """``new`` against the receiver's ``base`` (same name, shape, dtype): None when no bit changed, a sparse
    piece ``(indices, values)`` when the changed fraction is at most ``density_threshold``, else dense.

    Elements are compared as integers of the dtype's width, so the receiver that writes ``values`` at
    ``indices`` of its ``base`` holds ``new`` bit for bit (NaNs and signed zeros included).
    """
    import torch

    new = new.detach().contiguous()
    if base is None or base.shape != new.shape or base.dtype != new.dtype:
        return piece(name, new), (new,)
    changed = torch.nonzero(_as_bits(new) != _as_bits(base.to(new.device))).reshape(-1)
    nnz = changed.numel()
    if nnz == 0:
        return None
    if nnz > density_threshold * new.numel():
        return piece(name, new), (new,)
    indices = changed.to(getattr(torch, index_dtype_name(new.numel())))
    return piece(name, new, nnz), (indices, new.reshape(-1)[changed])


def apply_piece(entry: dict, parts: tuple, held: dict) -> Any:
    """The full tensor a received piece stands for, written into ``held`` (the receiver's copy, by name):
    a dense piece's copy, or ``held[name]`` with the sparse piece's values at its indices."""
    name = entry["name"]
    if "nnz" not in entry:
        held[name] = parts[0].clone()
        return held[name]
    if name not in held:
        raise ValueError(f"a sparse weight update for {name!r}, which this worker holds no copy of")
    indices, values = parts
    held[name].view(-1)[indices.long()] = values
    return held[name]


def digest(tensor) -> str:
    """SHA-256 of a tensor's bytes (its dtype's bits, row-major): equal digests mean bit-equal tensors."""
    import hashlib

    return hashlib.sha256(_bytes(tensor).cpu().numpy().tobytes()).hexdigest()


def check_digests(tensors: dict, digests: dict[str, str]) -> None:
    """Raise naming the tensors whose bytes are not the ones the sender hashed (``{name: digest(...)}``)."""
    wrong = sorted(name for name, expected in digests.items()
                   if name not in tensors or digest(tensors[name]) != expected)
    if wrong:
        raise ValueError(f"weights rebuilt from the update differ from the sender's in {len(wrong)} tensors "
                         f"(first: {wrong[:3]})")


def send(group, pieces: list[dict], payloads: dict[str, tuple], bucket_bytes: int, device,
         timeout_s: float) -> int:
    """Rank 0's side of one update: every bucket packed and broadcast in order. Returns the bytes sent."""
    sent = 0
    for bucket in bucket_layout(pieces, bucket_bytes):
        buffer = pack(bucket, payloads, device)
        broadcast(group, buffer, timeout_s)
        sent += buffer.numel()
    return sent


def receive(group, pieces: list[dict], bucket_bytes: int, device, timeout_s: float
            ) -> Iterable[list[tuple[dict, tuple]]]:
    """A worker's side of one update: each bucket received, as its pieces' views (valid until the next)."""
    import torch

    for bucket in bucket_layout(pieces, bucket_bytes):
        buffer = torch.empty(bucket_size(bucket), dtype=torch.uint8, device=device)
        broadcast(group, buffer, timeout_s)
        yield list(unpack(bucket, buffer))
