"""The async wing (rltk.training.rollouts.asynchronous) serves only ``one_step_off``/``async`` stages: a
synchronous run never imports it, and only two doors lead in."""

from __future__ import annotations

import subprocess
import sys

from tests.test_layers import edges

WING = "rltk.training.rollouts.asynchronous"

#: who may import the wing: the rollout source's dispatch on trainer.mode (inside the function that opens an
#: asynchronous stage's source), and ``rltk produce``, which runs a producer
DOORS = {"rltk.training.rollouts.rollout_source", "rltk.commands.produce"}


def test_only_the_two_doors_import_the_async_wing():
    inside = {a for a, targets in edges().items() if not a.startswith(WING) and any(
        b == WING or b.startswith(WING + ".") for b in targets)}
    assert inside == DOORS, f"modules outside the async wing that import it: {sorted(inside - DOORS)}"


def test_a_synchronous_stage_loads_none_of_the_wing():
    script = (
        "import sys\n"
        "import rltk.commands.cli, rltk.training.rollouts.rollout_source, rltk.training.stages.loop_state\n"
        "import rltk.training.stages.run, rltk.training.stages.step_end, rltk.training.stages.sft_stage\n"
        "import rltk.training.updates.rl, rltk.training.updates.ppo\n"
        f"print(sorted(m for m in sys.modules if m.startswith({WING!r})))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["[]"]
