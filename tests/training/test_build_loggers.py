"""build_loggers: stages reach the loggers that ask for them; loggers written before stages still work."""

from __future__ import annotations

import io
import types

from omegaconf import OmegaConf

import rltk
from rltk.config.loader import load_config
from rltk.loggers.base import Logger, StageSpan, stage_spans
from rltk.training.scaffold.run_outputs import build_loggers


class OldStyleLogger:
    """A third-party logger from before stages: strict keyword arguments, no set_stages."""

    def __init__(self, *, run_dir, config, total_steps, resume_step=None):
        self.total_steps = total_steps
        self.logged = []

    def log(self, metrics, step):
        self.logged.append((step, dict(metrics)))

    def close(self):
        pass


def test_stage_spans_cover_consecutive_global_steps():
    spans = stage_spans([("warmup", "sft", 1200), ("grpo", "rl", 200)])
    assert spans == [StageSpan("warmup", "sft", 0, 1200), StageSpan("grpo", "rl", 1200, 200)]
    assert [s.last_step for s in spans] == [1200, 1400]


def test_console_gets_the_stages_and_an_old_style_logger_is_built_as_before(tmp_path):
    plugin = types.ModuleType("old_style_logger_plugin")
    plugin.rltk_loggers = rltk.hookimpl(lambda: {"old_style": OldStyleLogger})
    rltk.register_plugin(plugin, name="old_style_logger_plugin")
    try:
        cfg = load_config([], ["logging.logger=[console,old_style]"])
        cfg.logging.logger_args = OmegaConf.create({"console": {"tty": False}})
        spans = stage_spans([("warmup", "sft", 3), ("grpo", "rl", 2)])
        console, old = build_loggers(cfg, tmp_path, 5, stages=spans)
    finally:
        rltk.unregister_plugin("old_style_logger_plugin")
    assert console.stages == spans
    # a logger with log and close alone, wrapped once: the trainer calls every method of Logger on it
    assert isinstance(old, Logger) and isinstance(old.logger, OldStyleLogger) and old.logger.total_steps == 5
    old.set_stages(spans)
    assert old.truncate_after(3) == 0
    old.log({"x": 1.0}, 1)
    assert old.logger.logged == [(1, {"x": 1.0})]
    console.stream = io.StringIO()
    console.log({"sft/sft_loss": 0.5}, 1)
    assert console.stream.getvalue().startswith("[warmup 1/3] step 1/5 (20%) | sft loss 0.5")
