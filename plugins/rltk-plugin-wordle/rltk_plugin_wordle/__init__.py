"""An installable multi-turn rltk plugin: Wordle as an environment, a tool and a task.

``pip install ./plugins/rltk-plugin-wordle``, then::

    rltk run grpo --config plugins/rltk-plugin-wordle/configs/wordle.yaml
    # or, on any config:
    rltk run grpo rollout.workflow=multi_turn env.environment=wordle env.tools=[wordle_candidates] data.task=wordle

Components (see :mod:`rltk_plugin_wordle.game`):

* environment ``wordle`` (:class:`Wordle`): feedback per guess, per-turn rewards on new greens;
* tool ``wordle_candidates``: the words still consistent with the guesses so far;
* task ``wordle`` (:func:`wordle_task`), where rltk has pluggable tasks (hook ``rltk_tasks``).
"""

from __future__ import annotations

import rltk
from rltk import hookspecs
from rltk_plugin_wordle.game import WORDS, Wordle, candidates, feedback, parse_history, wordle_candidates, wordle_task

__all__ = ["WORDS", "Wordle", "candidates", "feedback", "parse_history", "wordle_candidates", "wordle_task"]


@rltk.hookimpl
def rltk_environments():
    return {"wordle": Wordle}


@rltk.hookimpl
def rltk_tools():
    return {"wordle_candidates": wordle_candidates}


# rltk refuses a plugin that implements a hook it does not know (a misspelt hook would register
# nothing), so the task is offered only to an rltk that has pluggable tasks.
if hasattr(hookspecs, "rltk_tasks"):

    @rltk.hookimpl
    def rltk_tasks():
        return {"wordle": wordle_task}
