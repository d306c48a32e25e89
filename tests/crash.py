"""A simulated crash at a chosen global step, for the tests that resume a run after one."""

from __future__ import annotations

import types
from contextlib import contextmanager

import rltk


class Crash(RuntimeError):
    """Raised by the crashing plugin; it stops the run as a LifecycleHookError naming the plugin."""


@contextmanager
def crash_at_step(step: int):
    """Run the body with a plugin whose ``rltk_on_step_end`` raises :class:`Crash` at global ``step``.

    The body must crash there: ``rltk.commands.cli.main`` reports the hook's error and
    returns 1, a recipe called directly raises :class:`rltk.LifecycleHookError`
    with the Crash as its cause, naming the plugin.
    """
    plugin = types.ModuleType(f"crash_at_step_{step}")
    crashed = []

    @rltk.hookimpl
    def rltk_on_step_end(step: int) -> None:
        if step == crash_step:
            crashed.append(step)
            raise Crash(f"simulated crash at step {step}")

    crash_step = step
    plugin.rltk_on_step_end = rltk_on_step_end
    rltk.register_plugin(plugin, name="crasher")
    try:
        try:
            yield
        except rltk.LifecycleHookError as exc:
            assert isinstance(exc.__cause__, Crash) and exc.plugin == "crasher", exc
        assert crashed == [crash_step], f"the run never reached step {crash_step}, so it did not crash there"
    finally:
        rltk.unregister_plugin("crasher")


#: A script that runs ``rltk`` (``sys.argv[2:]``) with a plugin exiting 3 at the end of global step
#: ``sys.argv[1]``: after that step's metrics, before its checkpoint. For runs launched as processes
#: of their own (torchrun), where :func:`crash_at_step` cannot reach.
CRASH_DRIVER = '''
import sys, types
import rltk
from rltk.commands.cli import main

crash_step = int(sys.argv[1])
crasher = types.ModuleType("crasher")

@rltk.hookimpl
def rltk_on_step_end(step):
    if step == crash_step:
        raise SystemExit(3)

crasher.rltk_on_step_end = rltk_on_step_end
rltk.register_plugin(crasher, name="crasher")
sys.exit(main(sys.argv[2:]))
'''
