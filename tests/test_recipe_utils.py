"""What a recipe serves its components (PROVIDES) is read from the script loaded as a module, its main not run."""

from __future__ import annotations

from pathlib import Path

from rltk.recipe_utils import recipe_spec
from rltk.training.stages.loop_state import RL_STEP_FIELDS

REPO = Path(__file__).resolve().parents[1]


def test_the_rl_recipes_serve_every_rl_step_field_plus_their_own_passes():
    step = set(RL_STEP_FIELDS)
    assert len(step) == 12 and "old_logprobs" in step and "values" not in step
    grpo, ppo, distill = (recipe_spec(REPO / "recipes" / f"{name}.py") for name in ("grpo", "ppo", "distill"))
    asked = {"baseline_scores", "reward_components", "sum_pi_squared"}  # when the estimator names them
    assert grpo.batch_fields == step | asked | {"ref_logprobs"}
    assert ppo.batch_fields == grpo.batch_fields | {"values"}
    assert distill.batch_fields == step | {"teacher_logprobs"}
    for spec in (grpo, ppo, distill):
        assert spec.buffer_sources == {"policy"} and spec.trainer_modes == {"sync", "one_step_off", "async"}
    assert (grpo.expert_data, ppo.expert_data, distill.expert_data) == (True, True, False)


def test_a_copied_recipe_builds_its_provides_and_a_broken_neighbour_is_passed_over(tmp_path):
    (tmp_path / "mine.py").write_text(
        "from rltk.training.stages.loop_state import rl_provides\n"
        "PROVIDES = rl_provides('values', expert_data=True)\n"
        "if __name__ == '__main__':\n"
        "    raise SystemExit('loading a recipe must not run it')\n")
    (tmp_path / "broken.py").write_text("PROVIDES = {'batch_fields': ['values']}\nraise RuntimeError('half-edited')\n")
    (tmp_path / "notes.py").write_text("raise SystemExit('a script without PROVIDES is never loaded')\n")
    spec = recipe_spec(tmp_path / "mine.py")
    assert spec.batch_fields == set(RL_STEP_FIELDS) | {"values"} and spec.expert_data
    assert spec.others == ()  # broken.py failed to load (only a suggestion is lost); notes.py declares nothing
