"""The recipes added after the last GPU check (sft, dpo, reward_model, grpo's async mode) and the reward-model
scorer, run on a CUDA device: a few steps each, so that a tensor left on the CPU, a reference model on the
wrong device or a producer that cannot reach the GPU fails here rather than on a user's first GPU run.

Every test here is `gpu`-marked (skipped without CUDA); `benchmarks/gpu_check.sh` runs them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rltk.commands.cli import main
from rltk.models.tiny import build_char_tokenizer, build_tiny_reward_model, save_pretrained_dir
from rltk.rewards.judges.reward_model import reward_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is present")]

SMALL = ["data.task_args.max_digits=1", "data.train_size=40", "data.eval_size=8", "logging.logger=[jsonl]",
         "logging.plot=false", "checkpoint.every=0"]
SFT = ["sft.steps=6", "sft.stop_at_accuracy=null", "sft.warmup_steps=0", "sft.batch_size=8"]
RL = ["trainer.total_steps=3", "trainer.warmup_steps=0", "trainer.prompts_per_step=4", "rollout.n=4",
      "trainer.eval_every=3"]


def finite_losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [v for row in rows for k, v in row.items() if k.endswith("loss") and isinstance(v, (int, float))]
    assert losses, f"no loss was logged in {run_dir / 'metrics.jsonl'}"
    assert all(math.isfinite(v) for v in losses), losses
    return losses


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_grpo(tmp_path, mode):
    extra = [] if mode == "sync" else ["trainer.mode=async", "trainer.max_staleness=1", "buffer.queue_timeout_s=300"]
    assert main(["run", "grpo", f"output_dir={tmp_path}", *SMALL, *SFT, *RL, *extra]) == 0
    finite_losses(tmp_path)


@pytest.mark.parametrize("online", [False, True])
def test_dpo(tmp_path, online):
    assert main(["run", "dpo", f"output_dir={tmp_path}", *SMALL, *SFT, *RL[:2], f"dpo.online={online}"]) == 0
    finite_losses(tmp_path)


def test_sft(tmp_path):
    assert main(["run", "sft", f"output_dir={tmp_path}", *SMALL, *SFT, "sft.eval_every=3"]) == 0
    finite_losses(tmp_path)


def test_reward_model_training(tmp_path):
    assert main(["run", "reward_model", f"output_dir={tmp_path}", *SMALL, "stages=[]", "reward_model.steps=4",
                 "reward_model.warmup_steps=0", "reward_model.eval_every=4", "reward_model.batch_size=4"]) == 0
    finite_losses(tmp_path)


def test_reward_model_scores_on_cuda_equal_the_cpu(tmp_path):
    tokenizer = build_char_tokenizer()
    model = build_tiny_reward_model(tokenizer, seed=3, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                    intermediate_size=64)
    folder = str(save_pretrained_dir(model, tokenizer, tmp_path / "rm"))
    prompts = ["<|user|>1+2=<|eos|><|assistant|>", "<|user|>12+30=<|eos|><|assistant|>"] * 3
    responses = ["3", "42 is the answer", "", "x", "15", "one hundred"]
    on = {device: [r["raw"] for r in reward_model(prompt=prompts, response=responses, path=folder, device=device,
                                                  micro_batch_size=4)]
          for device in ("cpu", "cuda")}
    assert on["cuda"] == pytest.approx(on["cpu"], abs=1e-3)


def test_a_chain_of_sft_dpo_and_grpo_stages(tmp_path):
    # each stage hands its CUDA-resident policy to the next (tests/recipes/test_stage_chain.py checks the weights)
    chain = ("stages=[{name: warmup, type: sft}, {name: prefs, type: dpo}, "
             "{name: rl, type: grpo, overrides: {algorithm.kl_coef: 0.05}}]")
    assert main(["run", "dpo", f"output_dir={tmp_path}", *SMALL, *SFT, *RL, chain]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "dpo_loss" in r] == [7, 8, 9]
    assert [r["step"] for r in rows if "pg_loss" in r] == [10, 11, 12]
    finite_losses(tmp_path)
