"""The tinker-cookbook RL loop, through the official SDK against ``rltk serve-tinker``: the reward rises.

Where the number comes from: ``benchmarks/tinker_rl.py`` (the same loop) over seeds 0-4 at the
machine's best CPU capability, ``ATEN_CPU_CAPABILITY=avx2`` and ``default`` (2026-11-29, loaded 2-core
machine): the mean reward of the last 5 of 20 RL steps minus the first 5 was at least 0.059
(best, and avx2: the same runs) and 0.073 (default); every one of the 15 runs rose. Sampling is
seeded per request, so a run repeats exactly at one CPU level. Asserted: half the smallest, on two
seeds.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tests.waits import scaled

pytest.importorskip("tinker")
pytest.importorskip("fastapi")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MIN_GAIN = 0.059 / 2


def _benchmark():
    spec = importlib.util.spec_from_file_location("tinker_rl_benchmark", ROOT / "benchmarks" / "tinker_rl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cookbook_rl_loop_raises_the_reward_on_arithmetic():
    bench = _benchmark()
    os.environ["TINKER_TELEMETRY"] = "0"
    proc, url = bench.start_server("--api-key", bench.API_KEY, "--threads", "1")  # the embedded tiny default
    try:
        for seed in (0, 1):
            result = bench.rl_loop(url, seed=seed)
            assert result["losses"][-1] < 0.1 * result["losses"][0]  # the warm-up learned the sums' format
            gain = bench.gain(result["rewards"], 5)
            assert gain >= MIN_GAIN, (seed, [round(r, 3) for r in result["rewards"]])
    finally:
        proc.terminate()
        proc.wait(scaled(30))
