"""The run viewer's server side: read a run folder's files as data, never run anything from it.

A run folder is read only through these parsers: ``metrics.jsonl`` and
``traces.jsonl`` line by line as JSON, ``summary.json`` as JSON, ``config.yaml``
as text. Nothing in it is imported, unpickled or executed (checkpoints are not
even opened). Run names are checked to be folders directly inside the runs
root, so a request cannot reach outside it.
"""

from __future__ import annotations

import json
from pathlib import Path

from rltk.loggers.jsonl import METRICS_FILE, TRACES_FILE, read_jsonl_metrics
from rltk.loggers.plot import training_curves

#: Columns of the step table, when logged (the rest of a step's metrics show on demand).
TABLE_KEYS = ("reward", "accuracy", "eval/accuracy", "eval/sampled_accuracy", "kl", "entropy", "pg_loss",
              "clip_fraction", "response_length", "sft/sft_loss", "sft/train_accuracy", "step_time")


class RunNotFound(LookupError):
    """A run name that is not a folder directly inside the runs root."""


def run_folder(root: Path, name: str) -> Path:
    """``root/name`` if it is a folder directly inside ``root`` (no ``..``, no links out of it)."""
    root = Path(root).resolve()
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise RunNotFound(f"no run named {name!r} in {root}")
    folder = (root / name).resolve()
    if folder.parent != root or not folder.is_dir():
        raise RunNotFound(f"no run named {name!r} in {root}")
    return folder


def list_runs(root: Path) -> list[dict]:
    """Every folder of ``root`` holding a ``metrics.jsonl`` or ``traces.jsonl``, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    runs = []
    for folder in root.iterdir():
        if not folder.is_dir() or folder.is_symlink():
            continue
        files = [folder / METRICS_FILE, folder / TRACES_FILE]
        present = [f for f in files if f.is_file()]
        if not present:
            continue
        runs.append({"name": folder.name, "modified": max(f.stat().st_mtime for f in present),
                     "finished": (folder / "summary.json").is_file(), "traces": (folder / TRACES_FILE).is_file()})
    return sorted(runs, key=lambda r: -r["modified"])


def run_overview(folder: Path) -> dict:
    """Curves (the panels of curves.png), the step table, the steps with traces, summary and config text."""
    metrics_file = folder / METRICS_FILE
    records = read_jsonl_metrics(metrics_file) if metrics_file.is_file() else []
    panels = training_curves(metrics_file) if metrics_file.is_file() else []
    keys = sorted({k for r in records for k in r if k != "step"})
    summary = None
    if (folder / "summary.json").is_file():
        try:
            summary = json.loads((folder / "summary.json").read_text())
        except json.JSONDecodeError:
            summary = None
    return {
        "name": folder.name,
        "panels": [{"title": p.title, "ylabel": p.ylabel,
                    "curves": [{"label": c.label, "steps": c.steps, "values": c.values, "faint": c.faint}
                               for c in p.curves]} for p in panels],
        "keys": keys,
        "table_keys": [k for k in TABLE_KEYS if k in keys],
        "rows": records,
        "trace_steps": trace_steps(folder),
        "summary": summary,
        "config": (folder / "config.yaml").read_text() if (folder / "config.yaml").is_file() else "",
        "finished": summary is not None,
    }


def trace_steps(folder: Path) -> dict[int, int]:
    """``{global step: trajectories traced}`` of the run's traces file."""
    counts: dict[int, int] = {}
    path = folder / TRACES_FILE
    if not path.is_file():
        return counts
    with open(path, encoding="utf-8") as f:
        for line in f:
            # the step is the record's first key: read it without parsing a whole (long) line
            if line.startswith('{"step": '):
                digits = line[9:line.find(",", 9)]
                if digits.isdigit():
                    counts[int(digits)] = counts.get(int(digits), 0) + 1
    return counts


def step_traces(folder: Path, step: int) -> list[dict]:
    """The traced trajectories of global step ``step``."""
    from rltk.training.scaffold.traces import read_traces  # imports torch: loaded when a traced step is opened

    return read_traces(folder / TRACES_FILE, step=step)
