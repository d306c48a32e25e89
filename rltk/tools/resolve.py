"""``env.tools`` as :class:`~rltk.tools.base.Tool` objects: the one place a tool name becomes a tool.

A name is a registered tool (kind ``tool``), bound with ``env.tools_args.<name>``,
or ``<server>.<tool>`` / ``<server>.*``: a tool, or every tool, of the MCP
server ``env.mcp_servers.<server>`` (:mod:`rltk.tools.mcp`). The warm-up's
prompts, the multi-turn workflow and an agent's tools all come from here, so the
tools block trained on is the one served.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rltk.errors import ConfigError
from rltk.tools.base import Tool


def is_mcp_name(name: str) -> bool:
    """``<server>.<tool>`` or ``<server>.*``: a tool of an MCP server (registered names have no dot)."""
    return "." in name


def resolve_tools(env: Mapping[str, Any] | None) -> list[Tool]:
    """The tools ``env.tools`` names, in its order (an MCP server's ``*``: the server's order), bound.

    Raises :class:`ConfigError` naming the ``env.tools`` entry for an unknown
    tool or server, a configured argument a tool refuses, and two tools the
    model would call by the same name.
    """
    from rltk.registry import get_registry

    env = env or {}
    names = env.get("tools") or []
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"'env.tools' must be a list of tool names, got {names!r}")
    servers = dict(env.get("mcp_servers") or {})
    tools_args = {k: dict(v or {}) for k, v in dict(env.get("tools_args") or {}).items()}
    tools: list[Tool] = []
    for name in names:
        if is_mcp_name(name):
            server, _, pattern = name.partition(".")
            if server not in servers:
                raise ConfigError(f"'env.tools' names '{name}', a tool of MCP server '{server}', but "
                                  f"'env.mcp_servers' has no '{server}' (it has: {', '.join(servers) or '(none)'})")
            if name in tools_args:
                raise ConfigError(f"'env.tools_args.{name}': a tool of an MCP server takes no configured "
                                  f"arguments (the server owns its configuration)")
            from rltk.tools.mcp import McpError, mcp_connection

            try:
                tools.extend(mcp_connection(server, servers[server]).tools(pattern))
            except McpError as exc:
                raise ConfigError(f"env.mcp_servers.{server}: {exc}") from exc
            continue
        base = get_registry().entry("tool", name, where="env.tools").obj
        try:
            tools.append(base.bind(**tools_args.get(name, {})))
        except ValueError as exc:
            raise ConfigError(f"env.tools_args.{name}: {exc}") from exc
    seen: dict[str, int] = {}
    for tool in tools:
        seen[tool.name] = seen.get(tool.name, 0) + 1
    clashes = sorted(n for n, count in seen.items() if count > 1)
    if clashes:
        raise ConfigError(f"'env.tools' gives the model two tools named {clashes} (from {list(names)}): the model "
                          f"calls tools by name, so each must be unique")
    return tools
