"""Environment ``guess_number``: higher/lower feedback for the ``guess_number`` task's rows.

The same game is also an agent (:func:`guess_number_agent`, kind ``agent``)
for the ``agentic`` workflow: there the agent's own loop, written against the
``openai`` client, gives the feedback instead of rltk's ``multi_turn`` loop.

The episode opens with the row's messages (``"guess 1-31"``). Each assistant
turn should be one integer; the environment answers ``"higher"`` when the
secret is larger, ``"lower"`` when it is smaller, and ends the episode with a
reward when the guess is the secret. A turn that is not an integer gets the
reply ``"a number"`` and counts as a guess. The episode's turn limit is the
workflow's ``env.max_turns``; ``max_guesses`` ends it sooner (reward 0).

Reward of a solved episode: ``decay ** (guesses - 1)``, 1 with the default
``decay=1.0`` however many guesses it took (the turn limit is what asks for
a binary search); ``decay < 1`` also rewards solving in fewer guesses (then
an episode scores 1, the accuracy threshold, only on a first-guess win, so
read ``eval/mean_score``).
"""

from __future__ import annotations

import math
import re

import rltk
from rltk.data.multi_turn_tasks import HIGHER, LOWER
from rltk.environments.base import AssistantTurn, Environment, StepResult

#: Reply to a turn that is not an integer.
NOT_A_NUMBER = "a number"
_INTEGER = re.compile(r"\s*(-?\d{1,6})\s*")


class GuessNumber(Environment):
    """Higher/lower feedback on guesses of ``extras["secret"]`` (rows of the ``guess_number`` task).

    Args:
        decay: a solved episode's reward is ``decay ** (guesses - 1)``, in ``(0, 1]``.
        max_guesses: end the episode unsolved (reward 0) after this many
            guesses; ``None`` leaves the limit to ``env.max_turns``.
    """

    def __init__(self, *, decay: float = 1.0, max_guesses: int | None = None):
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0 \
                or not math.isfinite(decay):
            raise ValueError(f"guess_number: env.environment_args.decay must be in (0, 1], got {decay!r}")
        if max_guesses is not None and (isinstance(max_guesses, bool) or not isinstance(max_guesses, int)
                                        or max_guesses < 1):
            raise ValueError(f"guess_number: env.environment_args.max_guesses must be an integer >= 1 or null, "
                             f"got {max_guesses!r}")
        self.decay = float(decay)
        self.max_guesses = max_guesses
        self.secret: int | None = None
        self.guesses = 0

    def reset(self, row: dict) -> list[dict]:
        """The row's opening messages; the secret comes from ``extras["secret"]``."""
        extras = row.get("extras") or {}
        if "secret" not in extras:
            raise KeyError(f"guess_number: row {row.get('id')!r} has no extras['secret']; the environment plays rows "
                           f"of the guess_number task (data.task=guess_number). Its extras: {sorted(extras)}")
        self.secret, self.guesses = int(extras["secret"]), 0
        messages = row.get("messages")
        if messages:
            return [dict(m) for m in messages]
        return [{"role": "user", "content": str(row["prompt"])}]

    def step(self, turn: AssistantTurn) -> StepResult:
        """``"higher"`` / ``"lower"`` / ``"a number"``, or the end with ``decay ** (guesses - 1)`` when solved."""
        self.guesses += 1
        match = _INTEGER.fullmatch(turn.text)
        guess = int(match.group(1)) if match else None
        info = {"guess": guess, "secret": self.secret}
        if guess == self.secret:
            return StepResult([], reward=self.decay ** (self.guesses - 1), done=True,
                              info={**info, "solved": True, "guesses": self.guesses})
        if self.max_guesses is not None and self.guesses >= self.max_guesses:
            return StepResult([], reward=0.0, done=True, info={**info, "solved": False, "guesses": self.guesses})
        reply = NOT_A_NUMBER if guess is None else HIGHER if self.secret > guess else LOWER
        return StepResult([{"role": "user", "content": reply}], info=info)


def guess_number_agent(row: dict, client, model: str, *, max_turns: int = 5, decay: float = 1.0,
                       max_tokens: int | None = None) -> float:
    """Play one ``guess_number`` episode through the OpenAI chat API; the reward as :class:`GuessNumber` gives it.

    Sends the row's opening messages, reads each reply as a guess, and
    appends the reply and the :class:`GuessNumber` feedback as the next
    messages, until the guess is the secret or ``max_turns`` replies were
    made. Returns ``decay ** (guesses - 1)`` when solved, else 0.

    Args:
        row: a row of the ``guess_number`` task (``messages``, ``extras["secret"]``).
        client: an ``openai.OpenAI`` client (the ``agentic`` workflow's, pointed at the policy).
        model: the model id to request.
        max_turns: replies before the episode is lost.
        decay: as :class:`GuessNumber`'s.
        max_tokens: ``max_tokens`` of each request (``None``: the endpoint's default).
    """
    env = GuessNumber(decay=decay, max_guesses=max_turns)
    messages = env.reset(row)
    extra = {} if max_tokens is None else {"max_tokens": max_tokens}
    while True:
        reply = client.chat.completions.create(model=model, messages=messages, **extra)
        text = reply.choices[0].message.content or ""
        result = env.step(AssistantTurn(text=text))
        if result.done:
            return float(result.reward)
        messages = messages + [{"role": "assistant", "content": text}, *result.observation]


@rltk.hookimpl
def rltk_environments():
    return {"guess_number": GuessNumber}


@rltk.hookimpl
def rltk_agents():
    return {"guess_number": guess_number_agent}
