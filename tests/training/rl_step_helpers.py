"""What the one-process RL-step tests share with the two-process ones: the worker module
(``rl_step_worker.py``: its rollouts, settings and the tiny Qwen2) and a strategy set up as it sets one up."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# loaded by path: the worker is also a torchrun script, with its own sys.path set-up
_spec = importlib.util.spec_from_file_location("rltk_tests_rl_step_worker",
                                               Path(__file__).with_name("rl_step_worker.py"))
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def one_process_strategy():
    """An ``AccelerateStrategy`` on CPU over the worker's tiny Qwen2 (seed 0), with the worker's settings."""
    from rltk.strategies.accelerate_strategy import AccelerateStrategy

    strategy = AccelerateStrategy(cpu=True)
    strategy.setup(worker.shared.tiny_qwen2(seed=0), **worker.SETUP)
    return strategy
