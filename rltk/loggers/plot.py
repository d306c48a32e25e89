"""PNGs of training curves from ``metrics.jsonl``, drawn off-screen (matplotlib Agg).

The figure is built with ``matplotlib.figure.Figure`` and the Agg canvas
directly, never through ``pyplot``, so calling it from a notebook or a training
script neither opens windows nor changes the user's global backend.

:func:`plot_training_curves` draws what a run's ``curves.png`` shows; the
numbers behind it come from :func:`training_curves`, which draws nothing, so
they can be checked (and reused) without an image. :func:`plot_metrics` draws
any list of keys, one panel each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from rltk.loggers.jsonl import read_jsonl_metrics

DEFAULT_KEYS = ("reward", "eval/accuracy")
SFT_LOSS_KEY = "sft/sft_loss"
REWARD_KEYS = ("reward", "reward/mean")  # the first one logged is the training reward
HELD_OUT_KEYS = {"greedy": "eval/accuracy", "sampled": "eval/sampled_accuracy"}
MAX_SMOOTHING_WINDOW = 50


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


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean: ``out[i] = mean(values[max(0, i - window + 1) : i + 1])``.

    The first ``window - 1`` points average what exists so far, so the line
    starts where the raw one does instead of ``window`` steps later.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"moving_average: window={window!r} must be an integer >= 1")
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def smoothing_window(points: int) -> int:
    """A tenth of the points (at most :data:`MAX_SMOOTHING_WINDOW`, at least 1): 20 for a 200-step run."""
    return max(1, min(MAX_SMOOTHING_WINDOW, round(points / 10)))


@dataclass
class Curve:
    """One line of a panel."""

    label: str
    steps: list[int]
    values: list[float]
    faint: bool = False  # raw values drawn under their smoothed line


@dataclass
class Panel:
    """One subplot: a title, a y label and its curves."""

    title: str
    ylabel: str
    curves: list[Curve] = field(default_factory=list)


def training_curves(metrics_jsonl: str | Path, smooth_window: int | None = None) -> list[Panel]:
    """The panels of a run's ``curves.png``, each present only when its metrics were logged.

    * ``warm-up (SFT) loss``: ``sft/sft_loss`` over the supervised steps.
    * ``train reward``: the reward of each RL step (noisy: a few prompts per
      step), faint, under its :func:`moving_average` over ``smooth_window``
      steps (default :func:`smoothing_window`); a window of 1 draws the raw line only.
    * ``held-out accuracy``: greedy (``eval/accuracy``) and one sample per
      prompt (``eval/sampled_accuracy``) at each evaluation.
    """
    series = metric_series(metrics_jsonl, [SFT_LOSS_KEY, *REWARD_KEYS, *HELD_OUT_KEYS.values()])
    panels = []
    if SFT_LOSS_KEY in series:
        panels.append(Panel("warm-up (SFT) loss", "loss", [Curve("sft loss", *series[SFT_LOSS_KEY])]))
    reward_key = next((k for k in REWARD_KEYS if k in series), None)
    if reward_key is not None:
        steps, values = series[reward_key]
        window = smooth_window if smooth_window is not None else smoothing_window(len(values))
        if window > 1:
            curves = [Curve("per step", steps, values, faint=True),
                      Curve(f"moving average ({window} steps)", steps, moving_average(values, window))]
        else:
            curves = [Curve("per step", steps, values)]
        panels.append(Panel("train reward", reward_key, curves))
    held_out = [Curve(label, *series[key]) for label, key in HELD_OUT_KEYS.items() if key in series]
    if held_out:
        panels.append(Panel("held-out accuracy", "accuracy", held_out))
    return panels


def plot_training_curves(metrics_jsonl: str | Path, out_png: str | Path, smooth_window: int | None = None) -> list[str]:
    """Draw :func:`training_curves` into ``out_png``, one panel above the other; returns the panel titles.

    Each panel keeps its own step axis: the warm-up and the RL stage cover
    different steps, and a shared axis would squeeze one of them into a corner.
    """
    metrics_jsonl = _existing(metrics_jsonl)
    panels = training_curves(metrics_jsonl, smooth_window)
    _draw(panels, out_png, empty=f"no training metrics in {metrics_jsonl.name}", sharex=False)
    return [panel.title for panel in panels]


def plot_metrics(metrics_jsonl: str | Path, out_png: str | Path,
                 keys: tuple[str, ...] | list[str] = DEFAULT_KEYS) -> list[str]:
    """Draw one subplot per key found in ``metrics_jsonl`` (steps on x) into ``out_png``.

    Missing keys are tolerated: they are left out, and if none is found the PNG
    says so instead of failing. Returns the keys that were plotted.
    """
    metrics_jsonl = _existing(metrics_jsonl)
    series = metric_series(metrics_jsonl, keys)
    found = [key for key in keys if key in series]
    panels = [Panel("", key, [Curve(key, *series[key])]) for key in found]
    _draw(panels, out_png, empty=f"no values for {', '.join(keys)}\nin {metrics_jsonl.name}", sharex=True)
    return found


def _existing(metrics_jsonl: str | Path) -> Path:
    metrics_jsonl = Path(metrics_jsonl)
    if not metrics_jsonl.is_file():
        raise FileNotFoundError(f"plot_metrics: metrics file '{metrics_jsonl}' does not exist; the 'jsonl' logger "
                                "writes <run_dir>/metrics.jsonl.")
    return metrics_jsonl


def _draw(panels: list[Panel], out_png: str | Path, *, empty: str, sharex: bool) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = max(1, len(panels))
    figure = Figure(figsize=(7, 2.6 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, 1, squeeze=False, sharex=sharex)[:, 0]
    if not panels:
        axes[0].text(0.5, 0.5, empty, ha="center", va="center", transform=axes[0].transAxes)
        axes[0].set_axis_off()
    for ax, panel in zip(axes, panels):
        for curve in panel.curves:
            few = len(curve.steps) < 30
            if curve.faint:
                ax.plot(curve.steps, curve.values, label=curve.label, alpha=0.3, linewidth=0.8,
                        marker="o" if few else None, markersize=2)
            else:
                ax.plot(curve.steps, curve.values, label=curve.label, marker="o" if few else None, markersize=3)
        if panel.title:
            ax.set_title(panel.title, fontsize=10)
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        if len(panel.curves) > 1:
            ax.legend(fontsize=8)
        if not sharex:
            ax.set_xlabel("step")
    axes[-1].set_xlabel("step")
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_png, dpi=100)
