"""Loading rltk and every builtin plugin must not import DeepSpeed: importing it costs seconds and, on
a machine without a GPU, warns "Setting accelerator to CPU" even when DeepSpeed is not the strategy."""

from __future__ import annotations

import subprocess
import sys

from tests.waits import scaled


def run_python(code: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_loading_every_plugin_and_the_cli_does_not_import_deepspeed():
    out = run_python("import sys, rltk; from rltk.registry import get_registry; get_registry(); import rltk.commands.cli; "
                     "import rltk.strategies.deepspeed_strategy; print('deepspeed' in sys.modules)")
    assert out.stdout.strip() == "False"


def test_rltk_list_prints_no_deepspeed_warning():
    out = run_python("import sys; from rltk.commands.cli import main; sys.exit(main(['list', 'training_strategy']))")
    assert "deepspeed" in out.stdout  # listed as a strategy, without being imported
    assert "Setting accelerator" not in out.stdout + out.stderr
