"""Builtin agents for the ``agentic`` workflow (kind ``agent``), and a worked example for writing one.

An agent is a plain function::

    def my_agent(row: dict, client: openai.OpenAI, model: str, **agent_args) -> float | None

It talks to the policy only through ``client`` (the official ``openai``
client, pointed at the endpoint rltk serves from the rollout engine, every
request already tagged with the episode's session id) and returns the
episode's reward, or ``None`` to let the configured reward function score the
text of its last completion against ``row["ground_truth"]``. rltk records the
exact tokens of every request, so the agent never deals with token ids or
log-probs. Register it like any component::

    @rltk.hookimpl
    def rltk_agents():
        return {"my_agent": my_agent}

and choose it with ``rollout.workflow=agentic rollout.workflow_args.agent=my_agent``.
"""

from __future__ import annotations

from typing import Any

import rltk


def arithmetic_chat(row: dict, client: Any, model: str, *, checks: int = 0, system_prompt: str | None = None,
                    check_prompt: str = "Check it. Answer:") -> None:
    """Ask the row's arithmetic problem over the chat API; ``checks`` follow-up turns ask for a re-check.

    The first user message is the row's ``prompt`` (e.g. ``"17+25="``). Each
    of the ``checks`` extra turns appends the assistant's answer and
    ``check_prompt`` as a new user message, so the policy may correct itself;
    the whole conversation is one stitched trajectory. Returns ``None``: the
    reward function scores the last answer.
    """
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": row["prompt"]})
    for turn in range(checks + 1):
        reply = client.chat.completions.create(model=model, messages=messages)
        answer = reply.choices[0].message.content or ""
        if turn < checks:
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": check_prompt}]
    return None


@rltk.hookimpl
def rltk_agents():
    return {"arithmetic_chat": arithmetic_chat}
