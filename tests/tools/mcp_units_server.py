"""An MCP server for the tests, on the official SDK: stdio by default, Streamable HTTP with ``--port``.

Tools: ``convert`` (lengths), ``fail`` (the server flags an error), ``slow`` (sleeps), ``crash`` (the
process exits mid-call) and ``secret`` (reads an environment variable the config passes).
"""

from __future__ import annotations

import argparse
import os
import time

from mcp.server import MCPServer

app = MCPServer("units")
SCALE = {"km": 1000.0, "m": 1.0, "cm": 0.01}


@app.tool()
def convert(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a length between km, m and cm."""
    return f"{value * SCALE[from_unit] / SCALE[to_unit]:g}"


@app.tool()
def fail(reason: str) -> str:
    """Always fails."""
    raise ValueError(reason)


@app.tool()
def slow(seconds: float) -> str:
    """Answers after `seconds`."""
    time.sleep(seconds)
    return "done"


@app.tool()
def crash() -> str:
    """Ends the server's process."""
    os._exit(3)


@app.tool()
def secret() -> str:
    """The server's UNITS_GREETING variable."""
    return os.environ.get("UNITS_GREETING", "unset")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int)
    args = parser.parse_args()
    if args.port:
        app.run(transport="streamable-http", host="127.0.0.1", port=args.port)
    else:
        app.run()
