"""What a run writes: its folder and ``config.yaml``, the loggers, every metric row, ``summary.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

import rltk
from rltk.config.saved import config_to_record, config_yaml_to_record
from rltk.distributed import process_rank
from rltk.loggers.base import StageSpan, as_logger


def build_loggers(cfg: DictConfig, run_dir: Path, total_steps: int, resume_step: int | None = None,
                  stages: list[StageSpan] | None = None) -> list:
    """The configured loggers; ``resume_step`` makes file loggers drop what was logged after it.

    ``stages`` (the run's stages as spans of global steps) reach every logger's ``set_stages`` (the
    console's ETA is per stage; most loggers ignore them).
    """
    container = config_to_record(cfg)  # loggers may upload it (W&B): no secret read from the environment
    loggers = []
    if process_rank() != 0:  # one set of curves per run, written by the main process
        return loggers
    for name in cfg.logging.logger:
        cls = rltk.get_component("logger", name)
        args = dict(OmegaConf.to_container(cfg.logging.logger_args, resolve=True)).get(name, {})
        logger = as_logger(cls(run_dir=run_dir, config=container, total_steps=total_steps, resume_step=resume_step,
                               **args))
        if stages:
            logger.set_stages(list(stages))
        loggers.append(logger)
    return loggers


@dataclass
class MetricLog:
    """Fans metrics out to every logger; a training step's row goes to the ``rltk_on_step_end`` hook first."""

    loggers: list
    history: list[dict] = field(default_factory=list)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Log the row of training step ``step`` (a run's global numbering), which ends there: every plugin's
        ``rltk_on_step_end`` gets it first, and may add to ``metrics``. Once per step: a step that evaluates
        puts its evaluation into this row."""
        rltk.call_lifecycle_hook("rltk_on_step_end", step=step, metrics=metrics)
        self._write(metrics, step)

    def log_evaluation(self, metrics: dict[str, Any], step: int) -> None:
        """Log a row that is no training step's: a stage's opening evaluation of the weights it starts from,
        at the global step before its first (the previous stage's last, whose hook already fired)."""
        self._write(metrics, step)

    def _write(self, metrics: dict[str, Any], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, np.floating, np.integer))}
        self.history.append({"step": step, **clean})
        for logger in self.loggers:
            logger.log(clean, step)

    def set_stages(self, stages: list[StageSpan]) -> None:
        """Give every logger the run's stages again (a stage stopped before its cap, the later ones moved up)."""
        for logger in self.loggers:
            logger.set_stages(list(stages))

    def last(self, key: str) -> tuple[int, float] | None:
        """The latest ``(step, value)`` logged for ``key`` in this process, if any."""
        for entry in reversed(self.history):
            if key in entry:
                return entry["step"], entry[key]
        return None

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def prepare_run_dir(cfg: DictConfig, *, write_config: bool = True) -> Path:
    """Create the run folder and save the resolved config in it as ``config.yaml``.

    Values read from the environment (``${oc.env:...}``, often secrets) are
    saved as their interpolation, not their value (:mod:`rltk.config.saved`).

    Call it only once the run is known to be new or a compatible continuation
    (:func:`rltk.training.scaffold.resume.resume_or_start_over`): a resumed run compares
    its config with this file. ``write_config=False`` leaves an existing one as it is.
    """
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if write_config:
        # Through a rename: other ranks may be reading the file to compare their config with it.
        temp = run_dir / ".config.yaml.tmp"
        temp.write_text(config_yaml_to_record(cfg))
        temp.replace(run_dir / "config.yaml")
    return run_dir


def write_summary(run_dir: Path, summary: dict) -> None:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
