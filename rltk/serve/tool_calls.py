"""The endpoint's tool-call parser: a registered ``tool_parser`` (:mod:`rltk.tools.parsers`, builtin ``hermes``).

A chat completion requested with ``tools`` is parsed by the parser named in
:func:`rltk.serve.app.create_app` (``--tool-parser`` of ``rltk serve``, the
``tool_parser`` argument of the agentic workflow), exactly as the
``multi_turn`` workflow parses its turns.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable


def get_tool_parser(name: str, args: Mapping[str, Any] | None = None) -> Callable[[str], tuple[str, list, str | None]]:
    """``parse(text) -> (content, calls, error)`` of the parser registered as ``name``, built with ``args``.

    An unknown name raises :class:`rltk.registry.RegistryError` listing the registered parsers.
    """
    import rltk

    parser = rltk.get_component("tool_parser", name)
    if isinstance(parser, type):
        parser = parser(**dict(args or {}))
    return parser.parse if hasattr(parser, "parse") else parser
