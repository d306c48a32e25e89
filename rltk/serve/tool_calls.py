"""Tool calls in generated text, for the endpoint's ``tool_calls`` responses.

The endpoint parses a chat completion with a *named* tool-call parser. Parsers
are the registered kind ``tool_parser`` (``rltk.tools.parsers``, builtin
``hermes``) where that kind exists; until then, and for ``hermes`` alone, this
module's own parser of the Hermes / Qwen2.5 format is used::

    <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>

A parser returns ``(content_without_calls, calls, error)``; a call is anything
with ``name``, ``arguments`` (a dict) and ``id``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ParsedToolCall:
    """One parsed call (the fields of ``rltk.tools.base.ToolCall``)."""

    name: str
    arguments: dict
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def parse_hermes(text: str) -> tuple[str, list[ParsedToolCall], str | None]:
    """Split ``<tool_call>{json}</tool_call>`` blocks out of ``text``.

    Returns the text with the blocks removed (stripped), the calls in order,
    and an error naming the first malformed block (bad JSON, no ``name``,
    ``arguments`` not an object, or an unclosed ``<tool_call>``), or ``None``.
    Calls before a malformed block are still returned.
    """
    calls: list[ParsedToolCall] = []
    error = None
    for number, match in enumerate(_HERMES.finditer(text)):
        body = match.group(1).strip()
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as exc:
            error = f"tool call {number}: not valid JSON ({exc.msg} at char {exc.pos}): {body[:200]!r}"
            break
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            error = f"tool call {number}: expected an object with a string 'name', got {body[:200]!r}"
            break
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):  # some models emit the OpenAI wire form, a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            error = f"tool call {number} ({payload['name']!r}): 'arguments' must be an object, got {arguments!r}"
            break
        calls.append(ParsedToolCall(payload["name"], arguments))
    content = _HERMES.sub("", text)
    if error is None and "<tool_call>" in content:
        error = "unclosed <tool_call>: the text has <tool_call> without a matching </tool_call>"
    return content.strip(), calls, error


def get_tool_parser(name: str) -> Callable[[str], tuple[str, list[Any], str | None]]:
    """The parser registered as ``name`` (kind ``tool_parser``), or this module's ``hermes``.

    Raises ``LookupError`` naming the valid parsers for an unknown name.
    """
    import rltk
    from rltk.registry import KINDS

    if "tool_parser" in KINDS:
        parser = rltk.get_component("tool_parser", name)
        if isinstance(parser, type):  # a parser class: instantiate with no arguments
            parser = parser()
        return parser.parse if hasattr(parser, "parse") else parser
    if name != "hermes":
        raise LookupError(f"unknown tool parser {name!r}; valid: ['hermes']")
    return parse_hermes
