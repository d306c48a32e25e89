"""LoRA adapters through peft: apply them, switch them off for the reference, save and merge them.

LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models")
freezes each targeted linear layer ``W0 [out, in]`` and trains a low-rank
update beside it::

    h = W0 x + (alpha / r) * B A dropout(x),   A [r, in], B [out, r], B = 0 at the start

so the adapted model equals the base model until the first step. peft does
the layers; this module connects them to rltk:

* :func:`apply_lora` turns a causal LM into a ``peft.PeftModel`` from the
  ``model.lora`` section (a new adapter, or one loaded from ``model.lora.path``),
  after checking the targets or the folder against the model (a
  :class:`~rltk.config.errors.ConfigError` naming the key otherwise).
* :func:`adapters_disabled` gives the base model's forward from the same
  module (peft's ``disable_adapter``): the KL reference of a LoRA run costs no
  second copy of the weights. The reference is therefore the base model the
  adapter was put on, not the policy as a later stage starts.
* :func:`save_adapter_folder` / :func:`adapter_state_to_live` write and read a
  standard peft adapter folder (``adapter_config.json``,
  ``adapter_model.safetensors``): what checkpoints hold instead of full weights.
* :func:`merge_lora_weights` folds adapters into plain weight names for a
  rollout engine with weights of its own (vLLM) and for exports; it streams, so
  a ZeRO-3 gather never needs more than one layer at a time.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import nn

from rltk.config.errors import ConfigError
from rltk.config.lora_checks import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    ALL_LINEAR,
    check_adapter_fits,
    check_targets,
    lora_enabled,
    linear_modules,
    target_list,
)

ADAPTER_NAME = "default"  # peft's name of the one adapter rltk trains


def _peft():
    try:
        import peft
    except ImportError as exc:  # a core dependency, so only a broken environment lands here
        raise ConfigError(f"model.lora is set but peft cannot be imported ({exc}); install it with "
                          f"`pip install peft`") from exc
    return peft


def _setting(settings: Any, key: str, default: Any = None) -> Any:
    if isinstance(settings, Mapping) or hasattr(settings, "get"):
        value = settings.get(key, default)
    else:
        value = getattr(settings, key, default)
    return default if value is None and default is not None else value


def apply_lora(model: nn.Module, settings: Any, *, model_desc: str = "the model") -> nn.Module:
    """``model`` with trainable LoRA adapters (a ``peft.PeftModel``), or ``model`` itself when LoRA is off.

    ``settings`` is the ``model.lora`` section (or a mapping with the same
    keys): ``r``, ``alpha``, ``dropout``, ``target_modules`` (names or
    ``"all-linear"``) and ``path``, an adapter folder to start from (its own
    rank, alpha and targets apply then). Only the adapter weights require
    gradients afterwards, so a strategy's optimizer holds only them.

    Raises:
        ConfigError: a target that matches no linear module (the message lists
            the model's linear module names), a rank that is not a positive
            integer, or an adapter folder made for another base model.
    """
    if not lora_enabled(settings):
        r = _setting(settings, "r")
        if r not in (None, 0):
            raise ConfigError(f"bad value {r!r} for 'model.lora.r': the adapter rank must be a positive integer "
                              f"(e.g. 8, 16, 64), or 0/null for no LoRA")
        return model
    peft = _peft()
    linear = linear_modules(model)
    path = _setting(settings, "path")
    if path:
        check_adapter_fits(path, linear, model_desc)
        # is_trainable: peft loads adapters frozen (for inference) unless told otherwise.
        peft_model = peft.PeftModel.from_pretrained(model, str(Path(path).expanduser()), is_trainable=True)
    else:
        r = _setting(settings, "r")
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            raise ConfigError(f"bad value {r!r} for 'model.lora.r': the adapter rank must be a positive integer")
        targets = target_list(_setting(settings, "target_modules", ALL_LINEAR))
        check_targets(targets, linear)
        config = peft.LoraConfig(
            r=r, lora_alpha=float(_setting(settings, "alpha", 16.0)), lora_dropout=float(_setting(settings, "dropout", 0.0)),
            # peft's own all-linear rule equals linear_modules(): every nn.Linear but the output layer.
            target_modules=ALL_LINEAR if targets == ALL_LINEAR else list(targets),
            task_type="CAUSAL_LM", bias="none",
        )
        peft_model = peft.get_peft_model(model, config)
    if _checkpointing(model):
        # Checkpointed blocks whose inputs need no gradient (the embedding is frozen now) would
        # return outputs without a graph under reentrant checkpointing: the adapters inside them
        # would get no gradient. Marking the embedding output as requiring grad fixes that.
        peft_model.enable_input_require_grads()
    return peft_model


def _checkpointing(model: nn.Module) -> bool:
    """Whether transformers' gradient (activation) checkpointing is on for ``model``."""
    # transformers 5 renamed the flag and warns on the old name; 4.x has only the old one.
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def is_lora_model(model: nn.Module | None) -> bool:
    """Whether ``model`` (possibly inside a DDP / DeepSpeed / compile wrapper) carries peft adapters."""
    if model is None:
        return False
    try:
        from peft import PeftModel
    except ImportError:
        return False
    seen = 0
    while seen < 8:  # wrappers nest a few levels at most
        if isinstance(model, PeftModel):
            return True
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return False
        model, seen = inner, seen + 1
    return False


def peft_model_of(model: nn.Module) -> nn.Module:
    """The ``PeftModel`` inside ``model``'s wrappers (DDP ``.module``, ``torch.compile``'s ``_orig_mod``)."""
    from peft import PeftModel

    while not isinstance(model, PeftModel):
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            raise TypeError(f"{type(model).__name__} holds no peft adapters")
        model = inner
    return model


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, ``model`` computes as its base model: every LoRA adapter is switched off.

    Yields ``model`` itself. This is the KL reference of a LoRA run: the same
    weights with the low-rank updates skipped, so no copy is held. peft's
    ``disable_adapter`` flips a flag on each adapted layer and restores it on
    exit, also on error; nothing about the parameters changes, so it works on
    modules sharded by ZeRO-3 or FSDP2 too (their forwards gather as usual).
    """
    with peft_model_of(model).disable_adapter():
        yield model


# ---------------------------------------------------------------- adapter folders (checkpoints, exports)


def adapter_names(model: nn.Module) -> dict[str, str]:
    """``{name in an adapter file: name in model.state_dict()}`` for the adapter's tensors.

    peft drops the adapter's name from the keys it saves
    (``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``); this
    asks peft's own ``get_peft_model_state_dict`` which keys it keeps and how it
    renames them, by handing it each key's index in place of its tensor.
    """
    from peft import get_peft_model_state_dict

    peft_model = peft_model_of(model)
    live = list(peft_model.state_dict().keys())
    tagged = {name: torch.tensor([i]) for i, name in enumerate(live)}
    saved = get_peft_model_state_dict(peft_model, state_dict=tagged, adapter_name=ADAPTER_NAME,
                                      save_embedding_layers=False)
    return {name: live[int(index[0])] for name, index in saved.items()}


def adapter_live_names(model: nn.Module) -> set[str] | None:
    """The ``model.state_dict()`` names of the adapter's tensors, or None when ``model`` has no adapters.

    What a checkpoint of a LoRA model needs: gather and write these, not the frozen base.
    """
    return set(adapter_names(model).values()) if is_lora_model(model) else None


def save_adapter_folder(model: nn.Module, state: Mapping[str, torch.Tensor], directory: str | Path) -> None:
    """Write ``model``'s adapter as a peft folder: ``adapter_config.json`` and ``adapter_model.safetensors``.

    ``state`` holds full CPU tensors under ``model.state_dict()`` names (e.g.
    a strategy's ``full_state_dict()``); only the adapter's entries are
    written, under peft's names, so ``PeftModel.from_pretrained`` and
    ``model.lora.path`` read the folder.
    """
    from safetensors.torch import save_file

    peft_model = peft_model_of(model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = adapter_names(peft_model)
    missing = [live for live in names.values() if live not in state]
    if missing:
        raise KeyError(f"save_adapter_folder: the state dict lacks adapter tensors {missing[:4]}; pass the "
                       f"full_state_dict() of the model the adapter belongs to")
    save_file({saved: state[live].detach().to("cpu").contiguous().clone() for saved, live in names.items()},
              str(directory / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    config = copy.deepcopy(peft_model.peft_config[ADAPTER_NAME])
    config.inference_mode = True  # what peft writes: a folder loads frozen unless asked for training
    config.save_pretrained(str(directory))


def is_adapter_folder(directory: str | Path) -> bool:
    """Whether ``directory`` holds a peft adapter (``adapter_config.json``) rather than full weights."""
    return (Path(directory) / ADAPTER_CONFIG_FILE).is_file()


def adapter_state_to_live(model: nn.Module, state: Mapping[str, torch.Tensor],
                          source: str | Path) -> dict[str, torch.Tensor]:
    """An adapter file's tensors under ``model.state_dict()`` names; exactly the adapter's keys, or KeyError."""
    names = adapter_names(model)
    unexpected = sorted(set(state) - set(names))
    missing = sorted(set(names) - set(state))
    if unexpected or missing:
        raise KeyError(
            f"adapter weights in '{source}' do not match the model's adapter: missing {missing[:6]}, unexpected "
            f"{unexpected[:6]}. Was it written for another model.lora.target_modules or base model?"
        )
    return {names[key]: tensor for key, tensor in state.items()}


# ---------------------------------------------------------------- merging (vLLM, exports)


def lora_scalings(model: nn.Module) -> dict[str, float]:
    """``{module name in model.state_dict() terms: alpha / r}`` of every adapted layer of ``model``.

    Names are those of the module ``model`` as given (wrappers included), so
    they prefix the module's state-dict keys.
    """
    from peft.tuners.lora import LoraLayer

    scalings = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER_NAME in getattr(module, "scaling", {}):
            if getattr(module, "fan_in_fan_out", False):
                raise NotImplementedError(f"merging adapters of fan_in_fan_out layers ({name}) is not supported")
            if ADAPTER_NAME in getattr(module, "lora_magnitude_vector", {}):
                raise NotImplementedError(f"merging DoRA adapters ({name}) is not supported")
            scalings[name] = float(module.scaling[ADAPTER_NAME])
    return scalings


def strip_peft_prefix(name: str) -> str:
    """A merged weight's name as the base model (and vLLM) calls it: without ``base_model.model.``."""
    return name.removeprefix("base_model.model.")


def merge_lora_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], scalings: Mapping[str, float],
                       *, adapter: str = ADAPTER_NAME) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's weights with every adapter folded in, from an adapted model's state-dict entries.

    For each adapted layer ``m`` (a key of ``scalings``, value ``s = alpha / r``)::

        m.weight = m.base_layer.weight + s * (m.lora_B.<adapter>.weight @ m.lora_A.<adapter>.weight)
        m.bias   = m.base_layer.bias

    Every other entry passes through; names lose peft's ``base_model.model.``
    prefix and ``.base_layer``, so they are the plain model's names. Entries
    are consumed in order and a layer is yielded once its three tensors have
    been seen, so a caller streaming gathered ZeRO-3 tensors holds one layer
    at a time. Yielded tensors are new (fp32 math, cast back to the base
    weight's dtype) or the inputs themselves for pass-through entries.

    Raises:
        KeyError: an adapted layer whose base weight, ``lora_A`` or ``lora_B`` never came.
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    parts = {f".lora_A.{adapter}.weight": "A", f".lora_B.{adapter}.weight": "B", ".base_layer.weight": "W"}
    for name, tensor in named_tensors:
        layer = part = None
        for suffix, tag in parts.items():
            if name.endswith(suffix) and name[: -len(suffix)] in scalings:
                layer, part = name[: -len(suffix)], tag
                break
        if layer is None:
            if ".lora_" in name and any(name.startswith(m + ".lora_") for m in scalings):
                continue  # another adapter's tensors, or a lora_embedding / dropout entry: not part of the plain model
            yield strip_peft_prefix(name.replace(".base_layer.", ".")), tensor
            continue
        entry = pending.setdefault(layer, {})
        # copies: a streamed (gathered) tensor may be released once the next one is requested
        entry[part] = tensor.detach().clone()
        if len(entry) == 3:
            base = pending.pop(layer)
            delta = (base["B"].float() @ base["A"].float()) * scalings[layer]
            yield strip_peft_prefix(layer) + ".weight", (base["W"].float() + delta).to(base["W"].dtype)
    if pending:
        raise KeyError(f"merge_lora_weights: adapted layers with a missing base weight, lora_A or lora_B: "
                       f"{sorted(pending)[:4]}")


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights with its adapters merged, under the plain base model's names (CPU copies)."""
    peft_model = peft_model_of(model)
    from rltk.models.sharding import iter_full_state

    scalings = lora_scalings(peft_model)
    return {name: tensor.detach().to("cpu", copy=True)
            for name, tensor in merge_lora_weights(iter_full_state(peft_model), scalings)}


def merged_copy(model: nn.Module) -> nn.Module:
    """A plain (peft-free) copy of ``model`` with its adapters merged into the weights.

    For a PPO critic built from the policy's backbone, and for ``rltk export --merge``.
    ``model`` itself is left as it is.
    """
    return copy.deepcopy(peft_model_of(model)).merge_and_unload()


def read_adapter_config(directory: str | Path) -> dict:
    """The ``adapter_config.json`` in ``directory`` as a dict."""
    return json.loads((Path(directory) / ADAPTER_CONFIG_FILE).read_text(encoding="utf-8"))
