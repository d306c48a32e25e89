"""TensorBoard scalars read back with TensorBoard's own event reader; resume purges the orphaned steps."""

from __future__ import annotations

import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from rltk.loggers.tensorboard import TensorBoardLogger  # noqa: E402


def scalars(log_dir, tag):
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_scalars_and_config_are_written_under_run_dir_tensorboard(tmp_path):
    logger = TensorBoardLogger(run_dir=tmp_path, config={"algorithm": {"name": "grpo"}}, total_steps=3)
    for step in (1, 2, 3):
        logger.log({"reward": step / 4, "eval/accuracy": 0.5}, step)
    logger.close()
    assert scalars(tmp_path / "tensorboard", "reward") == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert scalars(tmp_path / "tensorboard", "eval/accuracy") == [(1, 0.5), (2, 0.5), (3, 0.5)]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert "config/text_summary" in events.Tags()["tensors"]


def test_resume_discards_steps_logged_after_the_checkpoint(tmp_path):
    first = TensorBoardLogger(run_dir=tmp_path, config={}, total_steps=6)
    for step in range(1, 6):
        first.log({"reward": float(step)}, step)
    first.close()  # the run dies at step 5; its checkpoint is step 3
    resumed = TensorBoardLogger(run_dir=tmp_path, config={}, total_steps=6, resume_step=3)
    for step in (4, 5, 6):
        resumed.log({"reward": step + 0.5}, step)
    resumed.close()
    assert scalars(tmp_path / "tensorboard", "reward") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.5), (5, 5.5),
                                                          (6, 6.5)]
