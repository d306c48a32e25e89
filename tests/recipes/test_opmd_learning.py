"""`rltk run grpo algorithm.name=opmd` (Trinity-RFT's OPMD on GRPO's loop) learns on the embedded default (slow).

Where the number comes from: benchmarks/learning.py's `grpo_opmd` runs (docs/tutorials/dpo-and-opmd.md).
"""

import json

import pytest

from rltk.commands.cli import main

pytestmark = pytest.mark.slow

# The smallest held-out greedy gain of the grpo_opmd runs docs/tutorials/dpo-and-opmd.md quotes (seeds 0-2 at avx512, 200 RL steps
# after the default warm-up); the test asks for half of it.
MIN_BENCHMARK_GAIN = 0.23


def test_opmd_learns_on_the_embedded_default(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", "algorithm.name=opmd", f"output_dir={run_dir}", "logging.logger=[jsonl]",
                 "logging.plot=false"]) == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [m for m in metrics if "pg_loss" in m]
    assert len(rl) == 200
    assert all(m["clip_frac"] == 0.0 for m in rl)  # OPMD has no ratio clip
    first_rl = rl[0]["step"]
    evals = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m and m["step"] >= first_rl - 1]
    assert len(evals) == 9
    assert evals[-1] > evals[0] + MIN_BENCHMARK_GAIN / 2, f"held-out accuracy did not rise: {evals}"
