"""The rltk/ top level holds at most 15 modules (tests/test_house.py); what moved off it keeps its old name for one
release through one alias table in ``rltk/__init__.py`` (no file per old name): importing the old name gives the
very module in its new place, with a DeprecationWarning naming it (issue 55, item 5)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.waits import scaled

REPO = Path(__file__).resolve().parents[1]
MOVED = {
    "rltk.cli": "rltk.commands.cli",
    "rltk.serve_command": "rltk.commands.serve",
    "rltk.produce_command": "rltk.commands.produce",
    "rltk.stage_spec": "rltk.registration.stage_spec",
    "rltk.builtin_stages": "rltk.components.builtin_stages",
    "rltk.recipe_validation": "rltk.recipe_tools.validation",
    "rltk.recipe_utils": "rltk.recipe_tools.recipe_utils",
}


def test_every_old_top_level_name_is_the_moved_module_with_a_warning_naming_it():
    script = (
        "import importlib, json, sys, warnings\n"
        "moved = json.loads(sys.argv[1])\n"
        "for old, new in moved.items():\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        "        module = importlib.import_module(old)\n"
        "    assert module is importlib.import_module(new), (old, module)\n"
        "    assert any(issubclass(w.category, DeprecationWarning) and f'{old} moved to {new}' in str(w.message)\n"
        "               for w in caught), (old, [str(w.message) for w in caught])\n"
        "with warnings.catch_warnings(record=True):\n"
        "    warnings.simplefilter('always')\n"
        "    from rltk.stage_spec import StageSpec, rl_provides  # a from-import of an old name, as user code has it\n"
        "    from rltk.recipe_validation import parse_recipe_args\n"
        "import rltk, rltk.registration.stage_spec as spec, rltk.recipe_tools.validation as validation\n"
        "assert StageSpec is rltk.StageSpec is spec.StageSpec and rl_provides is spec.rl_provides\n"
        "assert parse_recipe_args is validation.parse_recipe_args\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", script, json.dumps(MOVED)], capture_output=True, text=True,
                         cwd=REPO, timeout=scaled(300))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok"]


def test_no_old_name_is_left_as_a_file_and_the_top_level_holds_at_most_15_modules():
    package = REPO / "rltk"
    assert not [old for old in MOVED if (package / f"{old.split('.', 1)[1]}.py").exists()]
    assert all((REPO / (new.replace(".", "/") + ".py")).is_file() for new in MOVED.values())
    assert len(list(package.glob("*.py"))) <= 15


def test_the_console_script_names_the_command_module_in_its_new_place():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["rltk"] == "rltk.commands.cli:console_main"
    assert project["entry-points"]["rltk"]["stages"] == "rltk.components.builtin_stages"
