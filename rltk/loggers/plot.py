"""A PNG of training curves from ``metrics.jsonl``, drawn off-screen (matplotlib Agg).

The figure is built with ``matplotlib.figure.Figure`` and the Agg canvas
directly, never through ``pyplot``, so calling it from a notebook or a training
script neither opens windows nor changes the user's global backend.
"""

from __future__ import annotations

import math
from pathlib import Path

from rltk.loggers.jsonl import read_jsonl_metrics

DEFAULT_KEYS = ("reward", "eval/accuracy")


def metric_series(metrics_jsonl: str | Path, keys: tuple[str, ...] | list[str]) -> dict[str, tuple[list[int], list[float]]]:
    """``{key: (steps, values)}`` for each key present, sorted by step.

    A step logged twice (a resumed run that did not truncate) keeps its last
    value; ``null`` and non-numeric values are skipped; keys never logged are
    absent from the result.
    """
    by_key: dict[str, dict[int, float]] = {key: {} for key in keys}
    for record in read_jsonl_metrics(metrics_jsonl):
        step = record.get("step")
        if not isinstance(step, (int, float)):
            continue
        for key in keys:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                by_key[key][int(step)] = float(value)
    return {
        key: (sorted(points), [points[s] for s in sorted(points)])
        for key, points in by_key.items() if points
    }


def plot_metrics(metrics_jsonl: str | Path, out_png: str | Path,
                 keys: tuple[str, ...] | list[str] = DEFAULT_KEYS) -> list[str]:
    """Draw one subplot per key found in ``metrics_jsonl`` (steps on x) into ``out_png``.

    Missing keys are tolerated: they are left out, and if none is found the PNG
    says so instead of failing. Returns the keys that were plotted.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metrics_jsonl = Path(metrics_jsonl)
    if not metrics_jsonl.is_file():
        raise FileNotFoundError(f"plot_metrics: metrics file '{metrics_jsonl}' does not exist; the 'jsonl' logger "
                                "writes <run_dir>/metrics.jsonl.")
    series = metric_series(metrics_jsonl, keys)
    found = [key for key in keys if key in series]
    rows = max(1, len(found))
    figure = Figure(figsize=(7, 2.6 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, 1, squeeze=False, sharex=True)[:, 0]
    if not found:
        axes[0].text(0.5, 0.5, f"no values for {', '.join(keys)}\nin {metrics_jsonl.name}",
                     ha="center", va="center", transform=axes[0].transAxes)
        axes[0].set_axis_off()
    for ax, key in zip(axes, found):
        steps, values = series[key]
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_png, dpi=100)
    return found
