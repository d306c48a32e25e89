"""The GRPO recipe with every layer split over two processes (``strategy_args.tensor_parallel_size=2``) logs what
one process logs: the SFT warm-up and the GRPO steps train the sharded policy, log-probs and entropy go through
the vocabulary-parallel head, the rollout engine and the frozen reference hold whole copies, and both ranks of the
tensor group sample alike.

Slow (an SFT warm-up of 40 steps, so that the tiny model earns rewards and its GRPO steps carry a gradient, and
three GRPO steps, once in two processes and once in one: ~45 s together on a quiet 2-core machine).

The tolerance is not fp32 rounding: the split matmuls and the head's all-reduces sum in another order (log-probs
within 5e-7 of one process's, tests/models/parallel/test_tensor_parallel.py), and 43 Adam steps carry that into
the weights (Adam turns gradient differences of 1e-8 into steps of the learning rate's size). Measured here: every
metric within 1.5e-3 relative of one process's after the 43 steps, the rewards equal.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.isolated import run_isolated

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ARGS = [
    "data.task_args.max_digits=1", "data.train_size=70", "data.eval_size=20", "sft.steps=40", "sft.lr=3e-3",
    "sft.stop_at_accuracy=null", "sft.warmup_steps=2", "trainer.total_steps=3", "trainer.warmup_steps=1",
    "trainer.eval_every=2", "checkpoint.every=0", "logging.logger=[jsonl]", "logging.plot=false",
]
NOT_COMPARED = ("time", "per_s", "memory", "throughput")


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_with_layers_split_over_two_ranks_logs_what_one_process_logs(tmp_path):
    cli = ["-m", "rltk.commands.cli", "run", "grpo"]
    env = {"RLTK_DISABLE_PLUGIN_AUTOLOAD": "1"}
    run_isolated([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *cli,
                  f"output_dir={tmp_path / 'tp2'}", "strategy_args.tensor_parallel_size=2", *ARGS], extra_env=env)
    run_isolated([sys.executable, *cli, f"output_dir={tmp_path / 'one'}", *ARGS], extra_env=env)
    split, one = _metrics(tmp_path / "tp2"), _metrics(tmp_path / "one")
    assert [m["step"] for m in split] == [m["step"] for m in one]
    rl_steps = [m for m in one if "kl" in m and "grad_norm" in m]
    assert len(rl_steps) == 3 and max(m["reward"] for m in rl_steps) > 0  # the GRPO steps have a gradient
    compared = 0
    for ours, theirs in zip(split, one):
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            if isinstance(value, float) and not any(word in key for word in NOT_COMPARED):
                assert ours[key] == pytest.approx(value, rel=1e-2, abs=1e-4), (ours["step"], key)
                compared += 1
    assert compared > 100
