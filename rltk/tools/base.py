"""The tool contract: a function with an OpenAI function-calling schema.

A :class:`Tool` is what the policy may call during a multi-turn episode. Its
:meth:`Tool.schema` is rendered into the prompt through the chat template's
``tools=`` argument (the format of OpenAI function calling, which Qwen,
Hermes and Llama templates read); a tool-call parser (:mod:`rltk.tools.parsers`)
turns the assistant's text into :class:`ToolCall` objects; the workflow calls
the tool with the call's arguments and shows the returned string to the model
as a ``tool`` message.

Tools register under the kind ``tool``::

    @rltk.hookimpl
    def rltk_tools():
        return {"calculator": calculator}

Arguments of two sorts reach the function:

* the model's, listed in ``parameters`` (a JSON schema of an object), checked
  by :meth:`Tool.__call__` before the function runs;
* configured ones (``env.tools_args.<tool>``), bound once by :meth:`Tool.bind`:
  every other parameter of the function (with the :func:`tool` decorator's
  derived schema, the keyword-only ones), never visible to the model.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list, tuple), "object": (dict,), "null": (type(None),),
}
_PY_TO_JSON = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


class ToolArgumentError(ValueError):
    """The model called a tool with arguments its schema refuses (missing, unknown, wrong type)."""


@dataclass
class ToolCall:
    """One call the policy made: the tool's name, its arguments, and an id unique within the turn."""

    name: str
    arguments: dict
    id: str = "call_0"


class Tool:
    """A callable tool with an OpenAI function-calling schema.

    Args:
        fn: the function; called as ``fn(**model_arguments, **bound_arguments)``.
            Its return value is shown to the model as text (``str(value)``).
        name: the name the model calls it by (``[A-Za-z0-9_-]+``).
        description: what it does, for the model (rendered into the prompt).
        parameters: JSON schema of its arguments: ``{"type": "object",
            "properties": {...}, "required": [...]}``.
        bound: configured arguments (see :meth:`bind`).
    """

    def __init__(self, fn: Callable[..., Any], *, name: str, description: str, parameters: dict,
                 bound: dict | None = None):
        if not callable(fn):
            raise TypeError(f"Tool '{name}': fn must be callable, got {type(fn).__name__}")
        if not isinstance(name, str) or not name or not all(c.isalnum() or c in "_-" for c in name):
            raise ValueError(f"Tool name must be non-empty letters, digits, '_' or '-', got {name!r}")
        if not isinstance(description, str):
            raise TypeError(f"Tool '{name}': description must be a string, got {type(description).__name__}")
        _check_schema(name, parameters)
        self.fn = fn
        self.name = name
        self.description = description
        self.parameters = parameters
        self.bound = dict(bound or {})
        self.__doc__ = description  # `rltk list` shows a component's docstring

    # ------------------------------------------------------------------ schema

    def schema(self) -> dict:
        """``{"type": "function", "function": {"name", "description", "parameters"}}`` (OpenAI function calling)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def configurable(self) -> list[str]:
        """Parameters of ``fn`` that configs may bind (``env.tools_args``): those the model does not see."""
        params, _ = _signature(self.fn)
        visible = set(self.parameters.get("properties", {}))
        return [n for n in params if n not in visible]

    def bind(self, **arguments: Any) -> "Tool":
        """A copy of this tool with configured ``arguments`` fixed (``env.tools_args.<name>``).

        Raises ``ValueError`` naming the tool, the bad argument and the
        configurable ones when an argument is one the model passes or one
        the function does not take.
        """
        params, takes_kwargs = _signature(self.fn)
        visible = set(self.parameters.get("properties", {}))
        valid = self.configurable()
        for arg in arguments:
            if arg in visible:
                raise ValueError(f"tool '{self.name}': '{arg}' is an argument the model passes, not a configured "
                                 f"one. Configurable: {', '.join(valid) or '(none)'}")
            if arg not in params and not takes_kwargs:
                raise ValueError(f"tool '{self.name}' has no argument '{arg}'. Configurable: "
                                 f"{', '.join(valid) or '(none)'}")
        return Tool(self.fn, name=self.name, description=self.description, parameters=self.parameters,
                    bound={**self.bound, **arguments})

    # ------------------------------------------------------------------ calling

    def check_arguments(self, arguments: Any) -> dict:
        """``arguments`` if the schema accepts them, else :class:`ToolArgumentError` saying why.

        Checks what tool calls get wrong in practice: not an object, a
        required argument missing, an argument the schema does not list
        (unless ``additionalProperties`` allows it), and the JSON type of each
        listed argument (``integer`` refuses ``2.5`` and ``true``; ``number``
        refuses ``nan``), plus ``enum``.
        """
        if not isinstance(arguments, dict):
            raise ToolArgumentError(f"tool '{self.name}' takes an object of arguments, got {type(arguments).__name__}")
        properties = self.parameters.get("properties", {})
        missing = [n for n in self.parameters.get("required", []) if n not in arguments]
        if missing:
            raise ToolArgumentError(f"tool '{self.name}' is missing required argument(s) {missing}")
        if self.parameters.get("additionalProperties", False) is False:
            unknown = sorted(set(arguments) - set(properties))
            if unknown:
                raise ToolArgumentError(f"tool '{self.name}' has no argument(s) {unknown}; "
                                        f"its arguments are {sorted(properties)}")
        for key, value in arguments.items():
            spec = properties.get(key)
            if not isinstance(spec, dict):
                continue
            expected = spec.get("type")
            if isinstance(expected, str) and not _json_type_ok(value, expected):
                raise ToolArgumentError(
                    f"tool '{self.name}': argument '{key}' must be of type {expected}, got {value!r:.60}")
            if "enum" in spec and value not in spec["enum"]:
                raise ToolArgumentError(f"tool '{self.name}': argument '{key}' must be one of {spec['enum']}, "
                                        f"got {value!r:.60}")
        return arguments

    def __call__(self, **arguments: Any) -> str:
        """Run the tool on the model's ``arguments`` (checked first) and return its output as text."""
        self.check_arguments(arguments)
        result = self.fn(**arguments, **self.bound)
        return result if isinstance(result, str) else str(result)

    def __repr__(self) -> str:
        return f"Tool(name={self.name!r}, parameters={sorted(self.parameters.get('properties', {}))})"


def tool(fn: Callable | None = None, *, name: str | None = None, description: str | None = None,
         parameters: dict | None = None) -> Any:
    """Turn a plain function into a :class:`Tool`; use as ``@tool`` or ``@tool(name=..., ...)``.

    Defaults: ``name`` is the function's name, ``description`` its
    docstring's first paragraph, and ``parameters`` is derived from its
    signature: each positional-or-keyword parameter becomes a property typed
    from its annotation (``str`` string, ``int`` integer, ``float`` number,
    ``bool`` boolean, ``list`` array, ``dict`` object; anything else untyped),
    required when it has no default. Keyword-only parameters (after ``*``)
    stay out of the schema: they are the configured arguments
    (``env.tools_args``), bound with :meth:`Tool.bind`.

    Example::

        @tool
        def add(a: int, b: int, *, modulus: int = 0) -> str:
            \"\"\"Add two integers.\"\"\"
            return str((a + b) % modulus if modulus else a + b)
    """

    def wrap(function: Callable) -> Tool:
        doc = inspect.getdoc(function) or ""
        return Tool(function, name=name or function.__name__,
                    description=description if description is not None else doc.split("\n\n")[0].strip(),
                    parameters=parameters if parameters is not None else schema_from_signature(function))

    return wrap(fn) if fn is not None else wrap


def schema_from_signature(fn: Callable) -> dict:
    """The JSON schema of ``fn``'s positional-or-keyword parameters (see :func:`tool`)."""
    properties: dict[str, dict] = {}
    required: list[str] = []
    hints = _annotations(fn)
    for param in inspect.signature(fn).parameters.values():
        if param.kind is not param.POSITIONAL_OR_KEYWORD:
            continue
        spec: dict[str, Any] = {}
        json_type = _PY_TO_JSON.get(hints.get(param.name))
        if json_type:
            spec["type"] = json_type
        properties[param.name] = spec
        if param.default is param.empty:
            required.append(param.name)
    return {"type": "object", "properties": properties, "required": required}


def _annotations(fn: Callable) -> dict[str, Any]:
    try:
        import typing

        return typing.get_type_hints(fn)
    except Exception:  # unresolvable string annotations: leave those parameters untyped
        return {}


def _signature(fn: Callable) -> tuple[dict[str, inspect.Parameter], bool]:
    sig = inspect.signature(fn)
    params = {n: p for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return params, any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


def _json_type_ok(value: Any, expected: str) -> bool:
    if expected not in _JSON_TYPES:
        return True  # a type this check does not know: let the tool judge
    if expected in ("integer", "number") and isinstance(value, bool):
        return False
    if expected == "number" and isinstance(value, float) and not math.isfinite(value):
        return False
    return isinstance(value, _JSON_TYPES[expected])


def _check_schema(name: str, parameters: Any) -> None:
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ValueError(f"Tool '{name}': parameters must be a JSON schema of an object "
                         f"({{'type': 'object', 'properties': {{...}}}}), got {parameters!r:.120}")
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict):
        raise ValueError(f"Tool '{name}': parameters['properties'] must be a dict, got {properties!r:.80}")
    required = parameters.get("required", [])
    if not isinstance(required, list) or any(r not in properties for r in required):
        raise ValueError(f"Tool '{name}': parameters['required'] must list names from properties "
                         f"{sorted(properties)}, got {required!r}")
