"""The builtin loggers are registered under kind ``logger`` and share one constructor signature."""

from __future__ import annotations

import inspect

import pytest

import rltk
from rltk.loggers.base import MetricLogger, scalar
from rltk.loggers.console import ConsoleLogger
from rltk.loggers.jsonl import JsonlLogger
from rltk.loggers.tensorboard import TensorBoardLogger
from rltk.loggers.wandb_logger import WandbLogger

BUILTIN = {"console": ConsoleLogger, "jsonl": JsonlLogger, "tensorboard": TensorBoardLogger, "wandb": WandbLogger}


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_registered_with_the_common_constructor(name):
    cls = rltk.get_component("logger", name)
    assert cls is BUILTIN[name]
    params = inspect.signature(cls).parameters
    assert {"run_dir", "config", "total_steps", "resume_step"} <= set(params)
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    assert callable(cls.log) and callable(cls.close)


def test_file_loggers_satisfy_the_protocol(tmp_path):
    for cls in (ConsoleLogger, JsonlLogger, TensorBoardLogger):
        logger = cls(run_dir=tmp_path, config={"seed": 1}, total_steps=2)
        assert isinstance(logger, MetricLogger)
        logger.log({"reward": 1.0}, 1)
        logger.close()


def test_unknown_logger_name_suggests_the_closest():
    with pytest.raises(rltk.RegistryError, match="unknown logger 'tensorbord'.*'tensorboard'"):
        rltk.get_component("logger", "tensorbord")


@pytest.mark.parametrize("value", [3, 2.5, True])
def test_scalar_accepts_plain_numbers(value):
    assert scalar("x", value) == float(value)
