"""Model folders: full weights written as safetensors (a LoRA model: its adapter folder) and read back
into a plain, DDP-unwrapped or FSDP2-sharded module.

Checkpoints, exports, the critic's folders and the reference's weights all go through these; the
files they write get the process's default mode (:func:`rltk.io.give_default_mode`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rltk.io import give_default_mode


def save_model_folder(module: nn.Module, state_dict: dict[str, torch.Tensor], directory: str | Path) -> None:
    """Write full model weights to ``directory`` (a LoRA model: its adapter folder only).

    A Hugging Face ``PreTrainedModel`` is written with ``save_pretrained`` (config,
    generation config, ``*.safetensors``), so the folder loads with
    ``AutoModelForCausalLM.from_pretrained`` and serves as an export. Any other
    module gets ``model.safetensors`` alone. ``state_dict`` must hold full
    (unsharded) CPU tensors, e.g. from :meth:`TrainingStrategy.full_state_dict`.
    """
    from safetensors.torch import save_file

    from rltk.models.loading import quiet_model_io
    from rltk.models.lora import is_lora_model, save_adapter_folder

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if is_lora_model(module):
        # Only the adapter: the frozen base weights are rebuilt from the run's config (model.path or
        # the seeded tiny model), so a checkpoint of a 70B LoRA run stays megabytes.
        save_adapter_folder(module, state_dict, directory)
    elif hasattr(module, "save_pretrained") and hasattr(module, "config"):
        with quiet_model_io():
            module.save_pretrained(directory, state_dict=state_dict)
        _fix_sharded_class_name(module, directory)
    else:
        # safetensors refuses tensors sharing storage; clone so tied weights save as copies.
        save_file({k: v.contiguous().clone() for k, v in state_dict.items()}, str(directory / "model.safetensors"))
    give_default_mode(directory.glob("*.safetensors"))


def _fix_sharded_class_name(module: nn.Module, directory: Path) -> None:
    """FSDP2 swaps a module's class for ``FSDP<Class>``; record the original class in config.json."""
    config_path = directory / "config.json"
    cls = type(module)
    if not cls.__name__.startswith("FSDP") or not config_path.exists():
        return
    original = next((c for c in cls.__mro__[1:] if not c.__module__.startswith("torch.distributed")), None)
    if original is None:
        return
    config = json.loads(config_path.read_text())
    config["architectures"] = [original.__name__]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_model_folder(directory: str | Path) -> dict[str, torch.Tensor]:
    """Full model weights from every ``*.safetensors`` file in ``directory`` (sharded folders too)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in '{directory}'; a strategy checkpoint keeps the model under "
            "'<checkpoint>/model/' (is this a complete rltk checkpoint?)"
        )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file), device="cpu"))
    return state


def load_full_state_into(module: nn.Module, state: dict[str, torch.Tensor], source: str | Path) -> None:
    """Copy a full state dict into ``module`` (plain, DDP-unwrapped or FSDP2-sharded), strictly.

    For a LoRA model ``state`` may instead be an adapter file's tensors (peft's
    names, see :func:`rltk.models.lora.adapter_names`): exactly the adapter's
    entries are then required and loaded.

    A key absent from ``state`` is accepted only when the live module ties it to
    a key that is present (e.g. ``lm_head.weight`` tied to the embedding), since
    a checkpoint may store a tied tensor once. Sharded parameters receive their
    local shard of the full tensor.
    """
    from rltk.models.lora import adapter_names, adapter_state_to_live, is_lora_model

    live = module.state_dict(keep_vars=True)
    adapter_only = is_lora_model(module) and bool(state) and set(state) <= set(adapter_names(module))
    if adapter_only:
        # An adapter folder (LoRA checkpoints hold nothing else): its tensors replace the adapter's,
        # the frozen base weights stay as the run built them.
        state = adapter_state_to_live(module, state, source)
    else:
        state = in_module_names(module, state)
    unexpected = sorted(set(state) - set(live))
    loaded_ids = {id(live[k]) for k in live if k in state}
    missing = [] if adapter_only else [k for k in live if k not in state and id(live[k]) not in loaded_ids]
    mismatched = [f"{k}: model {full_shape(live[k])} vs checkpoint {tuple(state[k].shape)}"
                  for k in live if k in state and full_shape(live[k]) != tuple(state[k].shape)]
    if missing or unexpected or mismatched:
        raise KeyError(
            f"model weights in '{source}' do not match the model ({type(module).__name__}): "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}, "
            f"shape mismatches {mismatched[:4]}. Was the checkpoint written for a different model config?"
        )
    if not any(is_dtensor(t) or full_shape(t) != tuple(t.shape) for t in live.values()):
        # The module's own loader keeps custom _load_from_state_dict hooks working.
        module.load_state_dict({k: v for k, v in state.items()}, strict=False)
        return
    with torch.no_grad():
        for key, tensor in live.items():
            if key in state:
                tensor.copy_(shard_like(state[key], tensor))


def in_module_names(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A folder's tensors under ``module``'s own names.

    ``save_pretrained`` writes a Hugging Face model in its hub format, which transformers 5 converts while
    loading: Qwen3-MoE's per-expert ``experts.<e>.gate_proj.weight``, ``up_proj``, ``down_proj`` are the
    stacked ``experts.gate_up_proj`` / ``experts.down_proj`` of the module. A module name missing from
    ``state`` is built here from the tensors transformers' reverse conversion would split it into, traced
    with element ids (one tensor at a time), so the conversion is transformers' own and exact.
    """
    import math

    live = module.state_dict(keep_vars=True)
    if set(live) <= set(state) or not hasattr(module, "config"):
        return state
    from transformers.core_model_loading import revert_weight_conversion

    out, used = dict(state), set()
    for name, tensor in live.items():
        if name in state:
            continue
        shape = full_shape(tensor)
        ids = torch.arange(math.prod(shape), dtype=torch.float64).view(shape)
        pieces = revert_weight_conversion(module, {name: ids})
        if name in pieces or not pieces or not set(pieces) <= set(state):
            continue  # not converted (a tied weight stored once), or not in this folder: reported by the caller
        whole = torch.empty(math.prod(shape), dtype=state[next(iter(pieces))].dtype)
        for piece, piece_ids in pieces.items():
            whole[piece_ids.reshape(-1).long()] = state[piece].reshape(-1)
        used.update(pieces)
        out[name] = whole.view(shape)
    return {k: v for k, v in out.items() if k not in used}


def is_dtensor(tensor: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed support
        return False
    return isinstance(tensor, DTensor)


def full_cpu_copy(tensor: torch.Tensor, of: torch.Tensor | None = None) -> torch.Tensor:
    """A full, detached CPU copy of ``tensor``; gathers a sharded DTensor or expert slice (collective then).

    ``of``: the parameter ``tensor`` belongs to (an optimizer state), when the parameter says how it is split.
    """
    from rltk.models.parallel.expert_parallel import expert_shard_of, gather_expert_tensor

    shard = expert_shard_of(tensor if of is None else of)
    if is_dtensor(tensor):
        tensor = tensor.full_tensor()
    elif shard is not None and tensor.ndim:
        tensor = gather_expert_tensor(tensor, shard)
    return tensor.detach().to("cpu", copy=True)


def full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape of the whole tensor a rank may hold a part of (a DTensor's is already the global one)."""
    from rltk.models.parallel.expert_parallel import expert_shard_of

    shard = expert_shard_of(tensor)
    shape = tuple(tensor.shape)
    return (shape[0] * shard.size, *shape[1:]) if shard is not None else shape


def shard_like(full: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``live``: this rank's shard if ``live`` is a DTensor, else on its device.

    Every rank holds the same ``full`` tensor (each read the checkpoint), so the
    shard is cut locally with no communication.
    """
    if is_dtensor(live):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full.to(live.dtype), live.device_mesh, live.placements, src_data_rank=None)
    from rltk.models.parallel.expert_parallel import expert_shard_of, local_expert_slice

    if expert_shard_of(live) is not None and full.ndim:
        full = local_expert_slice(full, expert_shard_of(live))
    return full.to(device=live.device, dtype=live.dtype)
