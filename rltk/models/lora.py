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
  :class:`~rltk.errors.ConfigError` naming the key otherwise).
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
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

from omegaconf import DictConfig, ListConfig, OmegaConf

from rltk.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

# torch is imported by the functions that run on a model: config validation reads the settings helpers
# (lora_enabled, target_list, adapter_config) without it, so that `rltk validate` starts without torch.

# --------------------------------------------------------------------------
# The matching rules: which modules a config's targets name, and whether an adapter fits a model.
# Plain functions of names and shapes; config validation runs them on a weightless copy of the model.
# --------------------------------------------------------------------------

ALL_LINEAR = "all-linear"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


def lora_enabled(lora: Any) -> bool:
    """Whether a ``model.lora`` section turns LoRA on: a rank above 0, or an adapter folder to load."""
    if lora is None:
        return False
    r, path = _get(lora, "r"), _get(lora, "path")
    return bool(path) or (r is not None and not isinstance(r, bool) and isinstance(r, int) and r > 0)


def _get(node: Any, key: str) -> Any:
    return node.get(key) if isinstance(node, (Mapping, DictConfig)) else getattr(node, key, None)


def target_list(target_modules: Any) -> list[str] | str:
    """``model.lora.target_modules`` as ``"all-linear"`` or a plain list of names (validated)."""
    if isinstance(target_modules, str):
        if target_modules == ALL_LINEAR:
            return ALL_LINEAR
        raise ConfigError(
            f"bad value {target_modules!r} for 'model.lora.target_modules': must be '{ALL_LINEAR}' or a list of "
            f"module names, e.g. model.lora.target_modules=[{target_modules}] or [q_proj,k_proj,v_proj,o_proj]"
        )
    if isinstance(target_modules, ListConfig):
        target_modules = OmegaConf.to_container(target_modules, resolve=True)
    if (not isinstance(target_modules, (list, tuple)) or not target_modules
            or not all(isinstance(t, str) and t.strip() for t in target_modules)):
        raise ConfigError(
            f"bad value {target_modules!r} for 'model.lora.target_modules': must be '{ALL_LINEAR}' or a non-empty "
            f"list of module names, e.g. [q_proj,k_proj,v_proj,o_proj]"
        )
    return [str(t) for t in target_modules]


def adapter_config(path: str | Path) -> dict:
    """The ``adapter_config.json`` of the LoRA adapter folder ``path`` (``model.lora.path``), checked."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"bad value '{path}' for 'model.lora.path': {'not a folder' if folder.exists() else 'no such folder'}. "
            f"Give a LoRA adapter folder (adapter_config.json and {ADAPTER_WEIGHTS_FILE}, as written by peft or "
            f"`rltk export` of a LoRA run), or leave it null for a new adapter"
        )
    config_file = folder / ADAPTER_CONFIG_FILE
    if not config_file.is_file() or not (folder / ADAPTER_WEIGHTS_FILE).is_file():
        present = sorted(p.name for p in folder.iterdir())[:12]
        raise ConfigError(
            f"bad value '{path}' for 'model.lora.path': not a peft adapter folder (needs {ADAPTER_CONFIG_FILE} and "
            f"{ADAPTER_WEIGHTS_FILE}; it holds {present})"
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"bad value '{path}' for 'model.lora.path': cannot read {config_file}: {exc}") from exc
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise ConfigError(f"bad value '{path}' for 'model.lora.path': the adapter is of peft type {kind!r}; "
                          f"rltk trains LORA adapters")
    return config


def linear_modules(model) -> dict[str, tuple[int, int]]:
    """``{module name: (in_features, out_features)}`` of every linear layer of ``model`` but its LM head.

    The LM head is left out as peft's ``all-linear`` leaves it out: an adapter
    on the output projection of a (often tied) vocabulary matrix is rarely wanted.
    """
    from torch import nn

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module is not head:
            found[name] = (module.in_features, module.out_features)
    return found


def matches(module_name: str, target: str) -> bool:
    """peft's rule for a listed target name: the whole module name, or its last dotted part(s)."""
    return module_name == target or module_name.endswith("." + target)


def unmatched_targets(targets: list[str], linear_names: list[str]) -> list[str]:
    """The listed targets that name no linear module of the model."""
    return [t for t in targets if not any(matches(name, t) for name in linear_names)]


def describe_linear_names(linear_names: list[str]) -> str:
    """The distinct last names of the linear modules (what target_modules lists), with one full name each."""
    examples: dict[str, str] = {}
    for name in linear_names:
        examples.setdefault(name.rsplit(".", 1)[-1], name)
    return ", ".join(f"{leaf} (e.g. {full})" for leaf, full in examples.items())


def check_targets(targets: list[str] | str, linear: Mapping[str, tuple[int, int]]) -> None:
    """Raise ConfigError naming ``model.lora.target_modules`` when a listed target matches no linear module."""
    names = list(linear)
    if not names:
        raise ConfigError("model.lora: the model has no linear layers besides its LM head, so LoRA has nothing to "
                          "adapt; turn it off with model.lora.r=0")
    if targets == ALL_LINEAR:
        return
    missing = unmatched_targets(list(targets), names)
    if missing:
        raise ConfigError(
            f"bad value {list(targets)!r} for 'model.lora.target_modules': {missing} match no linear module of the "
            f"model. Valid: '{ALL_LINEAR}', or names among its linear modules: {describe_linear_names(names)}"
        )


def adapter_module_shapes(path: str | Path) -> dict[str, tuple[int, int]]:
    """``{module name in the base model: (in_features, out_features)}`` an adapter folder was made for.

    Read from the adapter's tensor shapes only (no weights loaded): ``lora_A``
    is ``[r, in]`` and ``lora_B`` is ``[out, r]``; peft stores them under
    ``base_model.model.<module>.lora_A.weight``.
    """
    from safetensors import safe_open

    file = Path(path).expanduser() / ADAPTER_WEIGHTS_FILE
    shapes: dict[str, list[int | None]] = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                for part, index, dim in ((".lora_A.weight", 0, 1), (".lora_B.weight", 1, 0)):
                    if key.endswith(part):
                        module = key[: -len(part)].removeprefix("base_model.model.")
                        shapes.setdefault(module, [None, None])[index] = f.get_slice(key).get_shape()[dim]
    except Exception as exc:  # a truncated or foreign file
        raise ConfigError(f"bad value '{path}' for 'model.lora.path': cannot read {file}: {exc}") from exc
    return {name: (a, b) for name, (a, b) in shapes.items()}


def adapter_mismatches(adapter: Mapping[str, tuple[int, int]],
                       linear: Mapping[str, tuple[int, int]]) -> list[str]:
    """Why an adapter (see :func:`adapter_module_shapes`) does not fit a model's linear layers; empty if it fits."""
    problems = []
    for module, shape in adapter.items():
        if module not in linear:
            problems.append(f"{module} is not a linear module of the model")
        elif tuple(shape) != tuple(linear[module]):
            problems.append(f"{module} is (in, out) = {tuple(linear[module])} in the model but {tuple(shape)} "
                            f"in the adapter")
    return problems


def check_adapter_fits(path: str | Path, linear: Mapping[str, tuple[int, int]], model_desc: str) -> None:
    """Raise ConfigError naming ``model.lora.path`` when the adapter was made for another base model."""
    config = adapter_config(path)
    adapter = adapter_module_shapes(path)
    if not adapter:
        raise ConfigError(f"bad value '{path}' for 'model.lora.path': its {ADAPTER_WEIGHTS_FILE} holds no LoRA "
                          f"weights (lora_A / lora_B)")
    problems = adapter_mismatches(adapter, linear)
    if problems:
        shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
        raise ConfigError(
            f"bad value '{path}' for 'model.lora.path': the adapter was made for another base model "
            f"(adapter_config.json names base {config.get('base_model_name_or_path')!r}; this run's model is "
            f"{model_desc}): {shown}. Valid: an adapter trained on this model, or set model.path to the adapter's "
            f"base model"
        )



# --------------------------------------------------------------------------
# Adapters on the real model
# --------------------------------------------------------------------------

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
            task_type="CAUSAL_LM", bias="none", exclude_modules=vision_tower_pattern(model),
        )
        peft_model = peft.get_peft_model(model, config)
    if _checkpointing(model):
        # Checkpointed blocks whose inputs need no gradient (the embedding is frozen now) would
        # return outputs without a graph under reentrant checkpointing: the adapters inside them
        # would get no gradient. Marking the embedding output as requiring grad fixes that.
        peft_model.enable_input_require_grads()
    return peft_model


def vision_tower_pattern(model: nn.Module) -> str | None:
    """A VLM's vision tower as peft's ``exclude_modules`` regex (None for a text model): LoRA adapts the language
    model only, as verl and EasyR1 do; the tower stays as loaded (``model.freeze_vision_tower``)."""
    import re

    from rltk.models.vision.tower import vision_tower

    tower = vision_tower(model)
    if tower is None:
        return None
    name = next(name for name, module in model.named_modules() if module is tower)
    return re.escape(name) + r"(\..*)?"


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
    from torch import nn

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
    from torch import nn

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
    import torch
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


def merged_copy(model: nn.Module) -> nn.Module:
    """A plain (peft-free) copy of ``model`` with its adapters merged into the weights.

    For a PPO critic built from the policy's backbone, and for ``rltk export --merge``.
    ``model`` itself is left as it is.
    """
    return copy.deepcopy(peft_model_of(model)).merge_and_unload()
