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
