"""File I/O every layer may use: the mode rltk gives the files it writes, and the check of a local model folder."""

from __future__ import annotations

import os
from pathlib import Path


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


def model_folder_problem(path: str | Path, expected: str) -> str | None:
    """What keeps the local ``path`` from being a model folder holding ``expected``, in words that follow
    ``<key>='<path>': `` (None when it is a folder). rltk loads models from local folders only; config validation
    and the loaders ask this one question, so a run refused before it starts says what the loader would."""
    folder = Path(path).expanduser()
    if not folder.exists():
        return ("the folder does not exist. rltk loads models from local folders only (nothing is downloaded): "
                "download one first, e.g. `huggingface-cli download <repo> --local-dir <folder>`, and give that folder")
    if not folder.is_dir():
        return f"it is a file, not a model folder (expected {expected})"
    return None


def node_work_dir(settings_work_dir: str | None) -> str:
    """The folder a Ray actor of a run (a producer, a reward service) works in on its own node:
    ``launcher_args.work_dir``, else ``$RLTK_RAY_WORK_DIR`` as that node's environment sets it, else
    ``<tmp>/rltk-ray``. Evaluated on the actor's node."""
    import tempfile

    return settings_work_dir or os.environ.get("RLTK_RAY_WORK_DIR") or os.path.join(tempfile.gettempdir(), "rltk-ray")
