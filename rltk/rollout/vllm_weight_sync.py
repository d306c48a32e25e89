"""Weight-transfer backends rltk registers with vLLM (>= 0.19), for colocated engines and servers.

vLLM's supported way to replace a running model's weights is its weight-transfer
API: ``weight_transfer_config={"backend": NAME}`` when the engine starts, then
``init_weight_transfer_engine`` once and ``start_weight_update`` /
``update_weights`` (one or more chunks) / ``finish_weight_update`` per sync, as
worker calls (``LLM.collective_rpc``) or as the OpenAI server's RL endpoints
(``/init_weight_transfer_engine``, ``/start_weight_update``, ...). The backends
vLLM ships move tensors over NCCL or CUDA IPC, which a CPU-only machine has not,
so rltk adds three through vLLM's ``WeightTransferEngineFactory``:

* ``rltk_inproc``: the trainer and vLLM's worker share one process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); a chunk is the list of ``(name,
  tensor)`` pairs itself, handed over without a copy or a pickle.
* ``rltk_file``: a chunk is the path of a safetensors file the trainer wrote
  (by default under ``/dev/shm``, memory on Linux); the server reads it. Works on
  any device between processes that share a file system, and carries only
  ``{"path": ...}`` over HTTP (plus ``"aliases"``, ``{name: name in the file}``,
  for a file that stores tied tensors once under one of their names).

* ``rltk_broadcast``: the trainer and the server's workers form a process group of their own (gloo on CPU,
  NCCL on CUDA; :mod:`rltk.rollout.weight_broadcast`) at ``init_weight_transfer_engine``; a chunk's
  ``update_info`` is the layout of buckets the trainer broadcasts meanwhile (the trainer's side:
  :mod:`rltk.rollout.vllm_broadcast`), whole tensors or exact deltas against a copy the worker keeps.

All three load through the model's own ``load_weights`` (Hugging Face names, full
tensors; vLLM fuses and shards them) inside vLLM's layerwise reload
(``initialize_layerwise_reload`` / ``finalize_layerwise_reload``), which
restores the loaders a model drops after its first load (without it the second
load fails with ``'Parameter' object has no attribute 'weight_loader'``).

A server process learns the backends through vLLM's plugin entry point
(``vllm.general_plugins``: ``rltk_weight_transfer = rltk.rollout.vllm_weight_sync:register``);
this module imports nothing of rltk, so loading it costs a vLLM process nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

INPROC = "rltk_inproc"
FILE = "rltk_file"
BROADCAST = "rltk_broadcast"


def register() -> None:
    """Register rltk's backends with vLLM's factory; safe to call again (vLLM loads plugins per process)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    for name, cls in zip((INPROC, FILE, BROADCAST), _engine_classes()):
        try:
            WeightTransferEngineFactory.register_engine(name, cls)
        except ValueError:  # already registered in this process
            pass


_CLASSES: tuple | None = None


def _engine_classes() -> tuple[type, type, type]:
    """Defined on first use: the base classes come from vLLM, which this module must not import at load time."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class NoInitInfo(WeightTransferInitInfo):
        """Nothing to agree on: no rendezvous, no wire format."""

    @dataclass
    class TensorsUpdateInfo(WeightTransferUpdateInfo):
        weights: list = field(default_factory=list)  # [(hf_name, tensor), ...]

    @dataclass
    class FileUpdateInfo(WeightTransferUpdateInfo):
        path: str = ""
        # {name the model loads: name in the file}: a file that stores tied tensors once (safetensors'
        # save_model, as an asynchronous run's trainer writes) is loaded as is, without a rewritten copy
        aliases: dict = field(default_factory=dict)

    class _Layerwise(WeightTransferEngine):
        """Loads Hugging Face-named full tensors through the model's ``load_weights`` in a layerwise reload."""

        init_info_cls = NoInitInfo

        def init_transfer_engine(self, init_info) -> None:
            pass

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # The base class synchronizes the accelerator afterwards, which a CPU-only torch
            # may not have; loading here is synchronous already.
            self.receive_weights(self.parse_update_info(update_info))
            if _has_accelerator():
                import torch

                torch.accelerator.synchronize()

        def _load(self, weights) -> None:
            self.model.load_weights(weights=weights)

        def shutdown(self) -> None:
            pass

    class InprocEngine(_Layerwise):
        """``rltk_inproc``: tensors handed over in the same process."""

        update_info_cls = TensorsUpdateInfo

        def receive_weights(self, update_info) -> None:
            self._load([(name, tensor.to(self.device)) for name, tensor in update_info.weights])

    class FileEngine(_Layerwise):
        """``rltk_file``: one safetensors file per chunk, read from a shared file system."""

        update_info_cls = FileUpdateInfo

        def receive_weights(self, update_info) -> None:
            from safetensors.torch import load_file

            if not update_info.path:
                raise ValueError("rltk_file weight update: update_info needs 'path', a safetensors file")
            tensors = load_file(update_info.path, device=str(self.device))
            for name, source in (update_info.aliases or {}).items():
                if source not in tensors:
                    raise ValueError(f"rltk_file weight update: alias {name!r} names {source!r}, which "
                                     f"{update_info.path} does not hold")
                tensors.setdefault(name, tensors[source])
            self._load(list(tensors.items()))

    InprocEngine.__name__ = InprocEngine.__qualname__ = "RltkInprocWeightTransferEngine"
    FileEngine.__name__ = FileEngine.__qualname__ = "RltkFileWeightTransferEngine"
    _CLASSES = (InprocEngine, FileEngine, _broadcast_engine(_Layerwise, WeightTransferInitInfo,
                                                            WeightTransferUpdateInfo))
    return _CLASSES


def _has_accelerator() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)
    return accelerator is not None and accelerator.is_available()


def _broadcast_engine(layerwise: type, init_base: type, update_base: type) -> type:
    """``rltk_broadcast``: buckets broadcast from the trainer over a process group of the weights' own
    (:mod:`rltk.rollout.weight_broadcast`, gloo on CPU, NCCL on CUDA), optionally as deltas."""

    @dataclass
    class BroadcastInitInfo(init_base):
        address: str = "127.0.0.1"  # the trainer's store
        port: int = 0
        rank_offset: int = 1  # this server's first worker's rank; the trainer is 0
        world_size: int = 2
        backend: str = "gloo"
        timeout_s: float = 300.0
        bucket_bytes: int = 1 << 28
        keep_copy: bool = False  # delta mode: hold the last version's tensors to apply changes to
        generation: int = 0

    @dataclass
    class BroadcastUpdateInfo(update_base):
        pieces: list = field(default_factory=list)  # weight_broadcast.piece(...) entries, in send order
        version: int = 0
        base_version: int | None = None  # a delta's: the version whose copy it changes
        digests: dict = field(default_factory=dict)  # {name: SHA-256}: check what was rebuilt (verify_weights)

    class BroadcastEngine(layerwise):
        """Receives each bucket straight from the group and loads it; in delta mode keeps a copy."""

        init_info_cls = BroadcastInitInfo
        update_info_cls = BroadcastUpdateInfo

        def init_transfer_engine(self, init_info) -> None:
            from rltk.rollout import weight_broadcast as wire

            config = self.parallel_config
            rank = (init_info.rank_offset + getattr(config, "data_parallel_index", 0) * config.world_size
                    + config.rank)
            self._info = init_info
            self._store = wire.store(init_info.address, init_info.port, init_info.world_size, is_master=False,
                                     timeout_s=init_info.timeout_s)
            self._group = wire.join(self._store, init_info.backend, rank, init_info.world_size,
                                    init_info.timeout_s, address=init_info.address,
                                    generation=init_info.generation)
            self._held: dict = {}
            self._held_version: int | None = None

        def receive_weights(self, update_info) -> None:
            from rltk.rollout import weight_broadcast as wire

            info = getattr(self, "_info", None)
            if info is None:
                raise RuntimeError("rltk_broadcast weight update before /init_weight_transfer_engine")
            if update_info.base_version is not None and update_info.base_version != self._held_version:
                raise ValueError(f"rltk_broadcast: a delta against version {update_info.base_version}, but this "
                                 f"worker holds version {self._held_version}; send a full update")
            self._held_version = None  # until every bucket arrived: a torn copy is no base for a delta
            buckets = wire.receive(self._group, update_info.pieces, info.bucket_bytes,
                                   wire.device_of(info.backend, self.device), info.timeout_s)
            for bucket in buckets:
                if info.keep_copy:
                    for entry, parts in bucket:
                        wire.apply_piece(entry, parts, self._held)
                    continue
                received = {entry["name"]: parts[0] for entry, parts in bucket}
                wire.check_digests(received, {n: d for n, d in update_info.digests.items() if n in received})
                self._load([(name, tensor.to(self.device)) for name, tensor in received.items()])
            if info.keep_copy:
                wire.check_digests(self._held, update_info.digests)
                # every tensor, changed or not: the layerwise reload rebuilds whole layers; a copy each, as
                # the reload may keep what it is given and the held tensors change in place next time
                self._load((name, tensor.to(self.device, copy=True)) for name, tensor in self._held.items())
            self._held_version = update_info.version

        def shutdown(self) -> None:
            group = getattr(self, "_group", None)
            if group is not None:
                self._group = None
                try:
                    group.abort() if hasattr(group, "abort") else None
                except Exception:  # shutting down: a group whose peer died may refuse even to abort
                    pass

    BroadcastEngine.__name__ = BroadcastEngine.__qualname__ = "RltkBroadcastWeightTransferEngine"
    return BroadcastEngine
