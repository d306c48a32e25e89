"""Logger ``tensorboard``: scalars in ``<run_dir>/tensorboard`` for ``tensorboard --logdir``.

Every metric becomes a scalar plot named by its key (``eval/accuracy`` lands in
an ``eval`` section). The run config is attached once as text. On resume,
``purge_step`` tells TensorBoard to discard events the interrupted run logged
after the checkpoint, so curves do not fold back on themselves.
"""

from __future__ import annotations

import json
from pathlib import Path

from rltk.loggers.base import Logger, as_path, scalar_metrics

TENSORBOARD_SUBDIR = "tensorboard"


class TensorBoardLogger(Logger):
    """Writes scalars with ``torch.utils.tensorboard.SummaryWriter``.

    Args:
        run_dir: the run folder; events go to ``run_dir/tensorboard``.
        config: the resolved run config, recorded as a text summary.
        total_steps: accepted for the common logger signature; unused.
        resume_step: the checkpoint step a resumed run continues after.
        flush_secs: how often the writer flushes on its own (it also flushes on ``close``).
    """

    def __init__(self, *, run_dir: str | Path, config: dict | None = None, total_steps: int | None = None,
                 resume_step: int | None = None, flush_secs: int = 10):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # tensorboard is a dependency, but may be stripped from an image
            raise ImportError(
                f"the 'tensorboard' logger needs the tensorboard package ({exc}); install it with "
                "`pip install tensorboard`, or remove 'tensorboard' from logging.logger."
            ) from exc
        self.log_dir = as_path(run_dir, "tensorboard") / TENSORBOARD_SUBDIR
        purge_step = resume_step + 1 if resume_step is not None else None
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step, flush_secs=flush_secs)
        if config and resume_step is None:
            text = json.dumps(config, indent=2, sort_keys=True, default=str)
            # Indented by four spaces: TensorBoard renders text as markdown, this keeps it a code block.
            self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), 0)
        self._closed = False

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in scalar_metrics(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        if not self._closed:
            self.writer.close()
            self._closed = True
