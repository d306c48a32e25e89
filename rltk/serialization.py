"""Reading checkpoint files without running code, and telling intact files from damaged ones.

A run folder is ordinary data: it is copied between machines and synced from
buckets, so anyone who can write to it chooses the bytes rltk reads back.
Python's pickle runs whatever a file asks for, which is why nothing here ever
unpickles freely:

* :func:`torch_load` reads a ``.pt`` file with torch's restricted
  (``weights_only``) unpickler, which builds tensors, plain containers and
  numbers and nothing else, plus an explicit allow-list of classes a strategy
  declares (DeepSpeed's loss scaler, its ZeRO stage enum). A file asking for
  anything else is refused with :class:`UnsafeCheckpointError` naming the file.
* :func:`weights_only_everywhere` extends that guarantee to libraries that
  call ``torch.load(..., weights_only=False)`` themselves (DeepSpeed 0.19 does,
  in every checkpoint reader): while it is active, every ``torch.load`` in the
  process is restricted the same way.
* :func:`check_file` decides cheaply whether one file is intact: a ``.pt``
  file is opened memory-mapped (its pickle is parsed by the restricted
  unpickler, its tensor data is not read), a ``.safetensors`` file's header
  must describe exactly the bytes on disk, a ``.json`` file must parse.

This module is the lowest layer of checkpointing: it imports torch and
safetensors, nothing of rltk.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

#: torch reads this variable on every ``torch.load`` call; "1" turns every load into a weights-only one,
#: including calls that pass ``weights_only=False`` explicitly.
FORCE_WEIGHTS_ONLY_VARIABLE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
_REFUSED_GLOBAL = re.compile(r"GLOBAL (\S+)")
_IMPORTING_OPCODES = ("GLOBAL", "STACK_GLOBAL", "INST", "OBJ", "REDUCE", "NEWOBJ", "NEWOBJ_EX")
_SCANNED_BYTES = 64 << 20  # a foreign pickle's imports sit in its first bytes; never read a huge file whole


class CheckpointFileError(Exception):
    """A checkpoint file rltk will not use. ``path`` is the file, ``reason`` what is wrong with it."""

    def __init__(self, path: str | Path, reason: str, message: str | None = None):
        self.path = Path(path)
        self.reason = reason
        super().__init__(message or f"{self.path}: {reason}")


class UnsafeCheckpointError(CheckpointFileError):
    """A checkpoint file that holds pickled objects other than tensors, plain containers and the
    allow-listed classes: loading it could run code, so it is never loaded."""

    def __init__(self, path: str | Path, reason: str):
        super().__init__(path, reason, (
            f"refusing to load '{path}': {reason}. Unpickling it could run arbitrary code, and rltk loads "
            "checkpoint files only as tensors and plain data. rltk never writes such a file, so the run folder was "
            "tampered with or mixed with foreign files: delete this checkpoint (or start over with "
            "checkpoint.resume=never) unless you know where the file came from."
        ))


class DamagedCheckpointError(CheckpointFileError):
    """A checkpoint file that is truncated, unparseable, missing, or not the size it was saved with."""


def _pickle_imports(path: Path) -> list[str]:
    """What a bare pickle file asks to import or call, found by parsing its opcodes (nothing is executed).

    torch's restricted unpickler names a refused global in its zip format; for a
    file that is not a zip it may stop earlier at an opcode it does not know (a
    protocol-4 frame), so this tells a foreign pickle from garbage.
    """
    import pickletools

    with open(path, "rb") as f:
        data = f.read(_SCANNED_BYTES)
    found, strings = [], []
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if isinstance(arg, str):
                strings.append(arg)
            if opcode.name in ("GLOBAL", "INST"):
                found.append(str(arg).replace(" ", "."))
            elif opcode.name == "STACK_GLOBAL":
                found.append(".".join(strings[-2:]) if len(strings) >= 2 else "(a global)")
            elif opcode.name in _IMPORTING_OPCODES:
                found.append(f"({opcode.name} opcode)")
    except Exception:  # garbage after a while, or a pickle cut short: what was read so far counts
        pass
    named = [f for f in found if not f.startswith("(")]  # a call needs something named; name that
    return list(dict.fromkeys(named or found))


def _refusal(path: Path, error: pickle.UnpicklingError) -> CheckpointFileError:
    """Unsafe if the file asks for any import or call, damaged otherwise (e.g. text in a .pt file)."""
    match = _REFUSED_GLOBAL.search(str(error))
    if match:
        return UnsafeCheckpointError(path, f"it asks the unpickler for {match.group(1)}, which is not a tensor, a "
                                           "plain container or an allow-listed class")
    imports = [] if zipfile.is_zipfile(path) else _pickle_imports(path)
    if imports:
        return UnsafeCheckpointError(path, f"it is a pickle that asks for {', '.join(imports[:4])}, not tensors "
                                           "and plain data")
    # torch's first line is a generic "Weights only load failed."; the unpickler's own words come later.
    detail = next((line.strip() for line in str(error).splitlines() if line.startswith(("Unsupported", "Weights"))
                   and "load failed" not in line), "an unknown pickle opcode")
    return DamagedCheckpointError(path, f"it is not a readable torch file ({detail})")


def torch_load(path: str | Path, *, allowed_globals: Iterable[Any] = (), mmap: bool = False) -> Any:
    """``torch.load`` of ``path`` on CPU that never unpickles arbitrary objects.

    Only tensors, plain containers and numbers are built, plus instances of
    ``allowed_globals`` (classes or functions the caller vouches for: each must
    be harmless to call with whatever arguments a file supplies). With
    ``mmap=True`` tensor data stays on disk (cheap, for checking a file).

    Raises:
        UnsafeCheckpointError: the file asks for any other global (a pickled
            ``os.system``, a class of some module, ...). Nothing it asks for runs.
        DamagedCheckpointError: the file is missing, empty, truncated or not a
            torch file.
    """
    path = Path(path)
    if not path.is_file():
        raise DamagedCheckpointError(path, "the file is missing")
    try:
        with torch.serialization.safe_globals(list(allowed_globals)):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as error:
                if not (mmap and "mmap can only be used" in str(error)):
                    raise
                # Not torch's zip format (rltk and DeepSpeed never write another): read it the slow way,
                # still through the restricted unpickler, to tell a payload from garbage.
                return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise _refusal(path, error) from None
    except (RuntimeError, EOFError, KeyError, ValueError, OSError, IndexError, AttributeError, TypeError) as error:
        # Truncated zips fail in torch's reader ("failed finding central directory"), short or foreign
        # files in the legacy reader with whatever the first bytes happen to trip.
        raise DamagedCheckpointError(path, f"it is not a readable torch file ({_first_line(error)})") from None


def _first_line(error: BaseException) -> str:
    """``Type: first sentence`` of an error (torch's zip reader appends a paragraph of advice)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    cut = text.find(". ")
    text = text[: cut + 1] if cut > 0 else text
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


@contextlib.contextmanager
def weights_only_everywhere(allowed_globals: Iterable[Any] = ()) -> Iterator[None]:
    """While active, every ``torch.load`` in this process is a weights-only load allowing ``allowed_globals``.

    For library code that loads with ``weights_only=False`` itself (DeepSpeed's
    checkpoint engine, its universal-checkpoint converter and ``zero_to_fp32``):
    torch honours ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` over an explicit argument,
    and the allow-list goes through ``torch.serialization.safe_globals``. Both
    are process-wide, so a load in another thread meanwhile is restricted too
    (only ever stricter); both are restored on exit, nested uses included.
    A refused file raises ``pickle.UnpicklingError`` from inside the library;
    callers that want the file named check it first (:func:`check_torch_files`).
    """
    previous = os.environ.get(FORCE_WEIGHTS_ONLY_VARIABLE)
    os.environ[FORCE_WEIGHTS_ONLY_VARIABLE] = "1"
    try:
        with torch.serialization.safe_globals(list(allowed_globals)):
            yield
    finally:
        if previous is None:
            os.environ.pop(FORCE_WEIGHTS_ONLY_VARIABLE, None)
        else:
            os.environ[FORCE_WEIGHTS_ONLY_VARIABLE] = previous


def check_safetensors(path: str | Path) -> None:
    """Raise :class:`DamagedCheckpointError` unless ``path``'s header parses and covers exactly the file.

    safetensors validates that every tensor's byte range lies inside the file and
    that the ranges cover it to the last byte, so a truncated or extended file
    fails here; the tensor data is memory-mapped, not read.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise DamagedCheckpointError(path, "the file is missing")
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, OSError) as error:
        raise DamagedCheckpointError(path, f"it is not a complete safetensors file ({_first_line(error)})") from None


def check_json(path: str | Path) -> Any:
    """The parsed content of ``path``; :class:`DamagedCheckpointError` if it is missing or not valid JSON."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DamagedCheckpointError(path, "the file is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as error:
        raise DamagedCheckpointError(path, f"it is not valid JSON ({_first_line(error)})") from None


def check_file(path: str | Path, *, allowed_globals: Iterable[Any] = ()) -> None:
    """Raise unless ``path`` is intact by its kind: ``.pt``/``.pth``/``.bin`` (:func:`torch_load`, memory-mapped),
    ``.safetensors`` (:func:`check_safetensors`), ``.json`` (:func:`check_json`). Other files are not parsed."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".pt", ".pth", ".bin"):
        torch_load(path, allowed_globals=allowed_globals, mmap=True)
    elif suffix == ".safetensors":
        check_safetensors(path)
    elif suffix == ".json":
        check_json(path)
    elif not path.is_file():
        raise DamagedCheckpointError(path, "the file is missing")


def check_torch_files(folder: str | Path, *, allowed_globals: Iterable[Any] = ()) -> None:
    """:func:`check_file` on every torch file under ``folder``: the first refused or damaged one raises.

    Cheap (memory-mapped, no tensor data read); a strategy calls it before
    handing a folder to a library that loads it, so a bad file is named.
    """
    allowed = list(allowed_globals)
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file() and path.suffix.lower() in (".pt", ".pth", ".bin"):
            check_file(path, allowed_globals=allowed)
