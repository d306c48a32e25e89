"""plot_metrics: one subplot per present key, steps on x, tolerant of missing keys and torn lines.
training_curves / plot_training_curves: the warm-up loss, raw and smoothed reward, held-out accuracy."""

from __future__ import annotations

import json

import pytest
from matplotlib.image import imread

from rltk.loggers.plot import (
    metric_series, moving_average, plot_metrics, plot_training_curves, smoothing_window, training_curves,
)

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


def test_moving_average_of_a_known_sequence():
    # trailing window of 3; the first two points average what exists so far
    assert moving_average([1.0, 2.0, 3.0, 4.0, 5.0], 3) == [1.0, 1.5, 2.0, 3.0, 4.0]
    assert moving_average([0.0, 1.0, 0.0, 1.0], 2) == [0.0, 0.5, 0.5, 0.5]
    assert moving_average([2.0, 4.0], 1) == [2.0, 4.0]
    assert moving_average([], 5) == []
    with pytest.raises(ValueError, match="window=0 must be an integer >= 1"):
        moving_average([1.0], 0)


@pytest.mark.parametrize("points, window", [(1, 1), (14, 1), (15, 2), (200, 20), (5000, 50)])
def test_smoothing_window_is_a_tenth_of_the_points_within_bounds(points, window):
    assert smoothing_window(points) == window


def run_metrics(tmp_path):
    """A warm-up of 4 steps, an evaluation at its end, then 6 RL steps with an evaluation at the last."""
    records = [{"step": s, "sft/sft_loss": 2.0 / s, "sft/lr": 1e-3} for s in range(1, 5)]
    records.append({"step": 4, "eval/accuracy": 0.5, "eval/sampled_accuracy": 0.25})
    rewards = [0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    records += [{"step": 4 + i, "reward": r, "accuracy": r} for i, r in enumerate(rewards, start=1)]
    records[-1].update({"eval/accuracy": 0.75, "eval/sampled_accuracy": 0.5})
    return write(tmp_path / "metrics.jsonl", records)


def test_training_curves_hold_the_warm_up_loss_raw_and_smoothed_reward_and_held_out_accuracy(tmp_path):
    panels = training_curves(run_metrics(tmp_path), smooth_window=2)
    assert [p.title for p in panels] == ["warm-up (SFT) loss", "train reward", "held-out accuracy"]
    sft, reward, held_out = panels
    assert [(c.label, c.steps, c.values) for c in sft.curves] == [("sft loss", [1, 2, 3, 4], [2.0, 1.0, 2 / 3, 0.5])]
    raw, smooth = reward.curves
    assert (raw.label, raw.steps, raw.values, raw.faint) == ("per step", [5, 6, 7, 8, 9, 10],
                                                             [0.0, 1.0, 0.0, 1.0, 1.0, 1.0], True)
    assert (smooth.label, smooth.steps, smooth.faint) == ("moving average (2 steps)", raw.steps, False)
    assert smooth.values == [0.0, 0.5, 0.5, 0.5, 1.0, 1.0]
    assert [(c.label, c.steps, c.values) for c in held_out.curves] == [
        ("greedy", [4, 10], [0.5, 0.75]), ("sampled", [4, 10], [0.25, 0.5])]


def test_an_rl_only_run_has_no_warm_up_panel_and_a_window_of_one_draws_the_raw_reward_alone(tmp_path):
    metrics = write(tmp_path / "metrics.jsonl", [{"step": s, "reward": 0.1 * s} for s in range(1, 4)])
    panels = training_curves(metrics)  # 3 points: window 1
    assert [p.title for p in panels] == ["train reward"]
    assert [c.label for c in panels[0].curves] == ["per step"]


def test_plot_training_curves_draws_one_panel_per_found_group(tmp_path):
    out = tmp_path / "curves.png"
    assert plot_training_curves(run_metrics(tmp_path), out) == ["warm-up (SFT) loss", "train reward",
                                                                "held-out accuracy"]
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert imread(out).shape[:2] == (3 * 260, 700)
    empty = write(tmp_path / "empty.jsonl", [{"step": 1, "lr": 0.1}])
    assert plot_training_curves(empty, tmp_path / "empty.png") == []
    assert (tmp_path / "empty.png").read_bytes()[:8] == PNG_MAGIC
