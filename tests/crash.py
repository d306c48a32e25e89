"""A simulated crash at a chosen global step, for the tests that resume a run after one."""

from __future__ import annotations

import types
from contextlib import contextmanager

import pytest

import rltk


class Crash(RuntimeError):
    """Raised by the crashing plugin; nothing in rltk catches it."""


@contextmanager
def crash_at_step(step: int):
    """Run the body with a plugin whose ``rltk_on_step_end`` raises :class:`Crash` at global ``step``;
    the body must crash there (``pytest.raises``)."""
    plugin = types.ModuleType(f"crash_at_step_{step}")

    @rltk.hookimpl
    def rltk_on_step_end(step: int) -> None:
        if step == crash_step:
            raise Crash(f"simulated crash at step {step}")

    crash_step = step
    plugin.rltk_on_step_end = rltk_on_step_end
    rltk.register_plugin(plugin, name="crasher")
    try:
        with pytest.raises(Crash):
            yield
    finally:
        rltk.unregister_plugin("crasher")
