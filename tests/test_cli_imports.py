"""The ``rltk`` command starts without torch (issue 55 item 5), and still reports the errors of modules that do.

``rltk.commands.cli`` names two errors whose modules import torch (the divergence guard's ``TrainingDiverged``,
exit 3; ``CheckpointFileError``, exit 1) without importing them: :func:`rltk.commands.cli.main` finds their
classes among the loaded modules. The import graph is checked in a fresh interpreter, never by a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.waits import scaled

REPO = Path(__file__).resolve().parents[1]


def test_the_command_line_module_and_its_parser_import_no_torch():
    code = ("import json, sys; from rltk.commands.cli import build_parser, main; build_parser(); "
            "code = main(['list', 'no_such_kind']); "
            "print(json.dumps([code, [m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules]]))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=scaled(120))
    assert out.returncode == 0, out.stderr
    code, loaded = json.loads(out.stdout.splitlines()[-1])
    assert code == 2 and "unknown component kind 'no_such_kind'" in out.stderr  # a usage error, answered at once
    assert loaded == []


def _raising(exc):
    def command(args):
        raise exc
    return command


def test_main_still_gives_a_diverged_run_exit_3_and_a_refused_checkpoint_exit_1(monkeypatch, capsys):
    from rltk.commands import cli
    from rltk.serialization import CheckpointFileError
    from rltk.training.scaffold.guard import EXIT_DIVERGED, TrainingDiverged

    diverged = TrainingDiverged("the policy's entropy collapsed at step 7", symptom="entropy_zero", step=7,
                                checkpoint=None)
    monkeypatch.setitem(cli.COMMANDS, "plugins", _raising(diverged))
    assert cli.main(["plugins"]) == EXIT_DIVERGED == 3
    assert capsys.readouterr().err == "rltk: error: the policy's entropy collapsed at step 7\n"

    monkeypatch.setitem(cli.COMMANDS, "plugins", _raising(CheckpointFileError("step_1/model.pt", "not a zip file")))
    assert cli.main(["plugins"]) == 1
    assert capsys.readouterr().err == "rltk: error: step_1/model.pt: not a zip file\n"

    monkeypatch.setitem(cli.COMMANDS, "plugins", _raising(RuntimeError("a bug")))  # anything else: a traceback
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["plugins"])
