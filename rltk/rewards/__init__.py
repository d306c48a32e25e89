"""Reward functions, their composition, and how they run (in-process or in worker processes).

How rewards run:

* :mod:`rltk.rewards.builtin`: the builtin reward functions, registered like any plugin's (kind ``reward_fn``).
* :mod:`rltk.rewards.marks`: ``@bounded`` and ``@batched``, what a reward function says about its work.
* :mod:`rltk.rewards.compose`: weighted combinations that survive a failing or hanging component.
* :mod:`rltk.rewards.pool`: worker processes, where a timeout really stops the call.
* :mod:`rltk.rewards.ray_service`: a reward function run by Ray actors of its own (``launcher=ray``).

The reward functions, a room per concern:

* :mod:`rltk.rewards.verifiable`: answers checked by rule (``exact_match``, ``math_answer``, ``countdown``,
  ``format_tags``).
* :mod:`rltk.rewards.programs`: the model's program run against tests in a sandbox (``code_execution``).
* :mod:`rltk.rewards.judges`: a model scores the response (``reward_model``, ``llm_judge``), and the HTTP
  they call a server with.

Until 2026-12 the rooms' modules sat flat in this package; their old names (``rltk.rewards.math`` ...)
keep working for one release, with a ``DeprecationWarning`` naming the new one.
"""

from rltk.notices import alias_moved_modules
from rltk.rewards.marks import batched, bounded, is_batched, is_bounded

#: module -> the room it moved to (``rltk.rewards.<module>`` is now ``rltk.rewards.<room>.<module>``).
MOVED = {
    **dict.fromkeys(("math", "countdown", "format"), "verifiable"),
    **dict.fromkeys(("code_execution", "assert_tests", "plain_data", "sandbox", "sandbox_launcher"), "programs"),
    **dict.fromkeys(("reward_model", "reward_server", "llm_judge", "http"), "judges"),
}

alias_moved_modules({f"{__name__}.{module}": f"{__name__}.{room}.{module}" for module, room in MOVED.items()})

__all__ = ["batched", "bounded", "is_batched", "is_bounded"]
