"""The plugin's training loop: rejection-sampling fine-tuning, registered as a stage, chained after an SFT stage."""

from __future__ import annotations

import json

import pytest

import rltk
from rltk.batch import Experience
from rltk.commands.cli import main
from rltk_plugin_example.rft import accepted

CHAIN = "stages=[{name: warmup, type: sft}, {name: rft, type: rft}]"


def test_rft_is_a_registered_stage_listed_with_its_plugin(capsys):
    entry = {e.name: e for e in rltk.list_components("stage")}["rft"]
    assert entry.plugin == "rltk-plugin-example:example" and entry.obj.rl
    assert main(["list", "stage"]) == 0
    line = next(row for row in capsys.readouterr().out.splitlines() if row.split()[:1] == ["rft"])
    assert "rltk-plugin-example:example" in line and "keep what the reward accepts" in line


def test_a_chain_with_rft_validates_and_a_misspelt_type_names_it(capsys):
    assert main(["validate", "grpo", CHAIN]) == 0
    assert "2 stages: warmup (sft), rft (rft)" in capsys.readouterr().out
    assert main(["validate", "grpo", CHAIN.replace("type: rft", "type: rtf")]) == 2
    assert "bad value 'rtf' for 'stages[1].type'" in capsys.readouterr().err


def test_only_what_the_reward_accepts_is_kept_as_often_as_it_was_sampled():
    def sample(group, response, score):
        return Experience(prompt_ids=[1], response_ids=response, score=score, group_id=group)

    batch = [sample(0, [5], 1.0), sample(0, [5], 1.0), sample(0, [6], 0.0), sample(1, [7], 0.0),
             sample(1, [8], 0.5), sample(2, [9], -1.0)]
    assert [(e.group_id, e.response_ids) for e in accepted(batch)] == [(0, [5]), (0, [5]), (1, [8])]


# Measured with this test's settings (one-digit sums, a 150-step SFT warm-up, then 30 RFT steps of 16 prompts x 8
# samples): the training reward's mean over the last 10 RFT steps minus that over the first 10 was +0.086, +0.175
# and +0.159 (seeds 0, 1, 2) at the machine's best kernels, +0.086 (seed 0) at ATEN_CPU_CAPABILITY=avx2 and +0.097
# at default. The test asks for half the smallest. Held-out accuracy is not the claim: on 76 training problems
# the tiny model's sharpened answers do not carry over to the 24 held-out ones (it fell on every seed).
MIN_MEASURED_GAIN = 0.086


@pytest.mark.slow
def test_rft_after_sft_raises_the_reward(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", "seed=0", "data.task_args.max_digits=1",
                 "data.train_size=76", "data.eval_size=24", "sft.steps=150", "sft.stop_at_accuracy=null",
                 "sft.warmup_steps=5", "trainer.total_steps=30", "trainer.eval_every=30", "trainer.lr=1e-3",
                 "trainer.warmup_steps=0", "logging.logger=[jsonl]", "logging.plot=false", "checkpoint.every=0",
                 CHAIN]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rft/kept_fraction" in r]
    assert [r["step"] for r in steps] == list(range(151, 181))  # global steps continue after the warm-up
    # exact_match scores 0 or 1: the kept fraction is the mean reward
    assert all(r["rft/kept_fraction"] == pytest.approx(r["reward"]) for r in steps)
    reward = [r["reward"] for r in steps]
    first, last = sum(reward[:10]) / 10, sum(reward[-10:]) / 10
    assert last > first + MIN_MEASURED_GAIN / 2, f"the reward did not rise: {first:.3f} -> {last:.3f}"
