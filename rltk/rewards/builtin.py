"""rltk's builtin reward functions, registered like any plugin's (kind ``reward_fn``).

A reward function is called with keyword arguments only::

    fn(*, prompt: str, response: str, ground_truth: str, extras: dict, **args) -> float | dict[str, float]

where ``args`` come from the config and are checked
against the signature before training starts. ``reward_model`` and ``llm_judge``
are batched (:func:`rltk.rewards.batched`): one call per step, lists in and out. Combine several with
:func:`rltk.rewards.compose.build_reward_composer`.
"""

from __future__ import annotations

import rltk
from rltk.rewards.judges.llm_judge import llm_judge
from rltk.rewards.judges.reward_model import reward_model
from rltk.rewards.programs.code_execution import code_execution
from rltk.rewards.verifiable.choice import multiple_choice
from rltk.rewards.verifiable.countdown import countdown
from rltk.rewards.verifiable.format import format_tags
from rltk.rewards.verifiable.math import exact_match, math_answer


@rltk.hookimpl
def rltk_reward_fns():
    """The builtin reward functions, by the names configs use."""
    return {
        "exact_match": exact_match,
        "math_answer": math_answer,
        "countdown": countdown,
        "format_tags": format_tags,
        "multiple_choice": multiple_choice,
        "code_execution": code_execution,
        "reward_model": reward_model,
        "llm_judge": llm_judge,
    }
