"""Tools served by Model Context Protocol servers, callable as rltk tools.

``env.mcp_servers`` names the servers, each reached over stdio (``command``: rltk
starts it as a subprocess) or over Streamable HTTP (``url``: started by the user)::

    env:
      mcp_servers:
        units: {command: [python, units_server.py], timeout_s: 10}
        search: {url: "http://10.0.0.5:8000/mcp"}
      tools: [calculator, units.convert, search.*]

In ``env.tools``, ``<server>.<tool>`` selects one tool of a server and
``<server>.*`` all of them, in the server's order. The model sees each tool by
the server's own name, with the server's description and JSON schema rendered
through the chat template like any registered tool's; the text of a call's
result is the observation. A result the server flags as an error, a server that
does not answer within ``timeout_s``, or one that died, raises in the call, so
the workflow shows the model ``error: ...`` and counts it in
``rollout/tool_errors``, as for any failing tool; the next call reconnects (a
stdio server is started again).

Each process keeps one connection per server (:func:`mcp_connection`), opened
on first use and closed at exit. The connection lives in a background thread's
event loop, since the MCP client is asynchronous and the workflows call tools
from ordinary threads; every wait on it is bounded. A stdio server ends with its
connection on every way out, a handshake that ran out of ``connect_timeout_s``
included (:meth:`McpConnection._end_session`): none outlives rltk, holding its
stderr open.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
from collections.abc import Mapping
from typing import Any

from rltk.errors import ConfigError
from rltk.tools.base import Tool

#: keys of one ``env.mcp_servers.<name>`` entry
SERVER_KEYS = ("command", "url", "env", "cwd", "timeout_s", "connect_timeout_s")
#: seconds a stdio server's shutdown may take: the SDK's 2 s for it to exit once its stdin closes, 2 s after
#: SIGTERM before SIGKILL, 2 s to reap, and slack
SERVER_STOP_S = 10.0


class McpError(RuntimeError):
    """A call to an MCP server failed: it flagged an error, timed out, or the connection is gone."""


def check_server_config(name: str, spec: Any) -> dict:
    """``env.mcp_servers.<name>`` as a plain dict, or :class:`ConfigError` naming the key and what is valid."""
    where = f"env.mcp_servers.{name}"
    if not isinstance(spec, Mapping):
        raise ConfigError(f"'{where}' must be a mapping with 'command' (a list: the stdio server's argv) or 'url' "
                          f"(a Streamable HTTP endpoint), got {spec!r}")
    spec = dict(spec)
    unknown = sorted(set(spec) - set(SERVER_KEYS))
    if unknown:
        raise ConfigError(f"'{where}' has unknown key(s) {unknown}; valid: {', '.join(SERVER_KEYS)}")
    command, url = spec.get("command"), spec.get("url")
    if (command is None) == (url is None):
        raise ConfigError(f"'{where}' needs exactly one of 'command' (a list: the stdio server's argv, e.g. "
                          f"[python, server.py]) or 'url' (e.g. http://host:8000/mcp)")
    if command is not None and (isinstance(command, str) or not command
                                or not all(isinstance(c, str) for c in command)):
        raise ConfigError(f"'{where}.command' must be a non-empty list of strings (argv), got {command!r}")
    if url is not None and not (isinstance(url, str) and url.startswith(("http://", "https://"))):
        raise ConfigError(f"'{where}.url' must be an http(s) URL, got {url!r}")
    for key in ("timeout_s", "connect_timeout_s"):
        value = spec.get(key)
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
            raise ConfigError(f"'{where}.{key}' must be a positive number of seconds, got {value!r}")
    if spec.get("env") is not None and not (isinstance(spec["env"], Mapping)
                                            and all(isinstance(v, str) for v in spec["env"].values())):
        raise ConfigError(f"'{where}.env' must map variable names to strings, got {spec['env']!r}")
    return spec


class McpConnection:
    """One MCP server: its tools, listed once, and calls to them, each bounded by ``timeout_s``."""

    def __init__(self, name: str, spec: Mapping[str, Any]):
        spec = check_server_config(name, spec)
        self.name = name
        self.command = list(spec["command"]) if spec.get("command") else None
        self.url = spec.get("url")
        self.env = dict(spec.get("env") or {})
        self.cwd = spec.get("cwd")
        self.timeout_s = float(spec.get("timeout_s") or 30.0)
        self.connect_timeout_s = float(spec.get("connect_timeout_s") or 60.0)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"rltk-mcp-{name}", daemon=True)
        self._thread.start()
        self._lock = threading.Lock()
        self._client = None
        self._closing: asyncio.Event | None = None
        self._session_task: asyncio.Future | None = None
        self._listing: list[Any] | None = None

    # ------------------------------------------------------------------ connection

    def _target(self):
        if self.url:
            return self.url
        from mcp import StdioServerParameters

        # The server's environment: the parent's (PATH, the venv) plus what the config sets.
        return StdioServerParameters(command=self.command[0], args=self.command[1:], env={**os.environ, **self.env},
                                     cwd=self.cwd)

    def _describe(self) -> str:
        return f"MCP server '{self.name}' ({self.url or ' '.join(self.command)})"

    async def _hold_session(self, ready: asyncio.Future) -> None:
        """Open the client, hand it over through ``ready``, and keep it open until :meth:`close` (one task,
        since the client's cancel scopes must be entered and left by the same task)."""
        from mcp import Client

        try:
            # the client's own read timeout is a backstop only: the caller's wait of timeout_s ends first and
            # says what was waited for (at equal limits a loaded machine let either fire first)
            async with Client(self._target(), read_timeout_seconds=self.timeout_s + 5.0) as client:
                self._closing = asyncio.Event()
                ready.set_result(client)
                await self._closing.wait()
        except BaseException as exc:  # noqa: BLE001  (reported to the waiting caller; the task ends here)
            if not ready.done():
                ready.set_exception(exc)

    def _connect(self) -> None:
        async def start():
            ready = self._loop.create_future()
            self._session_task = asyncio.ensure_future(self._hold_session(ready))
            return await ready

        future = asyncio.run_coroutine_threadsafe(start(), self._loop)
        try:
            self._client = future.result(timeout=self.connect_timeout_s)
        except TimeoutError:
            # The session task is still in the handshake, holding a live server: end it (and the server with it)
            # before saying so, or the server outlives rltk, holding rltk's stderr open.
            future.cancel()
            self._end_session(self._session_task, grace_s=0.0)
            raise McpError(f"{self._describe()} did not finish connecting within connect_timeout_s="
                           f"{self.connect_timeout_s:g} s") from None
        except Exception as exc:
            raise McpError(f"{self._describe()}: could not connect: {_reason(exc)}") from exc
        except BaseException:  # Ctrl-C while connecting: the server must not outlive us either
            future.cancel()
            self._end_session(self._session_task, grace_s=0.0)
            raise

    def _run(self, what: str, coroutine_fn) -> Any:
        """``coroutine_fn(client)`` on the loop, connecting first if needed; bounded by ``timeout_s``."""
        with self._lock:
            if self._client is None or (self._session_task is not None and self._session_task.done()):
                self._client = None
                self._connect()
            client = self._client
        future = asyncio.run_coroutine_threadsafe(coroutine_fn(client), self._loop)
        try:
            return future.result(timeout=self.timeout_s)
        except TimeoutError:
            future.cancel()
            raise McpError(f"{self._describe()} did not answer {what} within timeout_s={self.timeout_s:g} s") from None
        except McpError:
            raise
        except Exception as exc:
            self._drop()  # a broken connection is reopened by the next call
            raise McpError(f"{self._describe()}: {what} failed: {_reason(exc)}") from exc

    def _drop(self) -> None:
        with self._lock:
            if self._closing is not None:
                self._loop.call_soon_threadsafe(self._closing.set)
            self._client, self._closing = None, None

    def _end_session(self, task: asyncio.Future | None, grace_s: float) -> None:
        """Wait ``grace_s`` for the session ``task`` to end on its own, then cancel it, and wait for it to end.

        Ending the task is what ends a stdio server: the SDK's client, left by cancellation too, closes the
        server's stdin, waits 2 s, then SIGTERMs the server's process group (the server runs in a session of
        its own, so its children go too), SIGKILLs it 2 s later and reaps it; shielded, and bounded by about
        7 s. This waits for that, so no server process outlives the call (nor rltk, holding its stderr).
        """
        if task is None or not self._loop.is_running():
            return

        async def end():
            if not task.done() and grace_s > 0:
                await asyncio.wait([task], timeout=grace_s)
            if not task.done():
                task.cancel()
                await asyncio.wait([task], timeout=SERVER_STOP_S)

        try:
            asyncio.run_coroutine_threadsafe(end(), self._loop).result(timeout=grace_s + SERVER_STOP_S + 5)
        except Exception:  # noqa: BLE001  (ending a session that failed: its failure is already reported)
            pass

    def close(self) -> None:
        """End the session (a stdio server process exits with it, or is killed) and stop the loop's thread."""
        task = self._session_task
        self._drop()
        # a session that is still connecting has no `_closing` to set: `_end_session` cancels it
        self._end_session(task, grace_s=SERVER_STOP_S)
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------ tools

    def listing(self) -> list[Any]:
        """The server's tools (``mcp_types.Tool``), listed once per connection."""
        if self._listing is None:
            async def list_all(client):
                tools, cursor = [], None
                while True:
                    page = await client.list_tools(cursor=cursor)
                    tools.extend(page.tools)
                    cursor = page.next_cursor
                    if not cursor:
                        return tools

            self._listing = self._run("tools/list", list_all)
        return self._listing

    def call(self, tool: str, arguments: dict) -> str:
        """The text of ``tool``'s result on ``arguments``; :class:`McpError` if the server flags an error."""
        result = self._run(f"tools/call '{tool}'", lambda client: client.call_tool(tool, arguments))
        text = "\n".join(_content_text(item) for item in result.content)
        if result.is_error:
            raise McpError(f"tool '{tool}' of MCP server '{self.name}' failed: {text or 'no message'}")
        return text

    def tools(self, pattern: str = "*") -> list[Tool]:
        """The server's tools as :class:`Tool` objects: all (``*``) or the one named ``pattern``."""
        listing = self.listing()
        chosen = listing if pattern == "*" else [t for t in listing if t.name == pattern]
        if not chosen:
            raise ConfigError(f"'env.tools': MCP server '{self.name}' has no tool '{pattern}'; it serves: "
                              f"{', '.join(t.name for t in listing) or '(none)'}")
        return [Tool(_caller(self, t.name), name=t.name, description=t.description or "",
                     parameters=dict(t.input_schema)) for t in chosen]


def _caller(connection: McpConnection, tool: str):
    def call(**arguments: Any) -> str:
        return connection.call(tool, arguments)

    call.__name__ = tool
    return call


def _content_text(item: Any) -> str:
    """A result item as text: its text, else a placeholder naming its type (images and audio are not shown)."""
    text = getattr(item, "text", None)
    return text if isinstance(text, str) else f"[{getattr(item, 'type', type(item).__name__)} content]"


def _reason(exc: BaseException) -> str:
    """The first leaf of an exception group (anyio wraps transport errors), as ``Type: message``."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


_CONNECTIONS: dict[str, tuple[dict, McpConnection]] = {}
_CONNECTIONS_LOCK = threading.Lock()


def mcp_connection(name: str, spec: Mapping[str, Any]) -> McpConnection:
    """This process's connection to server ``name``: one per server and configuration, reused."""
    spec = check_server_config(name, spec)
    with _CONNECTIONS_LOCK:
        held = _CONNECTIONS.get(name)
        if held is not None and held[0] == spec:
            return held[1]
        if held is not None:
            held[1].close()
        connection = McpConnection(name, spec)
        _CONNECTIONS[name] = (spec, connection)
        return connection


@atexit.register
def close_mcp_connections() -> None:
    """Close every server connection of this process (stdio servers exit with theirs)."""
    with _CONNECTIONS_LOCK:
        held = list(_CONNECTIONS.values())
        _CONNECTIONS.clear()
    for _, connection in held:
        connection.close()
