"""Atomic, prunable training checkpoints that resume bit for bit.

A checkpoint is one folder ``<root>/step_000123/``::

    state.json           the recipe's JSON-able state (step, data position, ...)
    manifest.json        every other file of the checkpoint with its size in bytes
    rng/rank_00000.pt    RNG states of python, numpy, torch CPU and CUDA, and of the torch
                         generators the recipe hands over by name; one file per rank
    model/ optimizer.pt scheduler.pt strategy.json ...   written by the training strategy

It is written into a hidden sibling ``.tmp-step_000123``, flushed to disk
(fsync), and only then renamed to its final name: a folder named ``step_*``
is always complete, and a run killed mid-save leaves only a temporary folder
that :meth:`CheckpointManager.latest` ignores and the next save removes.

Nothing is unpickled freely on load (a run folder is data anyone may have
written): RNG states are tensors and plain numbers read by torch's restricted
unpickler, and :meth:`CheckpointManager.verify` checks every file before a
strategy reads it (:mod:`rltk.serialization`): a file that asks the unpickler
for anything but tensors, plain containers and the strategy's allow-listed
classes stops the run naming the file.

A checkpoint is *intact* when ``state.json`` and ``manifest.json`` parse, every
file the manifest lists is present with its recorded size, every ``.pt`` file's
pickle and zip directory read (memory-mapped: no tensor data is read), every
``.safetensors`` header covers its file exactly and every ``.json`` file
parses. :meth:`CheckpointManager.latest_intact` resumes from the newest intact
checkpoint, moving damaged newer ones aside with a warning that names the
damaged files.
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

from rltk.serialization import (
    CheckpointFileError,
    DamagedCheckpointError,
    check_file,
    check_json,
    torch_load,
)

if TYPE_CHECKING:
    from rltk.strategies.base import TrainingStrategy
    from rltk.strategies.layout import ParallelLayout

STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
RNG_DIR = "rng"
CHECKPOINT_PATTERN = re.compile(r"^step_(\d+)$")
TEMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".old-"
DAMAGED_PREFIX = "damaged-"  # a damaged checkpoint moved aside: kept for a look, never resumed or pruned
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


def saved_rank_of(layout: "ParallelLayout | None", rank: int, path: Path) -> int:
    """The rank whose RNG state ``rank`` (of a run laid out as ``layout``) resumes from ``path`` with: its own,
    unless the checkpoint was written at another layout (``strategy.json``'s world and sequence/tensor-parallel
    sizes) with as many data ranks, where it is the saved rank with the same data rank. A sequence or tensor
    group samples alike, and what the resumed run must repeat is each data rank's draws, wherever that rank now
    sits in the grid."""
    from rltk.strategies.base import STRATEGY_META_FILE

    try:
        meta = json.loads((path / STRATEGY_META_FILE).read_text())
    except (OSError, ValueError):
        return rank
    if layout is None:
        return rank
    group = int(meta.get("sequence_parallel_size", 1)) * int(meta.get("tensor_parallel_size", 1))
    world = int(meta.get("world_size", layout.world_size))
    if world // group != layout.data_world_size or (
            world == layout.world_size and group == layout.world_size // layout.data_world_size):
        return rank
    return layout.data_rank(rank) * group


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
# Integrity: what a checkpoint holds, and whether it still does
# --------------------------------------------------------------------------


def _write_manifest(folder: Path) -> None:
    """Record every file under ``folder`` with its size, so a truncated or missing file is found cheaply."""
    files = {path.relative_to(folder).as_posix(): path.stat().st_size
             for path in _files_under(folder) if path != folder / MANIFEST_FILE}
    payload = {"format_version": FORMAT_VERSION, "files": files}
    # No trailing newline: the text then ends with the object's closing brace, so every truncation of the
    # manifest (which lists every file but itself) fails to parse and is found.
    (folder / MANIFEST_FILE).write_text(json.dumps(payload, indent=2, sort_keys=True))


def _files_under(folder: Path) -> list[Path]:
    """Every regular file under ``folder``, sorted. os.walk skips a folder that vanishes while it is listed
    (another rank renaming a finished universal conversion into place), where rglob would raise."""
    found = []
    for dirpath, _, filenames in os.walk(folder):
        found += [Path(dirpath) / name for name in filenames if (Path(dirpath) / name).is_file()]
    return sorted(found)


def _read_manifest(path: Path) -> dict[str, int]:
    """``{relative path: size}`` from a manifest; :class:`DamagedCheckpointError` if it is not one."""
    payload = check_json(path)
    files = payload.get("files") if isinstance(payload, dict) else None
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                              for k, v in files.items()):
        raise DamagedCheckpointError(path, 'it does not hold {"files": {relative path: size in bytes}}')
    outside = [k for k in files if Path(k).is_absolute() or ".." in Path(k).parts]
    if outside:
        raise DamagedCheckpointError(path, f"it lists {outside[0]!r}, a path outside the checkpoint")
    return files


def read_state_file(checkpoint: str | Path) -> dict[str, Any]:
    """The payload of ``<checkpoint>/state.json`` (``format_version``, ``step``, ``world_size``, ``state``).

    Raises :class:`DamagedCheckpointError` naming the file if it is missing, not
    JSON, or lacks an integer ``step`` and a ``state`` object.
    """
    path = Path(checkpoint) / STATE_FILE
    payload = check_json(path)
    if not (isinstance(payload, dict) and isinstance(payload.get("step"), int) and not isinstance(payload["step"], bool)
            and isinstance(payload.get("state"), dict)):
        raise DamagedCheckpointError(path, 'it does not hold {"step": <int>, "state": {...}} as rltk writes it')
    return payload


def strategy_checkpoint_globals(strategy: Any) -> list[Any]:
    """The classes ``strategy``'s checkpoint files may pickle besides tensors and plain data (its
    ``checkpoint_globals()``, e.g. DeepSpeed's loss scaler); none for ``None`` or a strategy without one."""
    declared = getattr(strategy, "checkpoint_globals", None)
    return list(declared()) if callable(declared) else []


def damage_summary(damage: list[CheckpointFileError], root: Path) -> str:
    """``file (reason); file (reason)`` with paths relative to ``root``, for messages."""
    def name(path: Path) -> str:
        try:
            return path.relative_to(root).as_posix()
        except ValueError:
            return str(path)

    return "; ".join(f"{name(e.path)} ({e.reason})" for e in damage)


# --------------------------------------------------------------------------
# The manager
# --------------------------------------------------------------------------


class CheckpointManager:
    """Saves, finds, prunes and loads checkpoints under ``root``.

    Args:
        root: folder holding ``step_XXXXXX`` checkpoints (created on first save).
        keep_last: number of most recent checkpoints kept after each save
            (``None`` keeps all). Older ones are deleted, except those ``keep``
            says to keep.
        keep: ``keep(state) -> bool`` on a checkpoint's saved state: ``True`` keeps an
            older checkpoint whatever ``keep_last`` (the runs keep each stage's last
            checkpoint, so a later run can start from it: ``checkpoint.start_from``).

    Multi-process: every rank calls :meth:`save` and :meth:`load` with its
    strategy (the strategy's gathers are collective). Each rank writes its own
    RNG file, the main rank writes the rest and renames; ranks meet at barriers
    so nobody reads a half-written checkpoint. ``root`` must be a file system
    every rank sees.
    """

    def __init__(self, root: str | Path, *, keep_last: int | None = 3, keep=None):
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"CheckpointManager: keep_last={keep_last!r} must be an integer >= 1, or None to "
                             "keep every checkpoint.")
        self.root = Path(root)
        self.keep_last = keep_last
        self.keep = keep

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
            _write_manifest(temp)  # after the barrier: it lists every rank's files
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
            self.prune()
        self._barrier(strategy)
        return final

    def prune(self, keep: str | Path | None = None) -> list[Path]:
        """Delete all but the newest ``keep_last`` checkpoints and any interrupted save; returns what was deleted.

        Runs after every save and, from the main process, when a run starts: a
        run killed between a save and its prune leaves one checkpoint too many.
        Only rltk's own ``step_*`` folders and its temporary ``.tmp-*``/``.old-*``
        folders are touched; ``keep`` (the checkpoint a run resumes from) is
        never deleted. Do not call it while a save is in progress.
        """
        if not self.root.is_dir():
            return []
        removed = []
        for entry in self.root.iterdir():
            if entry.is_dir() and entry.name.startswith((TEMP_PREFIX, TRASH_PREFIX)):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
        if self.keep_last is None:
            return removed
        keep = Path(keep).resolve() if keep is not None else None
        for _, path in self.checkpoints()[: -self.keep_last]:
            if (keep is None or path.resolve() != keep) and not self._kept(path):
                shutil.rmtree(path)
                removed.append(path)
        return removed

    def _kept(self, path: Path) -> bool:
        """Whether ``keep`` says to keep ``path`` whatever ``keep_last`` (a state it cannot read: no)."""
        if self.keep is None:
            return False
        try:
            return bool(self.keep(read_state_file(path)["state"]))
        except Exception:  # a damaged state file is the integrity check's business, not the pruner's
            return False

    # ---------------------------------------------------------------- integrity

    def verify(self, path: str | Path, *, allowed_globals=()) -> list[DamagedCheckpointError]:
        """The damage found in checkpoint ``path``: an empty list means intact (see the module docstring).

        Every file is checked by its kind (:func:`rltk.serialization.check_file`)
        and, when the checkpoint has a manifest, against the size it was saved
        with. Files the save did not write (a universal checkpoint DeepSpeed
        converted on an earlier resume, or half of one a kill interrupted) are a
        cache, not the checkpoint: only their safety counts. ``allowed_globals``
        are the classes the strategy's files may pickle
        (:func:`strategy_checkpoint_globals`).

        Raises:
            UnsafeCheckpointError: a file asks the unpickler for anything else;
                that is tampering, not damage, and no fallback hides it.
        """
        path = Path(path)
        allowed = list(allowed_globals)
        damage: dict[Path, DamagedCheckpointError] = {}
        listed: dict[str, int] | None = None
        if (path / MANIFEST_FILE).is_file():
            try:
                listed = _read_manifest(path / MANIFEST_FILE)
            except DamagedCheckpointError as error:
                damage[error.path] = error
        try:
            read_state_file(path)
        except DamagedCheckpointError as error:
            damage[error.path] = error
        # The files found, and those listed: a symlinked folder is not walked into, but what a strategy
        # will read through it is listed.
        found = set(_files_under(path)) | {path / r for r in listed or {} if (path / r).is_file()}
        for file in sorted(found):
            relative = file.relative_to(path).as_posix()
            if relative in (MANIFEST_FILE, STATE_FILE):
                continue
            try:
                check_file(file, allowed_globals=allowed)  # UnsafeCheckpointError propagates
            except DamagedCheckpointError as error:
                if listed is None or relative in listed:
                    damage[file] = error
        for relative, size in (listed or {}).items():
            file = path / relative
            if file in damage:
                continue
            if not file.is_file():
                damage[file] = DamagedCheckpointError(file, "the file is missing; the checkpoint was saved with it")
            elif file.stat().st_size != size:
                damage[file] = DamagedCheckpointError(
                    file, f"it is {file.stat().st_size} bytes but was saved with {size} (truncated or replaced)")
        return sorted(damage.values(), key=lambda e: str(e.path))

    def latest_intact(self, *, allowed_globals=(), main_process: bool = True) -> Path | None:
        """The newest checkpoint :meth:`verify` finds intact, or ``None`` when there is no checkpoint.

        Damaged checkpoints newer than it are moved aside to
        ``damaged-step_XXXXXX`` by the main process, with a warning naming the
        damaged files: left in place they would count towards ``keep_last``
        and get the run's new checkpoints pruned instead. Other processes only
        read. If every checkpoint is damaged nothing is moved and
        :class:`DamagedCheckpointError` lists the damage: starting over would
        silently discard the run.

        Raises:
            UnsafeCheckpointError: from :meth:`verify`, for the newest checkpoint that holds one.
        """
        damaged: list[tuple[Path, list[DamagedCheckpointError]]] = []
        chosen = None
        for _, path in reversed(self.checkpoints()):
            damage = self.verify(path, allowed_globals=allowed_globals)
            if not damage:
                chosen = path
                break
            damaged.append((path, damage))
        if damaged and chosen is None:
            every = "; ".join(f"{path.name}: {damage_summary(damage, path)}" for path, damage in damaged)
            first = damaged[0][1][0]
            raise DamagedCheckpointError(first.path, first.reason, (
                f"every checkpoint under '{self.root}' is damaged, so there is nothing to resume: {every}. If the run "
                "folder was copied, copy it again; otherwise start over with checkpoint.resume=never (deletes them)."
            ))
        if main_process:
            for path, damage in damaged:
                aside = self._move_aside(path)
                warnings.warn(
                    f"checkpoint '{path}' is damaged: {damage_summary(damage, path)}. Resuming from the newest intact "
                    f"checkpoint, '{chosen}', instead; the damaged one was moved to '{aside}' (delete it once you "
                    "have looked at it).",
                    stacklevel=2,
                )
        return chosen

    def _move_aside(self, path: Path) -> Path:
        target = self.root / f"{DAMAGED_PREFIX}{path.name}"
        n = 1
        while target.exists():
            target = self.root / f"{DAMAGED_PREFIX}{path.name}.{n}"
            n += 1
        os.replace(path, target)
        _fsync_dir(self.root)
        return target

    # ---------------------------------------------------------------- loading

    def load(self, path: str | Path, strategy: TrainingStrategy | None, *,
             generators: Mapping[str, torch.Generator] | None = None) -> dict[str, Any]:
        """Restore ``strategy``, this rank's RNG and its ``generators`` (by the names they were saved
        under) from ``path``; return the saved ``state``.

        Call after ``strategy.setup(...)``. If the checkpoint was written with
        fewer ranks than run now, ranks without an RNG file keep their current
        RNG and a warning says so.

        Raises:
            UnsafeCheckpointError: a file holds pickled objects beyond tensors,
                plain data and the strategy's ``checkpoint_globals()``; nothing is loaded.
            DamagedCheckpointError: the checkpoint is not intact (:meth:`verify`).
        """
        path = Path(path)
        state_file = path / STATE_FILE
        if not state_file.is_file():
            raise FileNotFoundError(
                f"'{path}' is not a complete rltk checkpoint (no {STATE_FILE}). Complete checkpoints are the "
                f"step_XXXXXX folders under the checkpoint root; CheckpointManager.latest() finds the newest."
            )
        # Every file is checked before the strategy reads any: a refused or damaged file is named here
        # rather than deep inside a library's loader.
        damage = self.verify(path, allowed_globals=strategy_checkpoint_globals(strategy))
        if damage:
            raise DamagedCheckpointError(damage[0].path, damage[0].reason, (
                f"checkpoint '{path}' is damaged: {damage_summary(damage, path)}. Resume from another checkpoint "
                "(CheckpointManager.latest_intact() finds the newest intact one)."
            ))
        payload = read_state_file(path)
        if strategy is not None:
            strategy.load(path)
        rank = saved_rank_of(getattr(strategy, "layout", None), strategy.rank, path) if strategy is not None else 0
        rng_file = path / RNG_DIR / f"rank_{rank:05d}.pt"
        if rng_file.is_file():
            rng_state = torch_load(rng_file)
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
