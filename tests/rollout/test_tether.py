"""``rltk.rollout.tether``: a launched server ends with the process that launched it, however that ends.

A stand-in server here (the vLLM one is in ``tests/rollout/test_vllm_server.py``): a process that starts a
child of its own, its "engine", which like vLLM's engine core outlives a SIGKILLed server; on SIGTERM the
server stops its engine and notes it in its file, as vLLM's API server does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.processes import gone_within, running
from tests.waits import scaled

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc are Linux's")

SERVER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    out, mode = sys.argv[1], sys.argv[2]
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

    def stop(signum, frame):
        with open(out, "a") as f:
            f.write("SIGTERM\\n")
        engine.terminate()
        engine.wait()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    with open(out, "w") as f:
        f.write(f"{os.getppid()} {os.getpid()} {engine.pid}\\n")
    if mode == "crash":
        os._exit(7)  # the engine left behind
    time.sleep(600)
""")

# The launcher starts the tether from a thread that ends at once: a PR_SET_PDEATHSIG set by the launcher's
# own child would fire then (the kernel ties it to the forking thread), the tether's must not.
LAUNCHER = textwrap.dedent("""
    import subprocess, sys, threading, time
    from rltk.rollout import tether
    server, out, mode, files = sys.argv[1:5]
    started = []
    thread = threading.Thread(target=lambda: started.append(subprocess.Popen(
        tether.command([sys.executable, server, out, mode], grace_s=5, remove=files), start_new_session=True)))
    thread.start()
    thread.join()
    print(started[0].pid, flush=True)
    print(started[0].wait(), flush=True)
    time.sleep(600)
""")


@pytest.fixture
def launch(tmp_path):
    """launch(mode) -> (launcher, (relay pid, keeper pid), server pid, engine pid, the server's file); the
    tether is to remove the folder ``<mode>-files`` once the launcher is gone; everything left is killed
    after the test."""
    started = []
    (tmp_path / "server.py").write_text(SERVER)
    (tmp_path / "launcher.py").write_text(LAUNCHER)

    def start(mode: str):
        out, files = tmp_path / f"{mode}.txt", tmp_path / f"{mode}-files"
        files.mkdir()
        (files / "model.safetensors").write_bytes(b"weights")
        launcher = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"), str(tmp_path / "server.py"),
                                     str(out), mode, str(files)], stdout=subprocess.PIPE, text=True)
        tether_pid = int(launcher.stdout.readline())
        deadline = time.monotonic() + scaled(60)
        while not out.exists() or not out.read_text().endswith("\n"):
            assert time.monotonic() < deadline, f"the stand-in server did not start within {scaled(60):.0f} s"
            time.sleep(0.05)
        keeper, server, engine = map(int, out.read_text().split())
        started.append((launcher, [tether_pid, keeper, server, engine]))
        return launcher, (tether_pid, keeper), server, engine, out

    yield start
    for launcher, pids in started:
        launcher.kill()
        launcher.wait()
        for pid in pids:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_sigkilled_launcher_takes_the_server_and_its_engine_with_it(launch):
    launcher, (relay, keeper), server, engine, out = launch("serve")
    time.sleep(1.0)  # the thread that started the tether has ended: everything still runs
    assert all(running(pid) for pid in (relay, keeper, server, engine))
    launcher.kill()
    launcher.wait()
    # the relay looks at its parent every 0.25 s, the keeper at the relay; the server stops its engine at once
    assert gone_within([relay, keeper, server, engine], 15), [running(p) for p in (relay, keeper, server, engine)]
    assert out.read_text().splitlines()[1:] == ["SIGTERM"]  # asked to stop, so it could stop its engine
    assert not (out.parent / "serve-files").exists()  # the files the launcher's close() would have removed


def test_a_sigkilled_relay_as_a_ray_worker_leaves_its_children_still_stops_the_server(launch):
    launcher, (relay, keeper), server, engine, out = launch("serve")
    os.kill(relay, signal.SIGKILL)
    assert launcher.stdout.readline().strip() == "-9"  # what the launcher sees of the server
    assert gone_within([keeper, server, engine], 15), [running(p) for p in (keeper, server, engine)]
    assert out.read_text().splitlines()[1:] == ["SIGTERM"]


def test_a_sigkilled_keeper_has_the_kernel_ask_its_server_to_stop(launch):
    launcher, (relay, keeper), server, engine, out = launch("serve")
    os.kill(keeper, signal.SIGKILL)
    assert gone_within([server, engine], 15), [running(p) for p in (server, engine)]
    assert out.read_text().splitlines()[1:] == ["SIGTERM"]  # PR_SET_PDEATHSIG
    assert launcher.stdout.readline().strip() == str(128 + signal.SIGKILL)  # the relay passes the keeper's on


def test_a_server_that_crashes_leaves_nothing_behind_and_its_status_is_the_tethers(launch):
    launcher, (relay, keeper), server, engine, out = launch("crash")
    assert launcher.stdout.readline().strip() == "7"  # tether.wait(): the server's exit status
    # the engine, orphaned by the crash, was handed to the keeper (a subreaper), which stopped it
    assert gone_within([relay, keeper, server, engine], 15)
    assert out.read_text().splitlines()[1:] == []  # the server itself was never asked
    assert (out.parent / "crash-files" / "model.safetensors").exists()  # the launcher lives: its files are its own


def test_a_tether_with_no_command_or_a_parent_already_gone_refuses_or_stops():
    from rltk.rollout import tether

    with pytest.raises(SystemExit) as exc:
        tether.main(["--parent", "1"])
    assert exc.value.code == 2
    # a parent that is not this process's parent: the command is stopped at once (SIGTERM: status 143)
    done = subprocess.run(tether.command([sys.executable, "-c", "import time; time.sleep(60)"], parent=1,
                                         grace_s=5), capture_output=True, text=True, timeout=scaled(60))
    assert done.returncode == 128 + signal.SIGTERM
    assert "the process that started this server is gone" in done.stderr
