"""How the rollout engine follows the weights training changes: shared, copied, or loaded.

Weights across stages. ``run.policy`` is the policy between stages: a plain
module. A stage builds its strategy on it, and :func:`connect_rollout_engine`
points the rollout engine at the weights the stage trains (the module itself,
or a whole copy of the engine's own when the strategy shards parameters, as
ZeRO-3 does). When the stage ends, the trained module comes back from the
strategy and :func:`engine_follows` points the engine at it.
"""

from __future__ import annotations

from torch import nn


def connect_rollout_engine(engine, strategy) -> None:
    """Make ``engine`` sample from the weights ``strategy`` trains. Collective if it shards parameters.

    An engine that can sample from a module (``hf``) shares the trainer's
    module, so an optimizer step needs no copy. A strategy that shards
    parameters (ZeRO-3) makes every forward of that module a collective: ranks
    would have to generate in lockstep and an evaluation on one rank would
    hang, so the engine gets a whole copy of its own instead, refreshed by
    ``engine.update_weights(strategy.unwrap())`` after each optimizer step.
    Engines with weights of their own (``vllm``) load the full weights.
    """
    if engine.samples_from_module:
        engine.use_model(strategy.full_model_copy() if strategy.shards_parameters else strategy.unwrap())
    else:
        engine.update_weights(strategy.export_state_dict())


def engine_follows(engine, policy: nn.Module) -> None:
    """Point the rollout ``engine`` at ``policy``, a plain module (between stages)."""
    if engine.samples_from_module:
        engine.use_model(policy)
    else:
        engine.update_weights(policy)


# ---------------------------------------------------------------- weights for another process

#: The safetensors metadata key that holds the policy version of a weights file.
VERSION_KEY = "rltk_policy_version"


def write_weights_file(module: nn.Module, path, version: int) -> None:
    """Save ``module``'s weights to ``path`` as policy ``version``, atomically.

    Written beside the target and renamed over it, so a reader (an
    asynchronous run's producer process) sees the old file or the new one,
    never half of one; a reader that opened the old file keeps reading it.
    Shared tensors (tied embeddings) are stored once.
    """
    import os
    from pathlib import Path

    from safetensors.torch import save_model

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_model(module, str(tmp), metadata={VERSION_KEY: str(int(version))})
    os.replace(tmp, path)


def write_weights_state(state: dict, path, version: int) -> None:
    """:func:`write_weights_file` for full weights given as a state dict (a sharded strategy's
    ``full_state_dict()``): tensors that share storage (tied embeddings) are stored once each as copies."""
    import os
    from pathlib import Path

    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    seen: set[int] = set()
    tensors = {}
    for name, tensor in state.items():
        tensor = tensor.detach().contiguous()
        if tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        tensors[name] = tensor
    save_file(tensors, str(tmp), metadata={VERSION_KEY: str(int(version))})
    os.replace(tmp, path)


def weights_file_version(path) -> int | None:
    """The policy version of the weights file at ``path``; None when there is none yet."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return int(f.metadata()[VERSION_KEY])
    except FileNotFoundError:
        return None


def read_weights_file(module: nn.Module, path) -> int:
    """Load the weights file at ``path`` (:func:`write_weights_file`) into ``module``; returns its version.

    The version and the tensors come from one open file, so they match even if
    the trainer renames a newer file over ``path`` meanwhile.
    """
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        version = int(f.metadata()[VERSION_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    load_weights_state(module, tensors, f"weights file {path}")
    return version


def load_weights_state(module: nn.Module, tensors: dict, source: str) -> None:
    """Load full weights given as a state dict (``tensors``, from ``source``, named in errors) into ``module``.

    Tied weights may come once (a weights file stores shared tensors once): a key missing from ``tensors``
    is accepted only when its parameter shares storage with a loaded one.
    """
    missing, unexpected = module.load_state_dict(tensors, strict=False)
    state = module.state_dict(keep_vars=True)
    loaded = {p.data_ptr() for k, p in state.items() if k in tensors}
    really_missing = [k for k in missing if state[k].data_ptr() not in loaded]
    if really_missing or unexpected:
        raise RuntimeError(f"{source}: does not match the model (missing {really_missing[:5]}, "
                           f"unexpected {list(unexpected)[:5]})")
