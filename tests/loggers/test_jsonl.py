"""metrics.jsonl: strict JSON lines, flushed per step, truncated on resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rltk.loggers.jsonl import JsonlLogger, read_jsonl_metrics


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_one_strict_json_object_per_step_flushed_immediately(tmp_path):
    logger = JsonlLogger(run_dir=tmp_path / "run", config={}, total_steps=3)
    logger.log({"reward": 0.5, "kl": np.float32(0.25), "tokens": torch.tensor(7), "ok": True}, 1)
    # readable before close: a SIGKILL after this point keeps the line
    assert lines(tmp_path / "run" / "metrics.jsonl") == [{"step": 1, "reward": 0.5, "kl": 0.25, "tokens": 7.0,
                                                         "ok": 1.0}]
    logger.log({"reward": float("nan"), "loss": float("inf"), "step": 99}, 2)
    logger.close()
    raw = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[1]
    assert raw == '{"step": 2, "reward": null, "loss": null}'  # strict JSON: no NaN/Infinity tokens


def test_non_numeric_metric_is_an_error_naming_it(tmp_path):
    logger = JsonlLogger(run_dir=tmp_path, config={}, total_steps=1)
    with pytest.raises(TypeError, match="metric 'samples' has value \\[1, 2\\] of type list"):
        logger.log({"samples": [1, 2]}, 1)
    logger.close()


def _interrupted_run(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in range(1, 7))
                    + '{"step": 7, "rew')  # killed mid-line
    return path


def test_resume_drops_lines_after_the_checkpoint_and_the_torn_last_line(tmp_path):
    path = _interrupted_run(tmp_path)
    logger = JsonlLogger(run_dir=tmp_path, config={}, total_steps=10, resume_step=4)
    logger.log({"reward": 0.55}, 5)
    logger.close()
    assert [(r["step"], r["reward"]) for r in lines(path)] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4), (5, 0.55)]


def test_truncate_after_on_an_open_logger_keeps_writing_to_the_file(tmp_path):
    path = _interrupted_run(tmp_path)
    logger = JsonlLogger(run_dir=tmp_path, config={}, total_steps=10)
    assert logger.truncate_after(2) == 5  # steps 3..6 and the torn line
    logger.log({"reward": 0.3}, 3)
    logger.close()
    assert [r["step"] for r in lines(path)] == [1, 2, 3]


def test_without_resume_an_existing_file_is_appended_to(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.0}\n')
    logger = JsonlLogger(run_dir=tmp_path, config={}, total_steps=2)
    logger.log({"reward": 1.0}, 2)
    logger.close()
    logger.close()  # closing twice is harmless
    assert [r["step"] for r in read_jsonl_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_needs_a_run_dir():
    with pytest.raises(ValueError, match="'jsonl' logger writes files and needs run_dir"):
        JsonlLogger(run_dir=None, config={}, total_steps=1)


def test_resume_at_a_stage_boundary_keeps_only_the_rows_logged_before_the_checkpoint(tmp_path):
    # The warm-up's last step (4) is checkpointed, then the next stage logs its opening evaluation at
    # the same step and the run dies; resumed, it logs that evaluation again, and must not show it twice.
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 3, "sft/loss": 0.3}, {"step": 4, "sft/loss": 0.2}, {"step": 4, "eval/accuracy": 0.5},
            {"step": 5, "reward": 0.1}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    logger = JsonlLogger(run_dir=tmp_path, config={}, total_steps=10, resume_step=4)
    assert logger.truncate_after(4, keep_at_step=1) == 1
    logger.log({"eval/accuracy": 0.5}, 4)
    logger.close()
    assert lines(path) == rows[:3]
