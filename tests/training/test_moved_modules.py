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
    assert all((package / room.replace(".", "/") / f"{name}.py").is_file() for name, room in MOVED.items())
    assert sorted(p.name for p in package.glob("*.py")) == ["__init__.py"]  # a new module goes into a room


def test_the_second_house_steps_moves_keep_every_old_name_for_a_release():
    """The async wing, the reward rooms, ConfigError's one home and the tiny MoE: every old name imports the very
    module under its new one, with a DeprecationWarning naming it, each in a fresh process (an old name is
    importable before anything else of rltk was), and ``python -m`` of the old producer name still runs it."""
    script = (
        "import importlib, sys, warnings\n"
        "old, new = sys.argv[1:]\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    module = importlib.import_module(old)\n"
        "assert module is importlib.import_module(new), (module, new)\n"
        "assert any(issubclass(w.category, DeprecationWarning) and f'{old} moved' in str(w.message)\n"
        "           and new in str(w.message) for w in caught), [str(w.message) for w in caught]\n"
        "print('ok')\n")
    moved = {
        "rltk.buffer.queue": "rltk.training.rollouts.asynchronous.queue",
        "rltk.training.rollouts.async_rollout": "rltk.training.rollouts.asynchronous.async_rollout",
        "rltk.training.rollouts.producer": "rltk.training.rollouts.asynchronous.producer",
        "rltk.training.rollouts.ray_cluster": "rltk.training.scaffold.ray_cluster",
        "rltk.training.producer": "rltk.training.rollouts.asynchronous.producer",
        "rltk.rewards.math": "rltk.rewards.verifiable.math",
        "rltk.rewards.sandbox": "rltk.rewards.programs.sandbox",
        "rltk.rewards.reward_model": "rltk.rewards.judges.reward_model",
        "rltk.config.errors": "rltk.errors",
        "rltk.models.tiny_moe": "rltk.models.tiny",
    }
    for old, new in moved.items():
        out = subprocess.run([sys.executable, "-c", script, old, new], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and out.stdout.split() == ["ok"], (old, out.stderr[-2000:])
    # every alias the packages declare points at a module file that exists
    import importlib.util

    import rltk.buffer, rltk.config, rltk.rewards, rltk.training.rollouts  # noqa: E401, F401  (each declares its own)
    from rltk.notices import moved_modules

    declared = moved_modules()
    assert set(moved) - {"rltk.models.tiny_moe", "rltk.training.producer"} <= set(declared)
    assert all(importlib.util.find_spec(new) is not None for new in declared.values())
    ran = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-m", "rltk.training.rollouts.producer",
                          "--help"], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0 and "rltk.training.rollouts.asynchronous.producer" in ran.stdout, ran.stderr[-2000:]
    assert "rltk.training.rollouts.producer moved to rltk.training.rollouts.asynchronous.producer" in ran.stderr


def test_rltk_config_config_error_is_the_one_error_with_a_warning():
    import warnings

    import rltk.config
    from rltk.errors import ConfigError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert rltk.config.ConfigError is ConfigError
    assert any("rltk.config.ConfigError moved to rltk.errors.ConfigError" in str(w.message) for w in caught)
