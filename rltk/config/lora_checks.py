"""Checks of ``model.lora``: its values, and whether it fits the model the run would build.

Two layers, both run by ``rltk validate`` and at the start of ``rltk run``:

* :func:`check_lora_values`: the section on its own (rank, alpha, dropout,
  the shape of ``target_modules``, that ``path`` is an adapter folder).
* :func:`check_lora_fits_model`: the targets and the adapter folder against
  the model's own modules. The model is built without weights (``meta``
  device) from ``model.path``'s config.json, or the embedded tiny model is
  built outright (it is tiny), so checking a 70B config costs no memory.

The matching rules (:func:`unmatched_targets`, :func:`adapter_mismatches`) are
plain functions of module names and shapes; :mod:`rltk.models.lora` applies
the same ones to the real model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, ListConfig, OmegaConf

from rltk.config.errors import ConfigError

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


def check_lora_values(cfg: DictConfig) -> None:
    """``model.lora`` on its own: rank, alpha, dropout, targets, adapter folder. Raises ConfigError."""
    lora = cfg.model.lora
    r = lora.r
    if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
        raise ConfigError(
            f"bad value {r!r} for 'model.lora.r': the adapter rank must be a positive integer (e.g. 8, 16, 64), "
            f"or 0/null for no LoRA"
        )
    if not lora_enabled(lora):
        return
    alpha = lora.alpha
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ConfigError(f"bad value {alpha!r} for 'model.lora.alpha': must be a number > 0 (the adapter output "
                          f"is scaled by alpha / r; alpha = 2 r is common)")
    dropout = lora.dropout
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ConfigError(f"bad value {dropout!r} for 'model.lora.dropout': must be a number in [0, 1)")
    target_list(lora.target_modules)
    if lora.path:
        adapter_config(lora.path)


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


def check_no_stage_lora(index: int, name: str, overrides: Any) -> None:
    """Refuse ``model.lora`` in a stage's overrides: the model and its adapter are built once per run.

    Every stage trains the same adapter (a warm-up hands its adapter to the RL
    stage), and resuming rebuilds the base from the run's config; a stage with
    LoRA of its own would need its starting weights kept beside the checkpoints.
    """
    keys = OmegaConf.to_container(overrides, resolve=False) if isinstance(overrides, DictConfig) else dict(overrides)
    for key, value in keys.items():
        touches = key == "model.lora" or key.startswith("model.lora.") or (
            key == "model" and isinstance(value, dict) and "lora" in value)
        if touches:
            raise ConfigError(
                f"stages[{index}].overrides (stage '{name}') sets '{key}': model.lora applies to the whole run (every "
                f"stage trains the same adapter). Set model.lora.* at the top level; to warm up with full weights and "
                f"then train an adapter, run the warm-up alone, `rltk export` it, and start the LoRA run from it with "
                f"model.path=<exported folder>"
            )


# ---------------------------------------------------------------- matching against a model


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


def model_skeleton(cfg: DictConfig):
    """The model the run would build, without weights where that matters: ``meta`` tensors from
    ``model.path``'s config.json, or the (tiny) embedded model itself."""
    if cfg.model.path:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            config = AutoConfig.from_pretrained(str(Path(cfg.model.path).expanduser()), local_files_only=True)
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config)
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"bad value '{cfg.model.path}' for 'model.path': cannot read its config.json as a "
                              f"causal LM to check model.lora against it: {exc}") from exc
    from rltk.models.tiny import build_tiny_from_config

    return build_tiny_from_config(cfg.model.tiny, cfg.seed)[1]


def model_description(cfg: DictConfig) -> str:
    """How a message names the run's base model."""
    return f"model.path='{cfg.model.path}'" if cfg.model.path else "the embedded tiny model (model.path null)"


def check_lora_fits_model(cfg: DictConfig) -> None:
    """``model.lora.target_modules`` and ``model.lora.path`` against the modules of the run's model."""
    lora = cfg.model.lora
    if not lora_enabled(lora):
        return
    try:
        linear = linear_modules(model_skeleton(cfg))
    except ValueError as exc:  # the tiny model's own shape rules (e.g. hidden_size vs num_heads)
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"model.tiny: {exc}") from exc
    if lora.path:
        check_adapter_fits(lora.path, linear, model_description(cfg))
    else:
        check_targets(target_list(lora.target_modules), linear)
