"""Tool-call parsers: the assistant's text in, tool calls out (kind ``tool_parser``).

A parser is a class built as ``cls(**env.tool_parser_args)`` with one method,
``parse(text) -> (content, calls, error)``:

* ``content``: the text with every tool-call block removed (what the
  assistant said besides its calls), stripped;
* ``calls``: the well-formed :class:`~rltk.tools.base.ToolCall` objects, in order;
* ``error``: ``None``, or a message for the model saying what was malformed.
  A parser never raises on model output: a malformed call is the model's
  mistake, shown back to it as an error observation by the workflow.

Register one under ``rltk_tool_parsers``; the builtin is ``hermes``.
"""

from __future__ import annotations

import json
import re

import rltk
from rltk.tools.base import ToolCall


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen2.5 and Qwen3 templates).

    Each block holds one JSON object with a string ``name`` and an object
    ``arguments`` (absent means ``{}``; a JSON string holding an object, as
    OpenAI's API writes arguments, is accepted too). Problems reported as the
    error (the first one; the well-formed calls are still returned): a block
    whose JSON does not parse, a block that is not an object, a missing or
    empty name, arguments that are not an object, and an opening tag with no
    closing tag (a turn cut off mid-call).

    Args:
        start: the opening tag.
        end: the closing tag.
    """

    def __init__(self, start: str = "<tool_call>", end: str = "</tool_call>"):
        if not isinstance(start, str) or not start or not isinstance(end, str) or not end:
            raise ValueError(f"tool parser 'hermes': start and end (env.tool_parser_args) must be non-empty "
                             f"strings, got start={start!r}, end={end!r}")
        self.start, self.end = start, end
        self._block = re.compile(re.escape(start) + r"(.*?)" + re.escape(end), re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall], str | None]:
        """Split ``text`` into its content, its well-formed calls and the first error (or ``None``)."""
        calls: list[ToolCall] = []
        errors: list[str] = []
        for index, match in enumerate(self._block.finditer(text)):
            call, error = self._parse_block(match.group(1), index)
            if call is not None:
                calls.append(call)
            else:
                errors.append(error)
        rest = self._block.sub("", text)
        if self.start in rest:
            errors.append(f"a {self.start} has no closing {self.end}; write each call as "
                          f"{self.start}{{\"name\": ..., \"arguments\": {{...}}}}{self.end}")
            rest = rest[: rest.index(self.start)]
        return rest.strip(), calls, (errors[0] if errors else None)

    def _parse_block(self, body: str, index: int) -> tuple[ToolCall | None, str | None]:
        where = f"tool call {index + 1}"
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError) as exc:
            return None, f"{where} is not valid JSON ({_short(exc)}): {body.strip()[:80]!r}"
        if not isinstance(payload, dict):
            return None, f"{where} must be a JSON object with 'name' and 'arguments', got {type(payload).__name__}"
        name = payload.get("name")
        if not isinstance(name, str) or not name.strip():
            return None, f"{where} has no tool name (a non-empty string 'name')"
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):  # OpenAI writes arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError) as exc:
                return None, f"{where} ('{name}'): arguments are a string that is not JSON ({_short(exc)})"
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return None, f"{where} ('{name}'): arguments must be a JSON object, got {type(arguments).__name__}"
        return ToolCall(name=name.strip(), arguments=arguments, id=f"call_{index}"), None


def _short(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__


@rltk.hookimpl
def rltk_tool_parsers():
    return {"hermes": HermesToolParser}
