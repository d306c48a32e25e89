"""Tools of real MCP servers (the official SDK's, tests/tools/mcp_units_server.py) as rltk tools: listed with
the server's schemas, rendered through the chat template, called in a multi-turn episode over stdio and
Streamable HTTP; errors, timeouts and a dying server become counted tool errors; bad config exits 2."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from rltk.commands.cli import main  # noqa: E402
from rltk.errors import ConfigError  # noqa: E402
from rltk.rollout.base import SamplingParams  # noqa: E402
from rltk.tools.mcp import McpError, close_mcp_connections  # noqa: E402
from rltk.tools.resolve import resolve_tools  # noqa: E402
from rltk.workflows.multi_turn import MultiTurnWorkflow  # noqa: E402
from tests.builtin_plugins import ensure_registered  # noqa: E402
from tests.workflows.multi_turn_helpers import MatchReward, ScriptedEngine, tool_tokenizer  # noqa: E402
from tests.waits import scaled, wait_until

SERVER = Path(__file__).with_name("mcp_units_server.py")
STDIO = {"command": [sys.executable, str(SERVER)], "timeout_s": 20}


@pytest.fixture(autouse=True)
def fresh_connections():
    ensure_registered("tools", "tool_parsers", "multi_turn")
    yield
    close_mcp_connections()


def env(tools, server=None, **settings):
    return {"tools": tools, "mcp_servers": {"units": {**(server or STDIO), **settings}}}


def call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def episode(tools_env, script):
    tok = tool_tokenizer()
    wf = MultiTurnWorkflow(engine=ScriptedEngine(tok, script), tokenizer=tok, reward=MatchReward(),
                           sampling=SamplingParams(n=1, max_new_tokens=200), env=tools_env)
    (experience,) = wf.run([{"prompt": "3 km in m?", "ground_truth": "3000", "extras": {}, "id": "r0"}])
    return tok, wf, experience


def test_a_servers_tools_arrive_with_its_names_descriptions_and_schemas():
    tools = resolve_tools(env(["calculator", "units.*"]))
    assert [t.name for t in tools] == ["calculator", "convert", "fail", "slow", "crash", "secret"]
    convert = tools[1].schema()["function"]
    assert convert["description"] == "Convert a length between km, m and cm."
    assert convert["parameters"]["required"] == ["value", "from_unit", "to_unit"]
    assert convert["parameters"]["properties"]["value"]["type"] == "number"
    assert [t.name for t in resolve_tools(env(["units.convert"]))] == ["convert"]  # one tool by name
    assert tools[1](value=3, from_unit="km", to_unit="m") == "3000"


def test_a_multi_turn_episode_calls_the_mcp_tool_and_reads_its_result():
    tok, wf, e = episode(env(["units.convert"]), [call("convert", value=3, from_unit="km", to_unit="m"), "3000"])
    # the template's tools block names the server's tool, as the model is served it
    assert tok.decode(e.prompt_ids).startswith("<|system|>tools: convert<|eos|>")
    assert e.info["messages"][2] == {"role": "tool", "content": "3000", "name": "convert", "tool_call_id": "call_0"}
    assert (e.info["tool_calls"], e.info["tool_errors"], e.score) == (1, 0, 1.0)


def test_the_server_runs_with_the_configured_environment():
    tools = resolve_tools(env(["units.secret"], env={"UNITS_GREETING": "hello"}))
    assert tools[0]() == "hello"


def test_an_error_the_server_flags_is_an_error_observation_and_counted():
    _, wf, e = episode(env(["units.fail"]), [call("fail", reason="no such unit"), "3000"])
    observation = e.info["messages"][2]["content"]
    assert observation.startswith("error: McpError: tool 'fail' of MCP server 'units' failed")
    assert e.info["tool_errors"] == 1 and wf.metrics()["rollout/tool_errors"] == 1.0


def test_a_call_past_the_timeout_is_an_error_naming_the_server_and_the_next_call_works():
    tools = {t.name: t for t in resolve_tools(env(["units.*"], timeout_s=1))}
    start = time.perf_counter()
    with pytest.raises(McpError, match=r"MCP server 'units' .* did not answer tools/call 'slow' within "
                                       r"timeout_s=1 s"):
        tools["slow"](seconds=30)
    assert time.perf_counter() - start < scaled(5)
    assert tools["convert"](value=5, from_unit="m", to_unit="cm") == "500"


def test_a_server_that_dies_is_an_error_and_the_next_call_starts_it_again():
    tools = {t.name: t for t in resolve_tools(env(["units.*"]))}
    with pytest.raises(McpError, match="MCP server 'units'"):
        tools["crash"]()
    assert tools["convert"](value=2, from_unit="km", to_unit="m") == "2000"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_over_streamable_http():
    port = free_port()
    server = subprocess.Popen([sys.executable, str(SERVER), "--port", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + scaled(60)
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=scaled(1)).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.fail(f"the MCP test server did not start listening within {scaled(60):.0f} s")
                time.sleep(0.2)
        _, _, e = episode(env(["units.convert"], server={"url": f"http://127.0.0.1:{port}/mcp"}),
                          [call("convert", value=7, from_unit="m", to_unit="cm"), "3000"])
        assert e.info["messages"][2]["content"] == "700"
    finally:
        server.terminate()
        server.wait(timeout=scaled(30))


def test_a_tool_the_server_does_not_serve_is_a_config_error_listing_what_it_serves():
    with pytest.raises(ConfigError, match=r"MCP server 'units' has no tool 'kelvin'; it serves: convert, fail"):
        resolve_tools(env(["units.kelvin"]))


def test_a_server_that_cannot_start_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match=r"env.mcp_servers.units: .*could not connect"):
        resolve_tools(env(["units.*"], server={"command": [sys.executable, "-c", "import sys; sys.exit(1)"],
                                                "connect_timeout_s": 20}))


def test_two_tools_with_one_name_are_refused():
    with pytest.raises(ConfigError, match=r"two tools named \['convert'\]"):
        resolve_tools({"tools": ["units.convert", "again.convert"],
                       "mcp_servers": {"units": STDIO, "again": STDIO}})


MULTI_TURN = ["rollout.workflow=multi_turn", "model.tiny.tool_role=true"]


@pytest.mark.parametrize("overrides, message", [
    (["env.tools=[units.convert]"], "'env.mcp_servers' has no 'units'"),
    (["env.tools=[units.convert]", "env.mcp_servers={units: {command: [python], url: 'http://x'}}"],
     "'env.mcp_servers.units' needs exactly one of 'command'"),
    (["env.tools=[units.convert]", "env.mcp_servers={units: {command: python}}"],
     "'env.mcp_servers.units.command' must be a non-empty list of strings"),
    (["env.tools=[units.convert]", "env.mcp_servers={units: {url: 'http://x', timeout: 3}}"],
     "'env.mcp_servers.units' has unknown key(s) ['timeout']"),
])
def test_bad_mcp_config_exits_2_naming_the_key(capsys, overrides, message):
    assert main(["validate", "grpo", *MULTI_TURN, *overrides]) == 2
    assert message in capsys.readouterr().err


def dead(pid: int) -> bool:
    """Whether process ``pid`` has ended: gone, or a zombie (ended, not yet reaped by whoever adopted it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_server_hanging_in_its_handshake_is_killed_and_does_not_hold_rltks_output_open(tmp_path):
    # the server (and a child of it) would sleep 60 s; before, it outlived `rltk validate`, holding the stderr
    # pipe, so a caller reading rltk's output to its end waited the whole 60 s
    pid_file = tmp_path / "pids"
    # rltk's handshake clock starts when it spawns the server: the server's own start (a Python interpreter,
    # seconds on a loaded machine) must fit in it, or rltk kills it before it hangs and nothing is tested
    connect_s = scaled(2)
    server = {"command": [sys.executable, str(Path(__file__).with_name("mcp_hang_server.py")), str(pid_file)],
              "connect_timeout_s": connect_s}
    command = [sys.executable, "-m", "rltk.commands.cli", "validate", "grpo", *MULTI_TURN, "env.tools=[hang.*]",
               f"env.mcp_servers={{hang: {json.dumps(server)}}}"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).parents[2])
    pids: list[int] = []
    try:
        # the server writes its pids once it runs (and its child with it); rltk ending first means it gave up on
        # the server before that: a start slower than connect_s, not a hang
        wait_until(pid_file.exists, f"the hang server's pids (rltk ended first: the server took over "
                                    f"connect_timeout_s={connect_s:g} s to start)", 120,
                   alive=lambda: proc.poll() is None)
        started = time.monotonic()
        pids = [int(p) for p in pid_file.read_text().split()]
        out, err = proc.communicate(timeout=scaled(30))  # end of output: every writer of both pipes has closed them
        # the rest of the handshake, the SDK's 2 s for the server to leave once its stdin closes, then SIGTERM
        # (SIGKILL 2 s later), and rltk's own exit: about 6 s on a quiet machine; 60 s when the server outlived rltk
        assert time.monotonic() - started < connect_s + scaled(10), time.monotonic() - started
        assert proc.returncode == 2, (out, err)
        assert f"did not finish connecting within connect_timeout_s={connect_s:g} s".encode() in err
        assert all(dead(pid) for pid in pids), [Path(f"/proc/{p}/stat").read_text() for p in pids if not dead(p)]
    finally:
        for pid in pids:  # only when the test failed: leave nothing running
            if not dead(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
