"""What a recipe serves its components comes from its registered stages (kind ``stage``), never from reading a
script; a script with a loop of its own hands it over to parse_recipe_args, and validating it stops there."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import rltk
from rltk.errors import ConfigError
from rltk.recipe_tools.validation import recipe_stages, shipped_recipe_spec, validate
from rltk.registration.stage_spec import RL_STEP_FIELDS, StageSpec

REPO = Path(__file__).resolve().parents[1]


def test_the_rl_stages_serve_every_rl_step_field_plus_their_own_passes():
    step = set(RL_STEP_FIELDS)
    assert len(step) == 12 and "old_logprobs" in step and "values" not in step
    grpo, ppo, distill = (shipped_recipe_spec(name) for name in ("grpo", "ppo", "distill"))
    asked = {"baseline_scores", "reward_components", "sum_pi_squared"}  # when the estimator names them
    assert grpo.batch_fields == step | asked | {"ref_logprobs"}
    assert ppo.batch_fields == grpo.batch_fields | {"values"}
    assert distill.batch_fields == step | {"teacher_logprobs"}
    for spec in (grpo, ppo, distill):
        assert spec.buffer_sources == {"policy"} and spec.trainer_modes == {"sync", "one_step_off", "async"}
    assert (grpo.expert_data, ppo.expert_data, distill.expert_data) == (True, True, False)
    # the same numbers are the registered stages' own: a recipe's `rl` is the stage of its name
    registered = {e.name: e.obj for e in rltk.list_components("stage")}
    assert {"sft", "grpo", "ppo", "dpo", "distill", "reward_model"} <= set(registered)
    assert frozenset(registered["ppo"].provides["batch_fields"]) == ppo.batch_fields
    assert all(e.plugin == "rltk:stages" for e in rltk.list_components("stage") if e.name in ("grpo", "sft"))


def test_each_recipe_chains_every_registered_stage_and_checks_each_against_its_own_loop():
    grpo, dpo, rm = (shipped_recipe_spec(name) for name in ("grpo", "dpo", "reward_model"))
    assert {"rl", "sft", "dpo", "grpo", "ppo", "distill"} <= grpo.stage_types
    assert "rl" not in dpo.stage_types and "grpo" in dpo.stage_types  # dpo has no RL loop of its own
    assert "reward_model" not in grpo.stage_types  # it trains a model that is not the policy: not chainable
    assert dict(dpo.stage_recipes)["ppo"].batch_fields == shipped_recipe_spec("ppo").batch_fields
    assert rm.batch_fields is None  # no rl stage: nothing of the algorithm's to check
    # a critic's values are served by a ppo stage in a dpo run, not by a grpo stage
    validate("dpo", [], ["stages=[{name: a, type: ppo}]", "algorithm.advantage_fn=gae"])
    with pytest.raises(ConfigError, match=r"needs batch field\(s\) 'values', which recipe 'grpo' does not provide"):
        validate("dpo", [], ["stages=[{name: a, type: grpo}]", "algorithm.advantage_fn=gae"])
    with pytest.raises(ConfigError, match=r"bad value 'rl' for 'stages\[0\].type'"):
        validate("dpo", [], ["stages=[{name: a, type: rl}]"])


def test_a_copied_recipe_with_its_own_loop_is_validated_against_what_it_provides_and_stops_there(tmp_path):
    (tmp_path / "mine.py").write_text(
        "from rltk.recipes import StageSpec, parse_recipe_args, recipe_stages, rl_provides\n"
        "def my_loop(stage):\n"
        "    raise SystemExit('validating a recipe must not run its loop')\n"
        "STAGES = recipe_stages('grpo', rl=StageSpec(my_loop, 'my loop', provides=rl_provides('values', "
        "expert_data=True)))\n"
        "def main():\n"
        "    cfg = parse_recipe_args(STAGES)\n"
        "    open(__file__ + '.ran', 'w').write('past parse_recipe_args')\n"
        "if __name__ == '__main__':\n"
        "    main()\n")
    cfg, line = validate(str(tmp_path / "mine.py"), [], ["algorithm.advantage_fn=gae", "stages=[{name: r, type: rl}]"])
    assert cfg.algorithm.advantage_fn == "gae" and "for recipe mine" in line
    assert not (tmp_path / "mine.py.ran").exists()
    # the shipped grpo recipe, whose rl loop trains no critic, refuses the same config
    with pytest.raises(ConfigError, match="'values'"):
        validate("grpo", [], ["algorithm.advantage_fn=gae", "stages=[{name: r, type: rl}]"])


def test_recipe_stages_take_a_scripts_own_loop_and_refuse_a_bad_spec():
    def my_loop(stage):
        """My loop."""

    stages = recipe_stages("grpo", rl=my_loop)
    assert stages["rl"].resolve() is my_loop and stages["rl"].provides == {}
    assert stages["grpo"].resolve().__name__ == "run_grpo_stage"  # imported only now
    with pytest.raises(ValueError, match="trainer_mode"):
        StageSpec(my_loop, provides={"trainer_mode": ["sync"]})
    with pytest.raises(ValueError, match="package.module:function"):
        StageSpec("run_my_loop")


def test_registering_the_stages_imports_no_loop_and_no_torch():
    # what rltk validate reads of a stage is its spec: the loop is imported only when the stage runs
    code = ("import sys\n"
            "from rltk.components.builtin_stages import rltk_stages\n"
            "stages = rltk_stages()\n"
            "assert 'values' in stages['ppo'].provides['batch_fields'] and stages['grpo'].rl\n"
            "loaded = [m for m in sys.modules if m == 'torch' or m.startswith('rltk.training')]\n"
            "assert not loaded, loaded\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def test_the_old_import_paths_work_for_a_release_with_a_deprecation_warning():
    import rltk.recipe_utils as old
    from rltk.recipe_tools import validation as recipe_validation

    with pytest.warns(DeprecationWarning, match="rltk.recipe_utils.parse_recipe_args moved to "
                                                "rltk.recipe_tools.validation.parse_recipe_args"):
        assert old.parse_recipe_args is recipe_validation.parse_recipe_args
    with pytest.warns(DeprecationWarning, match="recipe_spec"):
        assert old.recipe_spec(REPO / "recipes" / "ppo.py") == shipped_recipe_spec("ppo")
    with pytest.warns(DeprecationWarning, match="stage_runners"):
        runners = old.stage_runners({"rl": print}, "grpo.py")
    assert runners["rl"].resolve() is print and "dpo" in runners
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        import rltk.recipes  # noqa: F401  (the new face warns nothing)


def test_a_script_written_for_the_old_stages_still_validates_with_a_deprecation_warning(tmp_path):
    # a copy of an old recipe: module-level STAGES and PROVIDES, parse_recipe_args() without stages
    (tmp_path / "old_copy.py").write_text(
        "from rltk.recipe_utils import parse_recipe_args\n"
        "from rltk.training.stages.loop_state import rl_provides\n"
        "def my_loop(stage):\n"
        "    raise SystemExit('validating must not run the loop')\n"
        "PROVIDES = rl_provides('values')\n"
        "STAGES = {'rl': my_loop}\n"
        "def main():\n"
        "    parse_recipe_args()\n"
        "if __name__ == '__main__':\n"
        "    main()\n")
    with pytest.warns(DeprecationWarning, match="STAGES/PROVIDES is read for one more release"):
        cfg, _ = validate(str(tmp_path / "old_copy.py"), [], ["algorithm.advantage_fn=gae",
                                                                "stages=[{name: r, type: rl}]"])
    assert cfg.algorithm.advantage_fn == "gae"


@pytest.mark.slow
def test_a_copied_recipe_runs_the_loop_it_defines(tmp_path):
    from rltk.commands.cli import main

    script = tmp_path / "counted.py"
    script.write_text(
        "from rltk.recipes import (StageSpec, finish_run, open_run, parse_recipe_args, recipe_stages, rl_provides,\n"
        "                          run_grpo_stage, run_stages)\n"
        "calls = []\n"
        "def my_loop(stage):\n"
        "    calls.append(stage.run.cfg.stages[stage.index].name)\n"
        "    return run_grpo_stage(stage)\n"
        "STAGES = recipe_stages('grpo', rl=StageSpec(my_loop, 'grpo, counted', provides=rl_provides('ref_logprobs')))\n"
        "def main():\n"
        "    cfg = parse_recipe_args(STAGES)\n"
        "    run = open_run(cfg)\n"
        "    run_stages(run, STAGES)\n"
        "    finish_run(run)\n"
        "    open(__file__ + '.calls', 'w').write(','.join(calls))\n"
        "if __name__ == '__main__':\n"
        "    main()\n")
    run_dir = tmp_path / "run"
    assert main(["run", str(script), f"output_dir={run_dir}", "data.task_args.max_digits=1", "data.train_size=40",
                 "data.eval_size=8", "sft.steps=2", "sft.warmup_steps=0", "trainer.total_steps=2",
                 "trainer.warmup_steps=0", "trainer.prompts_per_step=2", "rollout.n=2", "trainer.eval_every=0",
                 "logging.logger=[jsonl]", "logging.plot=false", "checkpoint.every=0",
                 "stages=[{name: warm, type: sft}, {name: mine, type: rl}]"]) == 0
    assert (tmp_path / "counted.py.calls").read_text() == "mine"  # the sft stage ran the registered loop
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "pg_loss" in r] == [3, 4]
