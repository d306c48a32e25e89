"""The builtin metric loggers (kind ``logger``): ``console``, ``jsonl``, ``tensorboard``, ``wandb``, ``mlflow``,
``swanlab``.

A worked example of a plugin module: classes built as
``cls(run_dir=..., config=..., total_steps=..., **args)`` with ``log(metrics,
step)`` and ``close()`` (see :class:`rltk.loggers.base.MetricLogger`). Heavy
libraries (tensorboard, wandb, mlflow, swanlab) are imported only when their logger is built.
"""

from __future__ import annotations

import rltk
from rltk.loggers.console import ConsoleLogger
from rltk.loggers.jsonl import JsonlLogger
from rltk.loggers.mlflow_logger import MlflowLogger
from rltk.loggers.swanlab_logger import SwanLabLogger
from rltk.loggers.tensorboard import TensorBoardLogger
from rltk.loggers.wandb_logger import WandbLogger


@rltk.hookimpl
def rltk_loggers():
    return {
        "console": ConsoleLogger,
        "jsonl": JsonlLogger,
        "tensorboard": TensorBoardLogger,
        "wandb": WandbLogger,
        "mlflow": MlflowLogger,
        "swanlab": SwanLabLogger,
    }
