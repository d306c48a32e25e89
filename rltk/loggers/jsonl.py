"""Logger ``jsonl``: one JSON object per step in ``<run_dir>/metrics.jsonl``.

Each line is ``{"step": 12, "reward": 0.43, ...}``; NaN and infinities are
written as ``null`` so every line is strict JSON (``jq``, pandas, browsers).
A line is flushed as soon as it is written, so a killed run keeps every step
it logged. On resume, lines after the checkpoint's step are dropped first, so
the file holds each step once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rltk.loggers.base import Logger, as_path, finite_or_none, scalar_metrics

METRICS_FILE = "metrics.jsonl"
#: The sampled trajectories of a run folder (written by :mod:`rltk.training.scaffold.traces`), named here beside
#: the metrics so that what reads a run folder as data (the dashboard) finds both without importing torch.
TRACES_FILE = "traces.jsonl"


def read_jsonl_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics file, skipping blank and malformed lines (e.g. a line cut by a kill)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


class JsonlLogger(Logger):
    """Appends ``{"step": step, **metrics}`` lines to ``run_dir/metrics.jsonl``.

    Args:
        run_dir: the run folder (created if missing).
        config, total_steps: accepted for the common logger signature; unused.
        resume_step: when resuming from a checkpoint of this step, lines with a
            larger step (logged after that checkpoint by the interrupted run) are
            removed before appending.
        filename: file name inside ``run_dir``.
    """

    def __init__(self, *, run_dir: str | Path, config: dict | None = None, total_steps: int | None = None,
                 resume_step: int | None = None, filename: str = METRICS_FILE):
        self.path = as_path(run_dir, "jsonl") / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = None
        if resume_step is not None:
            self.truncate_after(resume_step)
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Append one line; ``step`` comes first and wins over a ``"step"`` key in ``metrics``."""
        values = {k: finite_or_none(v) for k, v in scalar_metrics(metrics).items() if k != "step"}
        self._file.write(json.dumps({"step": int(step), **values}, allow_nan=False) + "\n")
        self._file.flush()

    def truncate_after(self, step: int, *, keep_at_step: int | None = None) -> int:
        """Drop lines whose step is greater than ``step`` (and malformed lines); returns how many were dropped.

        ``keep_at_step`` also drops the lines *at* ``step`` after the first
        ``keep_at_step`` of them: at a stage boundary the next stage logs its
        opening evaluation at the step of the previous stage's last checkpoint,
        after that checkpoint, and a run resumed from it logs that row again.
        The file is rewritten beside itself and renamed over the original, so a
        crash here cannot lose the lines that are kept.
        """
        reopen = self._file is not None and not self._file.closed
        if reopen:  # the rename below replaces the file our handle points to
            self._file.close()
        try:
            return self._drop_lines_after(step, keep_at_step)
        finally:
            if reopen:
                self._file = open(self.path, "a", encoding="utf-8")

    def _drop_lines_after(self, step: int, keep_at_step: int | None = None) -> int:
        if not self.path.exists():
            return 0
        lines = self.path.read_text(encoding="utf-8").splitlines()
        kept, at_step = [], 0
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            line_step = record.get("step") if isinstance(record, dict) else None
            if isinstance(line_step, (int, float)) and line_step > step:
                continue
            if line_step == step:
                at_step += 1
                if keep_at_step is not None and at_step > keep_at_step:
                    continue
            kept.append(line)
        temp = self.path.with_name(self.path.name + ".tmp")
        temp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(temp, self.path)
        return len(lines) - len(kept)

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()
