"""`rltk run dpo`: the embedded default learns (slow; run in CI), online DPO runs, and bad column names exit 2.

Where the numbers come from: `benchmarks/learning.py --recipes dpo` (docs/tutorials/dpo-and-opmd.md).
"""

import json
from pathlib import Path

import pytest

from rltk.commands.cli import main

from tests.waits import scaled

# What benchmarks/learning.py measured for the shipped dpo default (SFT warm-up to a 0.4 probe, then 200
# steps of DPO with the RPO term on the task's synthetic pairs): every run's held-out greedy accuracy
# gained at least MIN_BENCHMARK_GAIN over the DPO stage (seeds 0-2 at avx512, seed 0 at avx2 and default;
# docs/tutorials/dpo-and-opmd.md). The test asks for half of it.
MIN_BENCHMARK_GAIN = 0.165


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_dpo_learns_on_the_embedded_default(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["run", "dpo", f"output_dir={run_dir}", "logging.logger=[jsonl]", "logging.plot=false"]) == 0
    metrics = read_metrics(run_dir)
    steps = [m for m in metrics if "dpo_loss" in m]
    assert len(steps) == 200
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected", "nll_loss"):
        assert all(key in m for m in steps), key
    # the implicit reward separates the pairs: margins and accuracies rise from 0 at the first step
    first, last = steps[:25], steps[-25:]
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    assert mean(last, "rewards/margins") > mean(first, "rewards/margins") > 0
    assert mean(last, "rewards/accuracies") > 0.5
    evals = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m and m["step"] >= steps[0]["step"] - 1]
    assert len(evals) == 9  # start of the DPO stage, then every 25 steps
    assert evals[-1] > evals[0] + MIN_BENCHMARK_GAIN / 2, f"held-out accuracy did not rise: {evals}"


FAST = ["data.task_args.max_digits=1", "data.train_size=70", "data.eval_size=20", "sft.steps=150",
        "sft.stop_at_accuracy=null", "trainer.eval_every=5", "trainer.total_steps=5", "trainer.warmup_steps=0",
        "logging.logger=[jsonl]", "logging.plot=false"]


@pytest.mark.slow
def test_online_dpo_trains_on_the_best_and_worst_of_its_own_samples(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["run", "dpo", "dpo.online=true", f"output_dir={run_dir}", *FAST]) == 0
    steps = [m for m in read_metrics(run_dir) if "dpo_loss" in m or "skipped_empty_batch" in m]
    assert len(steps) == 5
    trained = [m for m in steps if "dpo_loss" in m]
    assert trained, "every step skipped: no group of samples had differing scores"
    for m in trained:
        assert 1 <= m["pairs"] <= 16 and 0.0 <= m["reward"] <= 1.0


def preference_file(tmp_path: Path) -> Path:
    path = tmp_path / "prefs.jsonl"
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "good": str(a + b), "bad": str(a + b + 1)}
            for a in range(5) for b in range(5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("keys, named", [
    (["dpo.chosen_key=chosen", "dpo.rejected_key=bad"], "dpo.chosen_key='chosen'"),  # the default name, absent
    (["dpo.chosen_key=good", "dpo.rejected_key=worse"], "dpo.rejected_key='worse'"),
])
def test_a_wrong_column_name_exits_2_naming_the_key(tmp_path, capsys, keys, named):
    code = main(["run", "dpo", f"data.path={preference_file(tmp_path)}", *keys, f"output_dir={tmp_path / 'run'}",
                 "stages=[{name: dpo, type: dpo}]", "trainer.prompts_per_step=2", "logging.logger=[jsonl]"])
    assert code == 2
    err = capsys.readouterr().err
    assert named in err and "is not a column of row" in err and "['bad', 'good']" in err


def test_an_rl_stage_under_the_dpo_recipe_is_refused_before_anything_runs(tmp_path, capsys):
    # rl is the RL loop of the recipe run (grpo's or ppo's); in a dpo run the stage names it: type grpo
    # (dpo, grpo and ppo stages chain under any recipe: tests/recipes/test_stage_chain.py)
    code = main(["run", "dpo", f"output_dir={tmp_path / 'run'}", "stages=[{name: rl, type: rl}]",
                 "logging.logger=[jsonl]"])
    assert code == 2
    assert "bad value 'rl' for 'stages[0].type'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_under_lora_the_reference_is_the_adapters_off_base(tmp_path):
    # LoRA's B starts at 0, so at the first step the policy equals its base: loss log 2, margins 0; nothing
    # is copied or saved for the reference (no stage_weights/), and later steps move the margin.
    run_dir = tmp_path / "run"
    assert main(["run", "dpo", "model.lora.r=4", "stages=[{name: dpo, type: dpo}]", "trainer.total_steps=3",
                 "trainer.warmup_steps=0", "trainer.eval_every=3", "data.train_size=64", "data.eval_size=16",
                 f"output_dir={run_dir}", "logging.logger=[jsonl]", "logging.plot=false"]) == 0
    steps = [m for m in read_metrics(run_dir) if "dpo_loss" in m]
    assert steps[0]["dpo_loss"] == pytest.approx(0.693147, abs=1e-5)
    assert steps[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert steps[-1]["rewards/margins"] != 0.0
    assert not (run_dir / "stage_weights").exists()


@pytest.mark.slow
def test_two_processes_train_as_one(tmp_path):
    # Offline DPO draws no random numbers: under torchrun each rank takes half of every global batch of pairs,
    # and the losses and margins of each step must be one process's (the reference precomputed on both).
    import subprocess
    import sys

    args = ["stages=[{name: dpo, type: dpo}]", "trainer.total_steps=3", "trainer.warmup_steps=0",
            "trainer.eval_every=3", "data.train_size=64", "data.eval_size=16", "dpo.precompute_reference=true",
            "logging.logger=[jsonl]", "logging.plot=false"]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "rltk.commands.cli", "run", "dpo", f"output_dir={tmp_path / 'ddp'}", *args],
                         capture_output=True, text=True, timeout=scaled(600))
    assert out.returncode == 0, out.stderr[-6000:]
    assert main(["run", "dpo", f"output_dir={tmp_path / 'single'}", *args]) == 0
    ours = [m for m in read_metrics(tmp_path / "ddp") if "dpo_loss" in m]
    theirs = [m for m in read_metrics(tmp_path / "single") if "dpo_loss" in m]
    assert len(ours) == len(theirs) == 3
    for a, b in zip(ours, theirs):
        assert a["pairs"] == b["pairs"] == 16
        for key in ("dpo_loss", "nll_loss", "rewards/margins", "logps/chosen", "logps/rejected"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
