"""The environment contract of multi-turn episodes.

An environment is what the policy talks to over several turns: it opens the
episode from a dataset row (the first chat messages), and answers each
assistant turn with the next observation (chat messages), a reward for that
turn, and whether the episode is over. The ``multi_turn`` workflow
(:mod:`rltk.workflows.multi_turn`) builds one instance per episode as
``cls(**env.environment_args)``, so an environment may keep the episode's
state on ``self``; instances are never reused across episodes.

Environments register under the kind ``environment``::

    @rltk.hookimpl
    def rltk_environments():
        return {"guess_number": GuessNumber}

What the workflow guarantees an environment:

* :meth:`Environment.reset` is called once, before any generation, with the
  row (a dict with ``prompt``/``messages``, ``ground_truth``, ``extras``, ``id``).
* :meth:`Environment.step` is called once per assistant turn that the
  workflow does not answer itself (with tools configured, turns that call
  tools are answered by the tools; see the workflow), never after ``done``.
* :meth:`Environment.close` is called once when the episode ends, however it ends.
* :meth:`Environment.check_args` (a classmethod) is called once with
  ``env.environment_args`` when the workflow is built, before any episode.
* An exception from ``reset`` or ``step`` ends that episode only (counted as
  an environment error; see the workflow for the reward it gets); training goes on.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from rltk.tools.base import ToolCall


@dataclass
class AssistantTurn:
    """One assistant turn as the environment sees it.

    Attributes:
        text: the decoded turn (special tokens skipped), tool-call markup included.
        tool_calls: the calls the tool parser found in ``text``, in order.
        parse_error: why part of ``text`` looked like a tool call but could not
            be parsed (malformed JSON, no name ...), or ``None``.
        token_ids: the turn's token ids exactly as the engine produced them.
        finish_reason: ``"stop"`` or ``"length"`` (cut by the per-turn token limit).
        index: 0 for the first assistant turn of the episode, 1 for the next ...
    """

    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    parse_error: str | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    index: int = 0


@dataclass
class StepResult:
    """What an environment answers to one assistant turn.

    Attributes:
        observation: chat messages appended after the assistant turn (role
            ``"user"`` or ``"tool"``); may be empty. Ignored when ``done``. A message's content
            may be a list of parts with images (``{"type": "image", "image": <PIL.Image, bytes, path,
            array>}``), which a vision-language policy sees with its next turn.
        reward: this turn's reward; it sits on the last token of the assistant
            turn it answers (``Experience.turn_rewards``) and adds to the episode score.
        done: the episode is over (no further turn is generated).
        info: anything JSON-able to keep with the episode (``Experience.info["env_info"]``).
    """

    observation: list[dict] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


class Environment(abc.ABC):
    """One instance per episode: the workflow builds ``cls(**env.environment_args)`` per episode.

    Subclass it, implement :meth:`reset` and :meth:`step`, and register the
    class under ``rltk_environments``. Both methods return chat messages
    (``{"role": ..., "content": ...}`` dicts) that the workflow renders with
    the tokenizer's chat template; a role the template does not know is an
    error of that episode.
    """

    @abc.abstractmethod
    def reset(self, row: dict) -> list[dict]:
        """The opening messages of the episode (system/user), built from ``row``."""

    @abc.abstractmethod
    def step(self, turn: AssistantTurn) -> StepResult:
        """Answer one assistant turn: the next observation, this turn's reward, whether it is over."""

    def close(self) -> None:
        """Release what the episode holds (a sandbox, a file); called once per episode. A no-op by default."""

    @classmethod
    def check_args(cls, **environment_args: Any) -> None:
        """Check ``env.environment_args`` once, before the first episode; raise naming the bad key.

        The workflow builds instances episode by episode and counts their failures, so a
        problem every episode would hit (a bad value, a server that is down) belongs here,
        where it stops the run at once (a :class:`rltk.errors.ConfigError` exits with 2).
        A no-op by default.
        """


def check_step_result(result: Any, where: str) -> StepResult:
    """``result`` as a :class:`StepResult`, or a ``TypeError``/``ValueError`` naming ``where`` and the bad field.

    The workflow calls this on every ``step`` return value, so a buggy
    environment fails its own episode with a message that says what it returned.
    """
    import math

    if not isinstance(result, StepResult):
        raise TypeError(f"{where}: step() must return a rltk.environments.base.StepResult, "
                        f"got {type(result).__name__}")
    check_messages(result.observation, f"{where}: StepResult.observation")
    if isinstance(result.reward, bool) or not isinstance(result.reward, (int, float)) \
            or not math.isfinite(result.reward):
        raise ValueError(f"{where}: StepResult.reward must be a finite number, got {result.reward!r}")
    if not isinstance(result.done, bool):
        raise TypeError(f"{where}: StepResult.done must be True or False, got {result.done!r}")
    if not isinstance(result.info, dict):
        raise TypeError(f"{where}: StepResult.info must be a dict, got {type(result.info).__name__}")
    return result


def check_messages(messages: Any, where: str) -> list[dict]:
    """``messages`` as a list of ``{"role": str, "content": str | [part, ...], ...}`` dicts, or an error naming
    ``where``. Content parts are the chat format's ``{"type": "text", "text": ...}`` and ``{"type": "image",
    "image": ...}`` (an image the policy sees with its next turn; :mod:`rltk.workflows.vision_turns`)."""
    if not isinstance(messages, list):
        raise TypeError(f"{where} must be a list of chat messages, got {type(messages).__name__}")
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        parts_ok = isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str)
                                                     for p in content)
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not (isinstance(content, str) or parts_ok):
            raise TypeError(f"{where}[{index}] must be a dict with string 'role' and 'content' (text, or a list of "
                            f"{{'type': ...}} content parts), got {message!r:.120}")
    return messages
