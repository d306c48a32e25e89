"""Atomic, prunable training checkpoints that resume bit for bit.

A checkpoint is one folder ``<root>/step_000123/``::

    state.json           the recipe's JSON-able state (step, data position, ...)
    rng/rank_00000.pt    RNG states of python, numpy, torch CPU and CUDA, and of the torch
                         generators the recipe hands over by name; one file per rank
    model/ optimizer.pt scheduler.pt strategy.json ...   written by the training strategy

It is written into a hidden sibling ``.tmp-step_000123``, flushed to disk
(fsync), and only then renamed to its final name: a folder named ``step_*``
is always complete, and a run killed mid-save leaves only a temporary folder
that :meth:`CheckpointManager.latest` ignores and the next save removes.

Nothing is unpickled on load: RNG states are stored as tensors and plain
numbers and read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from rltk.strategies.base import TrainingStrategy

STATE_FILE = "state.json"
RNG_DIR = "rng"
CHECKPOINT_PATTERN = re.compile(r"^step_(\d+)$")
TEMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".old-"
FORMAT_VERSION = 1


# --------------------------------------------------------------------------
# RNG state as tensors (weights_only-loadable)
# --------------------------------------------------------------------------


def capture_rng_state(generators: Mapping[str, torch.Generator] | None = None) -> dict[str, Any]:
    """This process's RNG states of python ``random``, numpy's global generator, torch CPU and CUDA,
    and of each ``torch.Generator`` in ``generators`` (under ``"generators"``, by name).

    Every value is a tensor, an int, a float, a string or ``None``, so the dict
    round-trips through ``torch.save`` / ``torch.load(weights_only=True)``.
    Other generators owned by user code (``np.random.Generator``) are not
    global and must be saved by whoever owns them. A private generator must be
    restored, not seeded again on resume: re-seeding replays draws the
    uninterrupted run had already consumed.
    """
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    return {
        "python_version": int(py_version),
        "python_state": torch.tensor(py_state, dtype=torch.int64),  # 624 words + position
        "python_gauss": py_gauss,
        "numpy_kind": str(np_kind),
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "generators": {name: generator.get_state() for name, generator in (generators or {}).items()},
    }


def restore_rng_state(state: dict[str, Any], generators: Mapping[str, torch.Generator] | None = None) -> None:
    """Inverse of :func:`capture_rng_state`: the next random draws equal those after the capture.

    Each generator in ``generators`` takes the state captured under its name;
    a name the capture does not hold is a ``KeyError`` naming the ones it does.
    """
    saved = state.get("generators") or {}
    missing = sorted(set(generators or {}) - set(saved))
    if missing:
        raise KeyError(f"the saved RNG state holds no generator(s) {missing} (it holds {sorted(saved)}); it was "
                       "captured without them, so their draws cannot continue where they stopped")
    random.setstate((state["python_version"], tuple(int(x) for x in state["python_state"].tolist()),
                     state["python_gauss"]))
    np.random.set_state((state["numpy_kind"], state["numpy_keys"].numpy().astype(np.uint32),
                         state["numpy_pos"], state["numpy_has_gauss"], state["numpy_gauss"]))
    torch.set_rng_state(state["torch_cpu"])
    cuda_states = state.get("torch_cuda") or []
    if cuda_states and torch.cuda.is_available():
        devices = min(len(cuda_states), torch.cuda.device_count())
        for device in range(devices):
            torch.cuda.set_rng_state(cuda_states[device], device)
    for name, generator in (generators or {}).items():
        generator.set_state(saved[name])


# --------------------------------------------------------------------------
# Durability helpers
# --------------------------------------------------------------------------


def default_file_mode() -> int:
    """The mode ``open()`` gives a new file in this process: ``0o666`` less the umask (0644 under umask 022)."""
    try:  # Linux reports the umask without changing it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere reading it means setting it; put it straight back
    os.umask(mask)
    return 0o666 & ~mask


def give_default_mode(paths) -> None:
    """Set every file in ``paths`` to :func:`default_file_mode`.

    safetensors writes its files with mode 0600, so a model folder came out
    with ``model.safetensors`` readable by its owner alone beside 0644 config
    files: a checkpoint or export shared with a group, or served by another
    user, failed on the weights only. rltk's files follow the umask like any other.
    """
    mode = default_file_mode()
    for path in paths:
        os.chmod(path, mode)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    # A directory fsync makes renames and new entries durable; not every OS/filesystem allows it.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_file(Path(dirpath) / name)
        _fsync_dir(Path(dirpath))


def _first_unserializable(obj: Any, path: str = "state") -> str | None:
    """The key path of the first value ``json.dumps`` rejects, e.g. ``state['data']['order']``."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                return f"{path} (key {key!r} of type {type(key).__name__})"
            found = _first_unserializable(value, f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            found = _first_unserializable(value, f"{path}[{i}]")
            if found:
                return found
        return None
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return None
    return f"{path} = {type(obj).__name__}"


# --------------------------------------------------------------------------
# The manager
# --------------------------------------------------------------------------


class CheckpointManager:
    """Saves, finds, prunes and loads checkpoints under ``root``.

    Args:
        root: folder holding ``step_XXXXXX`` checkpoints (created on first save).
        keep_last: number of most recent checkpoints kept after each save
            (``None`` keeps all). Older ones are deleted.

    Multi-process: every rank calls :meth:`save` and :meth:`load` with its
    strategy (the strategy's gathers are collective). Each rank writes its own
    RNG file, the main rank writes the rest and renames; ranks meet at barriers
    so nobody reads a half-written checkpoint. ``root`` must be a file system
    every rank sees.
    """

    def __init__(self, root: str | Path, *, keep_last: int | None = 3):
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"CheckpointManager: keep_last={keep_last!r} must be an integer >= 1, or None to "
                             "keep every checkpoint.")
        self.root = Path(root)
        self.keep_last = keep_last

    # ---------------------------------------------------------------- finding

    def path_for(self, step: int) -> Path:
        """The folder of the checkpoint for ``step``: ``root/step_000123``."""
        return self.root / f"step_{step:06d}"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as ``(step, path)``, oldest first.

        Temporary folders of an interrupted save and folders without
        ``state.json`` are not checkpoints.
        """
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = CHECKPOINT_PATTERN.match(path.name)
            if match and path.is_dir() and (path / STATE_FILE).is_file():
                found.append((int(match.group(1)), path))
        return sorted(found)

    def latest(self) -> Path | None:
        """The complete checkpoint with the highest step, or ``None``."""
        found = self.checkpoints()
        return found[-1][1] if found else None

    # ---------------------------------------------------------------- saving

    def save(self, step: int, strategy: TrainingStrategy | None, state: dict[str, Any], *,
             generators: Mapping[str, torch.Generator] | None = None) -> Path:
        """Write the checkpoint for ``step`` atomically and prune old ones; returns its path.

        ``state`` is the recipe's JSON-able dict (step, data position, metric
        history, ...); :meth:`load` returns it unchanged. ``strategy`` may be
        ``None`` to save only state and RNG. ``generators`` are this rank's
        private ``torch.Generator`` objects by name (e.g. mini-batch shuffling),
        saved beside its global RNG state; pass the same names to :meth:`load`.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"CheckpointManager.save(): step={step!r} must be an integer >= 0.")
        if not isinstance(state, dict):
            raise TypeError(f"CheckpointManager.save(): state must be a dict, got {type(state).__name__}.")
        bad = _first_unserializable(state)
        if bad:
            raise TypeError(
                f"CheckpointManager.save(): {bad} is not JSON-serialisable; checkpoint state must hold only "
                "dicts, lists, strings, numbers, booleans and None (convert tensors with .tolist() or .item())."
            )
        rank, world_size = (strategy.rank, strategy.world_size) if strategy is not None else (0, 1)
        is_main = rank == 0
        final = self.path_for(step)
        temp = self.root / f"{TEMP_PREFIX}{final.name}"

        if is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            if temp.exists():  # left by a save killed part-way
                shutil.rmtree(temp)
            temp.mkdir()
        self._barrier(strategy)

        if strategy is not None:
            strategy.save(temp)
        rng_file = temp / RNG_DIR / f"rank_{rank:05d}.pt"
        rng_file.parent.mkdir(parents=True, exist_ok=True)
        torch.save(capture_rng_state(generators), rng_file)
        _fsync_file(rng_file)
        if is_main:
            payload = {"format_version": FORMAT_VERSION, "step": step, "world_size": world_size, "state": state}
            (temp / STATE_FILE).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
        self._barrier(strategy)  # every rank's RNG file is on disk

        if is_main:
            _fsync_tree(temp)
            if final.exists():  # saving a step again (e.g. after resuming from an earlier one)
                trash = self.root / f"{TRASH_PREFIX}{final.name}"
                if trash.exists():
                    shutil.rmtree(trash)
                os.replace(final, trash)
                os.replace(temp, final)
                shutil.rmtree(trash)
            else:
                os.replace(temp, final)
            _fsync_dir(self.root)
            self._prune()
        self._barrier(strategy)
        return final

    def _prune(self) -> None:
        for entry in self.root.iterdir():
            if entry.is_dir() and entry.name.startswith((TEMP_PREFIX, TRASH_PREFIX)):
                shutil.rmtree(entry, ignore_errors=True)
        if self.keep_last is None:
            return
        for _, path in self.checkpoints()[: -self.keep_last]:
            shutil.rmtree(path)

    # ---------------------------------------------------------------- loading

    def load(self, path: str | Path, strategy: TrainingStrategy | None, *,
             generators: Mapping[str, torch.Generator] | None = None) -> dict[str, Any]:
        """Restore ``strategy``, this rank's RNG and its ``generators`` (by the names they were saved
        under) from ``path``; return the saved ``state``.

        Call after ``strategy.setup(...)``. If the checkpoint was written with
        fewer ranks than run now, ranks without an RNG file keep their current
        RNG and a warning says so.
        """
        path = Path(path)
        state_file = path / STATE_FILE
        if not state_file.is_file():
            raise FileNotFoundError(
                f"'{path}' is not a complete rltk checkpoint (no {STATE_FILE}). Complete checkpoints are the "
                f"step_XXXXXX folders under the checkpoint root; CheckpointManager.latest() finds the newest."
            )
        payload = json.loads(state_file.read_text())
        if strategy is not None:
            strategy.load(path)
        rank = strategy.rank if strategy is not None else 0
        rng_file = path / RNG_DIR / f"rank_{rank:05d}.pt"
        if rng_file.is_file():
            rng_state = torch.load(rng_file, map_location="cpu", weights_only=True)
            generators = dict(generators or {})
            absent = sorted(set(generators) - set(rng_state.get("generators") or {}))
            if absent:  # written before the recipe handed these over (an older rltk)
                warnings.warn(
                    f"checkpoint '{path}' holds no state for the generator(s) {absent} of rank {rank}; they keep "
                    "their current state, so the resumed run is not bitwise the uninterrupted one.",
                    stacklevel=2,
                )
                generators = {name: g for name, g in generators.items() if name not in absent}
            restore_rng_state(rng_state, generators)
        else:
            warnings.warn(
                f"checkpoint '{path}' has no RNG state for rank {rank} (it was saved by "
                f"{payload.get('world_size')} process(es)); this rank continues with its current RNG, so the "
                "resumed run is not bitwise reproducible.",
                stacklevel=2,
            )
        return payload["state"]

    @staticmethod
    def _barrier(strategy: TrainingStrategy | None) -> None:
        if strategy is not None:
            strategy.barrier()
