"""Weight-transfer backends rltk registers with vLLM (>= 0.19), for colocated engines and servers.

vLLM's supported way to replace a running model's weights is its weight-transfer
API: ``weight_transfer_config={"backend": NAME}`` when the engine starts, then
``init_weight_transfer_engine`` once and ``start_weight_update`` /
``update_weights`` (one or more chunks) / ``finish_weight_update`` per sync, as
worker calls (``LLM.collective_rpc``) or as the OpenAI server's RL endpoints
(``/init_weight_transfer_engine``, ``/start_weight_update``, ...). The backends
vLLM ships move tensors over NCCL or CUDA IPC, which a CPU-only machine has not,
so rltk adds two through vLLM's ``WeightTransferEngineFactory``:

* ``rltk_inproc``: the trainer and vLLM's worker share one process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); a chunk is the list of ``(name,
  tensor)`` pairs itself, handed over without a copy or a pickle.
* ``rltk_file``: a chunk is the path of a safetensors file the trainer wrote
  (by default under ``/dev/shm``, memory on Linux); the server reads it. Works on
  any device between processes that share a file system, and carries only
  ``{"path": ...}`` over HTTP (plus ``"aliases"``, ``{name: name in the file}``,
  for a file that stores tied tensors once under one of their names).

Both load through the model's own ``load_weights`` (Hugging Face names, full
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


def register() -> None:
    """Register rltk's backends with vLLM's factory; safe to call again (vLLM loads plugins per process)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    for name, cls in ((INPROC, _engine_classes()[0]), (FILE, _engine_classes()[1])):
        try:
            WeightTransferEngineFactory.register_engine(name, cls)
        except ValueError:  # already registered in this process
            pass


_CLASSES: tuple | None = None


def _engine_classes() -> tuple[type, type]:
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
    _CLASSES = (InprocEngine, FileEngine)
    return _CLASSES


def _has_accelerator() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)
    return accelerator is not None and accelerator.is_available()
