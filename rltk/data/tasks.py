"""rltk's builtin synthetic tasks, registered under the kind ``task`` like any plugin's.

``data.task`` names one of them; ``data.task_args`` are its keyword
arguments. A plugin adds a task the same way::

    @rltk.hookimpl
    def rltk_tasks():
        return {"my_task": my_task}   # my_task(split, size, seed, **args) -> list[row]
"""

from __future__ import annotations

import rltk
from rltk.data.multi_turn_tasks import calculator_arithmetic, guess_number
from rltk.data.synthetic import arithmetic, countdown
from rltk.data.visual_tasks import shape_colour


@rltk.hookimpl
def rltk_tasks():
    return {
        "arithmetic": arithmetic,
        "countdown": countdown,
        "guess_number": guess_number,
        "calculator_arithmetic": calculator_arithmetic,
        "shape_colour": shape_colour,
    }
