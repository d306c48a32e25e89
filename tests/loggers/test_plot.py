"""plot_metrics: one subplot per present key, steps on x, tolerant of missing keys and torn lines."""

from __future__ import annotations

import json

import pytest
from matplotlib.image import imread

from rltk.loggers.plot import metric_series, plot_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def test_one_subplot_per_found_key(tmp_path):
    records = [{"step": s, "reward": s / 10} for s in range(1, 6)]
    records += [{"step": 0, "eval/accuracy": 0.1}, {"step": 5, "eval/accuracy": 0.3}]
    metrics = write(tmp_path / "metrics.jsonl", records)
    out = tmp_path / "plots" / "curves.png"
    assert plot_metrics(metrics, out) == ["reward", "eval/accuracy"]
    assert out.read_bytes()[:8] == PNG_MAGIC
    height_two, width = imread(out).shape[:2]
    assert width == 700  # figsize 7 in x 100 dpi

    plot_metrics(metrics, tmp_path / "one.png", keys=("reward", "missing"))
    height_one = imread(tmp_path / "one.png").shape[0]
    assert height_two == 2 * height_one  # 2.6 in per subplot


def test_missing_keys_are_skipped_and_nothing_found_still_writes_a_png(tmp_path):
    metrics = write(tmp_path / "metrics.jsonl", [{"step": 1, "loss": 2.0}])
    assert plot_metrics(metrics, tmp_path / "a.png", keys=("reward", "loss")) == ["loss"]
    assert plot_metrics(metrics, tmp_path / "b.png") == []
    assert (tmp_path / "b.png").read_bytes()[:8] == PNG_MAGIC


def test_series_sorted_by_step_last_value_wins_and_bad_entries_skipped(tmp_path):
    metrics = write(tmp_path / "metrics.jsonl", [
        {"step": 3, "reward": 0.3}, {"step": 1, "reward": 0.1}, {"step": 3, "reward": 0.33},
        {"step": 2, "reward": None}, {"step": 4, "reward": "n/a"}, {"reward": 9.0},
    ], tail='{"step": 5, "rew')
    assert metric_series(metrics, ["reward", "kl"]) == {"reward": ([1, 3], [0.1, 0.33])}


def test_missing_metrics_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics file '.*nope.jsonl' does not exist"):
        plot_metrics(tmp_path / "nope.jsonl", tmp_path / "x.png")
