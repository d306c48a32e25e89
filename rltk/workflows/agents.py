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


def _opening(row: dict, system_prompt: str | None) -> list[dict]:
    from rltk.workflows.chat import row_messages

    messages = row_messages(row)
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def arithmetic_chat(row: dict, client: Any, model: str, *, checks: int = 0, system_prompt: str | None = None,
                    check_prompt: str = "Check it. Answer:") -> None:
    """Ask the row's arithmetic problem over the chat API; ``checks`` follow-up turns ask for a re-check.

    The opening messages are the row's (``messages``, else its ``prompt``, e.g.
    ``"17+25="``, as the user message; :func:`rltk.workflows.chat.row_messages`). Each
    of the ``checks`` extra turns appends the assistant's answer and
    ``check_prompt`` as a new user message, so the policy may correct itself;
    the whole conversation is one stitched trajectory. Returns ``None``: the
    reward function scores the last answer.
    """
    messages = _opening(row, system_prompt)
    for turn in range(checks + 1):
        reply = client.chat.completions.create(model=model, messages=messages)
        answer = reply.choices[0].message.content or ""
        if turn < checks:
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": check_prompt}]
    return None


def arithmetic_tools(row: dict, client: Any, model: str, *, max_turns: int = 3, tool: str = "calculator",
                     system_prompt: str | None = None) -> None:
    """Ask the row's arithmetic problem with a calculator tool offered; run each call the policy makes.

    The opening messages are the row's, as for :func:`arithmetic_chat`.

    The registered tool ``tool`` (builtin ``calculator``) is offered through
    ``tools=``; while the reply carries ``tool_calls`` (parsed by the endpoint's
    tool parser) each is run and its output, or its error, is sent back as a
    ``tool`` message, for at most ``max_turns`` requests. Returns ``None``: the
    reward function scores the last reply's text. The chat template must
    render the ``tool`` role and ``tools=``; assistant turns are sent back as
    the endpoint returned them, so a template that renders a tool call as the
    model wrote it keeps the episode one trajectory.
    """
    import json

    calculator = rltk.get_component("tool", tool)
    messages = _opening(row, system_prompt)
    for _ in range(max_turns):
        message = client.chat.completions.create(model=model, messages=messages,
                                                 tools=[calculator.schema()]).choices[0].message
        if not message.tool_calls:
            return None
        messages.append({"role": "assistant", "content": message.content or "",
                         "tool_calls": [{"id": call.id, "type": "function",
                                         "function": {"name": call.function.name,
                                                      "arguments": call.function.arguments}}
                                        for call in message.tool_calls]})
        for call in message.tool_calls:
            try:
                if call.function.name != calculator.name:
                    raise ValueError(f"unknown tool {call.function.name!r}; the only tool is {calculator.name!r}")
                output = calculator(**json.loads(call.function.arguments or "{}"))
            except Exception as exc:  # the model sees its mistake, as it would from any real tool
                output = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return None


@rltk.hookimpl
def rltk_agents():
    return {"arithmetic_chat": arithmetic_chat, "arithmetic_tools": arithmetic_tools}
