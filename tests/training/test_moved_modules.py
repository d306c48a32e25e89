"""The training loop's modules moved into rooms (and the commands into rltk.commands): the old names keep
working for one release, each the very module in its new place, with a warning naming it."""

from __future__ import annotations

import subprocess
import sys

from rltk.training import MOVED

from tests.waits import scaled


def test_every_old_name_imports_the_module_in_its_room_and_says_where_it_went():
    script = (
        "import importlib, warnings\n"
        "from rltk.training import MOVED\n"
        "for name, room in sorted(MOVED.items()):\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        "        old = importlib.import_module(f'rltk.training.{name}')\n"
        "    new = importlib.import_module(f'rltk.training.{room}.{name}')\n"
        "    assert old is new, name\n"
        "    [w] = [w for w in caught if issubclass(w.category, DeprecationWarning)]\n"
        "    assert f'rltk.training.{name} moved to rltk.training.{room}.{name}' in str(w.message), w.message\n"
        "from rltk.training.run import Stage  # a from-import of the old name, as user code has it\n"
        "assert Stage.__module__ == 'rltk.training.stages.run'\n"
        "for old, new in (('cli', 'cli'), ('serve_command', 'serve'), ('produce_command', 'produce')):\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        "        module = importlib.import_module(f'rltk.{old}')\n"
        "    assert module is importlib.import_module(f'rltk.commands.{new}'), old\n"
        "    assert any(f'rltk.{old} moved to rltk.commands.{new}' in str(w.message) for w in caught), old\n"
        "print('ok', len(MOVED))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok", str(len(MOVED))]


def test_every_old_name_points_at_a_file_in_its_room_and_none_is_left_flat():
    from pathlib import Path

    import rltk.training as training

    package = Path(training.__file__).parent
    assert all((package / room / f"{name}.py").is_file() for name, room in MOVED.items())
    assert sorted(p.name for p in package.glob("*.py")) == ["__init__.py"]  # a new module goes into a room
