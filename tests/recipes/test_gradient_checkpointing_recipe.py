"""`rltk run grpo model.gradient_checkpointing=true` learns exactly what the run without it learns.

End to end, with LoRA and a KL reference: the warm-up, rollouts (generation on the checkpointed
policy), old and reference log-probs, the updates and the held-out evaluation. Checkpointing
recomputes activations and must change no number; the unit tests in
tests/models/test_activation_checkpointing.py check the gradients themselves.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rltk.commands.cli import main

pytestmark = pytest.mark.slow

RUN = [
    "model.lora.r=8", "model.lora.alpha=16", "model.lora.dropout=0.1", "algorithm.kl_coef=0.05",
    "data.task_args.max_digits=1", "data.train_size=70", "data.eval_size=20",
    "sft.steps=10", "sft.stop_at_accuracy=null", "sft.batch_size=16", "sft.warmup_steps=2", "sft.lr=1e-3",
    "trainer.total_steps=3", "trainer.warmup_steps=1", "trainer.lr=1e-3", "trainer.prompts_per_step=4",
    "rollout.n=4", "trainer.micro_batch_size=4", "trainer.eval_every=3",
    "logging.logger=[jsonl]", "logging.plot=false", "checkpoint.every=0",
]


def numbers(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not (k.startswith("time/") or k.endswith("_per_s"))} for row in rows]


def test_grpo_with_lora_learns_the_same_with_gradient_checkpointing(tmp_path):
    plain, ckpt = tmp_path / "plain", tmp_path / "ckpt"
    assert main(["run", "grpo", f"output_dir={plain}", *RUN]) == 0
    assert main(["run", "grpo", f"output_dir={ckpt}", *RUN, "model.gradient_checkpointing=true"]) == 0
    ours, theirs = numbers(ckpt), numbers(plain)
    assert [m["step"] for m in ours] == [m["step"] for m in theirs]
    assert any("kl" in m for m in theirs) and any("sft/sft_loss" in m for m in theirs)
    compared = 0
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys(), a["step"]
        for key, value in b.items():
            assert a[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (a["step"], key)
            compared += 1
    assert compared > 50
