"""A config chains stages of different recipes (`stages=[sft, dpo, grpo]`) in one `rltk run` (issue 32).

Each stage is its registered loop (`type: dpo` runs rltk/training/stages/dpo_stage.py's, `type: grpo` grpo_stage.py's),
and hands its weights to the next: the frozen reference a DPO or GRPO stage saves (the policy as that stage
starts) must be exactly the weights the stage before it ended with. A run killed in the GRPO stage resumes
from the DPO stage's last checkpoint and logs what the uninterrupted run logged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rltk.commands.cli import main
from tests.crash import crash_at_step

SFT_STEPS, DPO_STEPS, GRPO_STEPS = 6, 3, 3
CHAIN = (f"stages=[{{name: warmup, type: sft}}, "
         f"{{name: prefs, type: dpo, overrides: {{trainer.total_steps: {DPO_STEPS}, trainer.lr: 1.0e-3}}}}, "
         # after a warm-up this short every sampled answer is wrong (all advantages 0): an entropy bonus moves it
         f"{{name: rl, type: grpo, overrides: {{trainer.total_steps: {GRPO_STEPS}, algorithm.entropy_coef: 0.01}}}}]")
TINY = [f"sft.steps={SFT_STEPS}", "sft.stop_at_accuracy=null", "sft.warmup_steps=2", "sft.batch_size=16",
        "data.task_args.max_digits=1", "data.train_size=40", "data.eval_size=8",
        "trainer.warmup_steps=0", "trainer.prompts_per_step=4", "rollout.n=4", "trainer.eval_every=0",
        "algorithm.kl_coef=0.05", "trainer.lr=1.0e-3", "dpo.nll_coef=0.0",
        "checkpoint.every=100", "logging.logger=[jsonl]", "logging.plot=false", "logging.traces=false", CHAIN]


def read_metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not (k.startswith("time/") or k.endswith("_per_s"))} for row in rows]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("chain")
    # the dpo recipe runs the chain as the grpo recipe would: each type is its own recipe's loop
    assert main(["run", "dpo", f"output_dir={run_dir}", *TINY]) == 0
    return run_dir


@pytest.mark.slow
def test_each_stage_runs_its_own_loop_and_starts_from_the_weights_the_last_one_ended_with(straight):
    metrics = read_metrics(straight)
    dpo_end, end = SFT_STEPS + DPO_STEPS, SFT_STEPS + DPO_STEPS + GRPO_STEPS
    assert [m["step"] for m in metrics if "sft/sft_loss" in m] == list(range(1, SFT_STEPS + 1))
    assert [m["step"] for m in metrics if "dpo_loss" in m] == list(range(SFT_STEPS + 1, dpo_end + 1))
    assert [m["step"] for m in metrics if "pg_loss" in m] == list(range(dpo_end + 1, end + 1))
    dpo = [m for m in metrics if "dpo_loss" in m]
    # the DPO stage's reference is the policy as it starts, so its first loss is -log sigmoid(0) = log 2
    assert dpo[0]["dpo_loss"] == pytest.approx(0.693147, abs=1e-5) and dpo[-1]["dpo_loss"] < 0.69
    # the GRPO stage's reference is the policy as it starts: its first KL is exactly 0
    assert [m["kl"] for m in metrics if "kl" in m][0] == 0.0

    # Each stage's last checkpoint is kept (step_000006: the warm-up's end, step_000009: DPO's)
    checkpoints = straight / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == [
        f"step_{SFT_STEPS:06d}", f"step_{dpo_end:06d}", f"step_{end:06d}"]
    sft_end = weights(checkpoints / f"step_{SFT_STEPS:06d}" / "model" / "model.safetensors")
    dpo_last = weights(checkpoints / f"step_{dpo_end:06d}" / "model" / "model.safetensors")
    grpo_last = weights(checkpoints / f"step_{end:06d}" / "model" / "model.safetensors")
    stage_weights = straight / "stage_weights"
    # the DPO stage starts from the warm-up's last weights, the GRPO stage from the DPO stage's
    assert_same_weights(weights(stage_weights / "stage_1_reference.safetensors"), sft_end)
    assert_same_weights(weights(stage_weights / "stage_2_reference.safetensors"), dpo_last)
    # and each stage trained: the weights it hands on differ from those it got
    assert any(not torch.equal(sft_end[k], dpo_last[k]) for k in sft_end)
    assert any(not torch.equal(dpo_last[k], grpo_last[k]) for k in dpo_last)


@pytest.mark.slow
def test_a_run_killed_in_the_grpo_stage_resumes_from_the_dpo_stage_s_end(straight, tmp_path):
    crashing = tmp_path / "crashing"
    dpo_end = SFT_STEPS + DPO_STEPS
    with crash_at_step(dpo_end + 1):  # after the first GRPO step, before any checkpoint of its stage
        main(["run", "grpo", f"output_dir={crashing}", *TINY])
    assert max(int(p.name[5:]) for p in (crashing / "checkpoints").glob("step_*")) == dpo_end
    assert main(["run", "grpo", f"output_dir={crashing}", *TINY]) == 0
    assert read_metrics(crashing) == read_metrics(straight)
    assert_same_weights(weights(crashing / "stage_weights" / "stage_2_reference.safetensors"),
                        weights(straight / "stage_weights" / "stage_2_reference.safetensors"))


@pytest.mark.parametrize("recipe, stages, named", [
    # a typo: the valid types, the closest first
    ("grpo", "[{name: warmup, type: sft}, {name: prefs, type: dpoo}]",
     "bad value 'dpoo' for 'stages[1].type' (stage 'prefs'). Did you mean: 'dpo'"),
    # every registered stage (rft: the example plugin's, installed beside rltk in the test environment)
    ("grpo", "[{name: prefs, type: dpoo}]", "Valid for recipe 'grpo': distill, dpo, grpo, ppo, rft, rl, sft"),
    # rl is the RL loop of the recipe run; the dpo recipe has none
    ("dpo", "[{name: rl, type: rl}]",
     "bad value 'rl' for 'stages[0].type' (stage 'rl'). Valid for recipe 'dpo': distill, dpo, grpo, ppo, rft, sft "
     "(rl is the RL loop of `rltk run grpo` or `rltk run ppo`; name it grpo or ppo here)"),
])
def test_validate_refuses_an_unknown_stage_type_with_exit_2(capsys, recipe, stages, named):
    assert main(["validate", recipe, f"stages={stages}"]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_a_lent_stage_is_checked_against_its_own_recipe(capsys):
    # under the dpo recipe a ppo stage still needs what the ppo loop checks (here: its critic section)
    assert main(["validate", "dpo", "stages=[{name: rl, type: ppo, overrides: {critic.lr: -1.0}}]"]) == 2
    assert "critic.lr" in capsys.readouterr().err


def test_the_ok_line_names_what_each_stage_runs(capsys):
    assert main(["validate", "dpo"]) == 0
    out = capsys.readouterr().out
    assert "for recipe dpo (2 stages: warmup (sft), dpo (dpo, loss sigmoid))" in out and "algorithm" not in out
    assert main(["validate", "grpo", *TINY]) == 0
    assert ("for recipe grpo (3 stages: warmup (sft), prefs (dpo, loss sigmoid), rl (grpo, algorithm grpo))"
            in capsys.readouterr().out)
