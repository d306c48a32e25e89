import subprocess
import sys
from pathlib import Path

import pytest

from rltk.cli import main, shipped_recipes

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args, env=None):
    return subprocess.run(["rltk", *args], capture_output=True, text=True, env=env, timeout=120)


def test_list_shows_plugin_components_with_plugin_and_summary():
    out = run_cli("list", "advantage_fn")
    assert out.returncode == 0, out.stderr
    line = next(l for l in out.stdout.splitlines() if l.strip().startswith("group_rank"))
    assert "rltk-plugin-example:example" in line and "Rank-based group advantage" in line


def test_list_unknown_kind_exit_2_without_traceback():
    out = run_cli("list", "advantage")
    assert out.returncode == 2
    assert "advantage_fn" in out.stderr and "Traceback" not in out.stderr


def test_plugins_lists_distribution_and_components(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "rltk-plugin-example:example  (rltk-plugin-example 0.1.0, module rltk_plugin_example)" in out
    assert "advantage_fn: group_rank" in out and "reward_fn: overlong_penalty" in out


def test_validate_ok_and_errors(tmp_path, capsys):
    assert main(["validate", "grpo"]) == 0
    assert main(["validate", "grpo", "algorithm.advantage_fn=group_rank"]) == 0
    capsys.readouterr()
    assert main(["validate", "grpo", "algorithm.advantage_fn=grop"]) == 2
    err = capsys.readouterr().err
    assert "algorithm.advantage_fn" in err and "'grpo'" in err
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 2


def test_unknown_plugin_name_suggests_when_plugin_absent():
    import os

    env = dict(os.environ, RLTK_DISABLE_PLUGIN_AUTOLOAD="1")
    out = run_cli("validate", "grpo", "algorithm.advantage_fn=group_rank", env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "unknown advantage_fn 'group_rank'" in out.stderr and "grpo" in out.stderr


def test_run_unknown_recipe(capsys):
    assert main(["run", "gpro"]) == 2
    assert "Did you mean: 'grpo'" in capsys.readouterr().err


def test_run_recipe_script_by_path_gets_config_and_overrides(tmp_path):
    script = tmp_path / "my_recipe.py"
    script.write_text(
        "import sys\n"
        "from rltk.recipe_utils import parse_recipe_args\n"
        "cfg = parse_recipe_args()\n"
        "open(sys.argv[0] + '.out', 'w').write(f'{cfg.algorithm.advantage_fn} {cfg.trainer.lr}')\n"
    )
    out = run_cli("run", str(script), "algorithm.advantage_fn=rloo", "trainer.lr=0.25")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "my_recipe.py.out").read_text() == "rloo 0.25"
    bad = run_cli("run", str(script), "trainer.lr=-1")
    assert bad.returncode == 2 and "'trainer.lr'" in bad.stderr and "Traceback" not in bad.stderr


def test_shipped_recipes_come_from_the_package():
    recipes = shipped_recipes()
    assert "grpo" in recipes
    # The installed data package and the source folder are the same files.
    assert recipes["grpo"].read_text() == (REPO / "recipes" / "grpo.py").read_text()
