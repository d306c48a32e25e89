"""Builtin agents for the ``agentic`` workflow (kind ``agent``), the helper that runs their tool calls,
and a worked example for writing one.

An agent is a plain function::

    def my_agent(row: dict, client: openai.OpenAI, model: str, *, tools: list[Tool], **agent_args)
        -> float | None | tuple[float | None, dict[str, float]]

It talks to the policy only through ``client`` (the official ``openai``
client, pointed at the endpoint rltk serves from the rollout engine, every
request already tagged with the episode's session id) and returns the
episode's reward, or ``None`` to let the configured reward function score the
text of its last completion against ``row["ground_truth"]``; or a pair
``(reward or None, {name: number})`` whose numbers are logged as
``agent/<name>`` (their mean over the step's episodes). rltk records the
exact tokens of every request, so the agent never deals with token ids or
log-probs.

Tools. An agent that names a ``tools`` parameter gets the tools of
``env.tools`` (registered ``tool`` components, bound with ``env.tools_args``),
in that order: it offers them with ``tools=[t.schema() for t in tools]`` and
runs the calls of a reply with :func:`run_tool_calls`. The supervised warm-up
renders the same list into its demonstrations, so the prompt the policy is
trained on and the prompt it is served are one text. Register it like any
component::

    @rltk.hookimpl
    def rltk_agents():
        return {"my_agent": my_agent}

and choose it with ``rollout.workflow=agentic rollout.workflow_args.agent=my_agent``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


def _field(obj: Any, name: str) -> Any:
    """``obj.name`` of an ``openai`` response object, or ``obj[name]`` of the same thing as a dict."""
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def run_tool_calls(message: Any, tools: Sequence[Any] | Mapping[str, Any]) -> list[dict]:
    """The assistant turn ``message`` as a chat message, then one ``tool`` message per tool call it makes.

    ``message`` is a reply's ``choices[0].message`` (an ``openai`` object, or the same as a dict);
    ``tools`` the :class:`~rltk.tools.base.Tool` objects the agent offered (the ``tools`` the
    agentic workflow gives an agent), or ``{name: tool}``. Append the result to the
    conversation and send it back::

        messages += run_tool_calls(reply.choices[0].message, tools)

    The assistant message carries the calls exactly as the endpoint returned them (id, name,
    arguments as JSON text), so the chat template renders the turn the policy wrote and the next
    request extends the last one: one stitched trajectory per episode. Each call's result is its
    tool's output; a call the tool cannot serve (an unknown name, arguments that are not JSON or
    that the tool's schema refuses, a tool that raises) gets ``"error: ..."``, which the model
    reads as it would any tool's error, and which the endpoint counts in ``rollout/tool_errors``
    as the ``multi_turn`` workflow does. A message without calls gives just the assistant message.
    """
    import json

    table = dict(tools) if isinstance(tools, Mapping) else {tool.name: tool for tool in tools}
    calls = list(_field(message, "tool_calls") or [])
    turn: dict[str, Any] = {"role": "assistant", "content": _field(message, "content") or ""}
    if calls:
        turn["tool_calls"] = []
    results = []
    for number, call in enumerate(calls):
        function = _field(call, "function")
        name, arguments = _field(function, "name"), _field(function, "arguments")
        call_id = _field(call, "id") or f"call_{number}"
        text = arguments if isinstance(arguments, str) else json.dumps(arguments or {})
        turn["tool_calls"].append({"id": call_id, "type": "function",
                                   "function": {"name": name, "arguments": text}})
        tool = table.get(name)
        try:
            if tool is None:
                raise LookupError(f"unknown tool {name!r}; available: {', '.join(sorted(table)) or '(none)'}")
            try:
                parsed = json.loads(text or "{}")
            except json.JSONDecodeError as exc:
                raise ValueError(f"arguments are not valid JSON ({exc})") from None
            if not isinstance(parsed, dict):
                raise ValueError(f"arguments must be a JSON object, got {text!r:.60}")
            output = tool(**parsed)
        except Exception as exc:  # the model sees its mistake, as it would from any real tool
            output = f"error: {exc}"
        results.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": output})
    return [turn, *results]


def arithmetic_tools(row: dict, client: Any, model: str, *, tools: list, max_turns: int = 3,
                     system_prompt: str | None = None) -> None:
    """Ask the row's arithmetic problem with the tools of ``env.tools`` offered; run each call the policy makes.

    The opening messages are the row's, as for :func:`arithmetic_chat`; ``tools``
    (``env.tools``, e.g. ``[calculator]``) are offered through ``tools=``. While the
    reply carries ``tool_calls`` (parsed by the endpoint's tool parser) they are
    run by :func:`run_tool_calls`, for at most ``max_turns`` requests. Returns
    ``None``: the reward function scores the last reply's text. The chat template
    must render the ``tool`` role and ``tools=``.
    """
    messages = _opening(row, system_prompt)
    schemas = [tool.schema() for tool in tools]
    for _ in range(max_turns):
        message = client.chat.completions.create(model=model, messages=messages,
                                                 tools=schemas).choices[0].message
        if not message.tool_calls:
            return None
        messages += run_tool_calls(message, tools)
    return None

@rltk.hookimpl
def rltk_agents():
    return {"arithmetic_chat": arithmetic_chat, "arithmetic_tools": arithmetic_tools}
