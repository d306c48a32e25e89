"""The ``code_execution`` reward: scores on hand-checkable programs, and hostile programs really run.

Every hostile program below is executed in the real sandbox (namespaces, rlimits, a private root):
each is stopped, scores 0, lands in its ``killed/*`` / ``denied`` / ``errors`` count, and the test
then checks the machine: the file it tried to write does not exist, the secret it tried to read is
not what it printed, no process of a sandbox uid is left, this process's children are as before.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from rltk.errors import ConfigError
from rltk.rewards.compose import build_reward_composer
from rltk.batch import Experience
from rltk.rewards.programs import sandbox
from rltk.rewards.programs.code_execution import check_args, code_execution, extract_program, parse_tests
from rltk.workflows.base import reward_means

from tests.waits import scaled

REPO = Path(__file__).resolve().parents[2]
LIMITS = {"timeout_s": 2.0, "cpu_s": 1, "memory_mb": 256, "processes": 16, "file_size_mb": 1}
needs_sandbox = pytest.mark.skipif(
    os.geteuid() != 0 and (sys.platform != "linux" or sandbox.check_sandbox() is not None),
    reason="this machine cannot run the sandbox (as root it always runs these: a broken sandbox fails them)")


def sandbox_uids(pids) -> set[int]:
    """The uids sandboxes started by processes ``pids`` run as (:func:`rltk.rewards.programs.sandbox._uid`)."""
    return {sandbox.UID_BASE + (pid * 16 + n) % sandbox.UID_SPAN for pid in pids for n in range(16)}


def processes_of(uids: set[int]) -> list[int]:
    """Pids of live processes whose real uid is in ``uids`` (orphans included, wherever reparented)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            uid_line = next(l for l in (entry / "status").read_text().splitlines() if l.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if int(uid_line.split()[1]) in uids:
            pids.append(int(entry.name))
    return pids


def my_children() -> set[int]:
    kids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                kids.add(int(entry.name))
    return kids


@pytest.fixture
def unharmed():
    """Around a hostile run: afterwards no process of this process's sandbox uids is left (a fork, a
    daemon) and this process has no new children (an ``unshare`` or launcher left behind)."""
    before = my_children()
    yield
    assert processes_of(sandbox_uids([os.getpid()])) == []
    assert my_children() <= before


def forget_probe(monkeypatch) -> None:
    """Probe the machine afresh in this test; the cached verdict comes back after it (monkeypatch undo)."""
    monkeypatch.setattr(sandbox, "_probed", False)
    monkeypatch.setattr(sandbox, "_probe_result", None)


def run(program: str, tests, **args) -> dict[str, float]:
    return code_execution(response=f"```python\n{program}\n```", ground_truth=tests, **{**LIMITS, **args})


def killed(details: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in details.items() if (k.startswith("killed/") or k in ("denied", "errors")) and v}


# ---------------------------------------------------------------- pure parts (no sandbox)

def test_program_extraction_rule():
    assert extract_program("Here:\n```python\nx = 1\n```\nand better:\n```py\nx = 2\n```\n") == "x = 2\n"
    assert extract_program("```\nprint(1)\n```") == "print(1)\n"
    assert extract_program("```bash\nls\n```\n```\ny = 3\n```") == "y = 3\n"  # untagged beats other tags
    assert extract_program("print(42)") == "print(42)"  # no fence: the whole response


def test_ground_truth_formats_and_errors():
    assert parse_tests('["assert f(1) == 2"]') == ("assert", ["assert f(1) == 2"])
    assert parse_tests({"asserts": ["assert True"]}) == ("assert", ["assert True"])
    assert parse_tests('{"cases": [{"input": "1", "output": "2"}]}') == ("io", [{"input": "1", "output": "2"}])
    for bad, says in [("3", "no tests"), ("not json", "not JSON"), ("[]", "no tests"),
                      ('{"tests": []}', "has keys ['tests']"), ('["assert 1", {"input": ""}]', "misshapes")]:
        with pytest.raises(ValueError, match=re.escape(says)):
            parse_tests(bad)


def test_bad_limits_are_config_errors_naming_the_key(capsys):
    from rltk.commands.cli import main

    with pytest.raises(ConfigError) as err:
        check_args({"timeout_s": 0, "memory_mb": "lots", "all_or_nothing": "yes"})
    msg = str(err.value)
    assert "'timeout_s' = 0: must be a number in [0.1, 600]" in msg
    assert "'memory_mb' = 'lots': must be an integer" in msg
    assert "'all_or_nothing' = 'yes': must be true or false" in msg
    assert main(["validate", "grpo", "reward.reward_fn=[code_execution]",
                 "reward.reward_fn_args.code_execution.timeout_s=0"]) == 2
    assert capsys.readouterr().err.startswith(
        "rltk: error: 'reward.reward_fn_args.code_execution': reward_fn 'code_execution': 'timeout_s' = 0")


def test_a_machine_without_the_sandbox_is_refused_at_build(monkeypatch):
    forget_probe(monkeypatch)
    monkeypatch.setattr(sandbox.sys, "platform", "darwin")  # as if on a Mac
    with pytest.raises(ValueError, match=r"reward 'code_execution': the code_execution reward cannot sandbox "
                                         r"programs on this machine \(it needs Linux namespaces; this is darwin\)"
                                         r".*never without one"):
        build_reward_composer([{"fn": "code_execution"}], timeout_s=30)


def test_cli_refuses_a_machine_without_unshare_with_exit_2(tmp_path, monkeypatch, capsys):
    from rltk.commands.cli import main

    # PATH without util-linux: `unshare` cannot be found, so the probe fails and validation stops.
    monkeypatch.setenv("PATH", str(tmp_path))
    forget_probe(monkeypatch)
    assert main(["validate", "grpo", "reward.reward_fn=[code_execution]", "reward.timeout_s=30"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rltk: error: 'reward.reward_fn_args.code_execution': reward_fn 'code_execution': "
                          "the code_execution reward "
                          "cannot sandbox programs on this machine (util-linux's `unshare` is not on PATH)")
    assert "Traceback" not in err
    assert main(["validate", "grpo", "reward.reward_fn=[code_execution]",
                 "reward.reward_fn_args.code_execution.cpu_s=0.5"]) == 2
    assert "'cpu_s' = 0.5: must be an integer in [1, 600]" in capsys.readouterr().err


# ---------------------------------------------------------------- correct programs, exact scores

@needs_sandbox
def test_two_of_three_asserts_pass():
    program = "def add(a, b):\n    return 0 if a == 0 else a + b"
    tests = '["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]'
    out = run(program, tests)
    assert out["score"] == pytest.approx(2 / 3)
    assert (out["passed"], out["failed"], out["tests"]) == (2.0, 1.0, 3.0)
    assert run(program, tests, all_or_nothing=True)["score"] == 0.0
    assert run("def add(a, b):\n    return a + b", tests, all_or_nothing=True)["score"] == 1.0
    # A main block that reads stdin does not run under assert tests: the program is imported as a module.
    main = "\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))"
    assert run("def add(a, b):\n    return a + b" + main, tests)["score"] == 1.0


@needs_sandbox
def test_stdin_stdout_cases():
    program = "a, b = map(int, input().split())\nprint(a + b)"
    cases = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 20", "output": "30  \n\n"},
             {"input": "2 2\n", "output": "5\n"}]
    out = run(program, {"cases": cases})
    assert out["score"] == pytest.approx(2 / 3) and out["failed"] == 1.0
    # A program that ends early with os._exit(0) did not pass its test, whatever its exit status.
    assert run("import os\nos._exit(0)", '["assert False"]')["errors"] == 1.0


@needs_sandbox
def test_the_process_limit_binds_at_exactly_its_value(unharmed):
    # 16 processes for the uid: the program itself and 15 forks; the 16th fork is refused.
    program = ("import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n"
               "        break\n    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n    n += 1\nprint(n)")
    assert run(program, [{"input": "", "output": "15"}], timeout_s=5.0)["score"] == 1.0


# ---------------------------------------------------------------- hostile programs: stopped, 0, counted

@needs_sandbox
def test_fork_bomb(unharmed):
    out = run("import os\nwhile True:\n    os.fork()", '["assert True"]')
    assert out["score"] == 0.0 and killed(out) == {"killed/processes": 1.0}
    # The kind that swallows the refusal and keeps forking: the wall clock ends it, every fork included.
    started = time.monotonic()
    out = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
              '["assert True"]')
    assert out["score"] == 0.0 and killed(out) in ({"killed/timeout": 1.0}, {"killed/cpu": 1.0})
    assert time.monotonic() - started < scaled(LIMITS["timeout_s"] + sandbox.STARTUP_SLACK_S)


@needs_sandbox
def test_infinite_loop_and_sleep(unharmed):
    started = time.monotonic()
    out = run("while True:\n    pass", '["assert True"]')
    # RLIMIT_CPU (1 s of CPU) or the wall clock (2 s), whichever a loaded machine reaches first.
    assert out["score"] == 0.0 and killed(out) in ({"killed/timeout": 1.0}, {"killed/cpu": 1.0})
    out = run("import time\ntime.sleep(3600)", '["assert True", "assert True"]')
    assert out["score"] == 0.0 and killed(out) == {"killed/timeout": 2.0}
    assert time.monotonic() - started < scaled(3 * (LIMITS["timeout_s"] + 0.5) + 2 * sandbox.STARTUP_SLACK_S)


@needs_sandbox
def test_allocating_10_gb(unharmed):
    out = run("x = bytearray(10 * 2**30)", '["assert len(x) > 0"]')
    assert out["score"] == 0.0 and killed(out) == {"killed/memory": 1.0}


@needs_sandbox
def test_output_past_the_file_size_limit(unharmed):
    out = run("import sys\nsys.stdout.write('x' * (8 * 2**20))", [{"input": "", "output": "x"}])
    assert out["score"] == 0.0 and killed(out) == {"killed/file_size": 1.0}


@needs_sandbox
def test_writing_outside_the_scratch_directory(unharmed, tmp_path):
    name = f"rltk-sandbox-escape-{uuid.uuid4().hex}"
    targets = [Path("/tmp") / name, REPO / name, tmp_path / name, Path("/etc") / name]
    # The sandbox's own /tmp takes the write (a tmpfs that dies with it); every other path is refused.
    program = "\n".join([f"open({str(targets[0])!r}, 'w').write('x')"]
                        + [f"try:\n    open({str(t)!r}, 'w').write('x')\nexcept OSError as e:\n    denied = e"
                           for t in targets[1:-1]]
                        + [f"open({str(targets[-1])!r}, 'w').write('x')"])
    out = run(program, '["assert True"]')
    assert out["score"] == 0.0 and killed(out) == {"denied": 1.0}
    for target in targets:
        assert not target.exists(), target


@needs_sandbox
def test_opening_sockets(unharmed):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted = []

    def serve():
        deadline = time.monotonic() + scaled(8)
        while time.monotonic() < deadline:
            try:
                accepted.append(server.accept())
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    # The server is reachable from here, so a refusal below is the sandbox's doing.
    socket.create_connection(("127.0.0.1", port), timeout=scaled(2)).close()
    deadline = time.monotonic() + scaled(5)
    while not accepted and time.monotonic() < deadline:
        time.sleep(0.02)
    reached_from_outside = len(accepted)
    try:
        local = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')",
                    '["assert True"]')
        external = run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)", '["assert True"]')
    finally:
        time.sleep(0.3)
        server.close()
        thread.join(timeout=scaled(5))
    assert local["score"] == 0.0 and killed(local) == {"denied": 1.0}
    assert external["score"] == 0.0 and killed(external) == {"denied": 1.0}
    assert reached_from_outside == 1 and len(accepted) == 1  # no connection from the sandbox


@needs_sandbox
def test_reading_ssh_keys_and_the_trainers_secrets(unharmed, tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    key = f"-----BEGIN FAKE KEY {uuid.uuid4().hex}-----"
    (home / ".ssh" / "id_rsa").write_text(key)
    secret = f"hunter2-{uuid.uuid4().hex}"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("RLTK_TEST_SECRET", secret)
    # Each program prints what it found; the case expects the secret, so finding it would score 1.
    read_key = (f"import os\nfor p in [{str(home / '.ssh' / 'id_rsa')!r}, os.path.expanduser('~/.ssh/id_rsa')]:\n"
                f"    try:\n        print(open(p).read())\n    except OSError:\n        pass")
    out = run(read_key, [{"input": "", "output": key}])
    assert out["score"] == 0.0 and killed(out) == {} and out["failed"] == 1.0
    read_env = ("import os\nfound = os.environ.get('RLTK_TEST_SECRET', '')\n"
                "for pid in os.listdir('/proc'):\n    try:\n"
                "        found += open(f'/proc/{pid}/environ', 'rb').read().decode(errors='replace')\n"
                "    except OSError:\n        pass\nprint(found)")
    out = run(read_env, [{"input": "", "output": secret}])
    assert out["score"] == 0.0 and out["failed"] == 1.0
    # And directly: the sandbox's /proc lists its own namespace only (pids 1, 2, ...), not this process.
    assert os.getpid() > 16
    probe = (f"import os\nassert not os.path.exists('/proc/{os.getpid()}')\n"
             f"assert max(int(p) for p in os.listdir('/proc') if p.isdigit()) < 16\n"
             f"assert 'RLTK_TEST_SECRET' not in os.environ and os.environ['HOME'] == '/work'")
    assert run(probe, '["assert True"]')["score"] == 1.0


# ---------------------------------------------------------------- through the composer, as a run builds it

@needs_sandbox
def test_composer_from_a_config_entry_counts_kills_in_the_logged_details():
    composer = build_reward_composer(
        [{"fn": "code_execution", "weight": 1.0, "args": dict(LIMITS)}], timeout_s=30, workers=2)
    composer.start()
    workers = composer._pool.worker_pids()
    tests = '["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]'
    responses = ["```python\ndef add(a, b):\n    return 0 if a == 0 else a + b\n```",
                 "```python\nimport os\nwhile True:\n    os.fork()\n```",
                 "```python\nx = bytearray(10 * 2**30)\n```"]
    try:
        results = composer.score_batch([{"prompt": "write add", "response": r, "ground_truth": tests}
                                        for r in responses])
    finally:
        composer.close()
    assert processes_of(sandbox_uids(workers)) == []  # nothing the bombs forked outlives its sandbox
    scores = [score for score, _ in results]
    assert scores == pytest.approx([2 / 3, 0.0, 0.0])
    assert results[1][1]["code_execution/killed/processes"] == 3.0
    assert results[2][1]["code_execution/killed/memory"] == 3.0
    assert composer.stats()["failures/code_execution"] == 0.0  # stopped programs are scores, not failures
    experiences = [Experience(prompt_ids=[0], response_ids=[0], score=s, group_id=i, reward_details=d)
                   for i, (s, d) in enumerate(results)]
    means = reward_means(experiences)
    assert means["reward/code_execution/killed/processes"] == pytest.approx(1.0)  # 3 kills over 3 samples
    assert means["reward/code_execution/passed"] == pytest.approx(2 / 3)


@needs_sandbox
def test_one_test_cannot_change_what_the_next_one_runs(unharmed):
    # The first run tries to rewrite the program and to leave a file behind for the second.
    program = ("import os\ntry:\n    open('solution.py', 'w').write('x = 1')\nexcept OSError:\n    pass\n"
               "seen = os.path.exists('left.txt')\nopen('left.txt', 'w').write('x')\nx = 2")
    out = run(program, '["assert x == 2 and not seen", "assert x == 2 and not seen"]')
    assert out["passed"] == 2.0


@needs_sandbox
def test_sample_timeout_caps_all_tests_together(unharmed):
    started = time.monotonic()
    out = run("import time\ntime.sleep(3600)", '["assert True", "assert True"]', timeout_s=2.0, sample_timeout_s=1.0)
    # The first test gets the 1 s cap, not its 2 s; the second is never started: both count as timeouts.
    assert killed(out) == {"killed/timeout": 2.0} and out["score"] == 0.0
    assert time.monotonic() - started < scaled(2.0 + sandbox.STARTUP_SLACK_S)


@needs_sandbox  # else the machine's refusal comes first
def test_sample_timeout_must_fit_under_the_composer_timeout(capsys):
    from rltk.commands.cli import main

    assert main(["validate", "grpo", "reward.reward_fn=[code_execution]", "reward.timeout_s=5",
                 "reward.reward_fn_args.code_execution.sample_timeout_s=4"]) == 2
    assert ("bad value 4 for 'reward.reward_fn_args.code_execution.sample_timeout_s': must be at least 2 s "
            "(the sandbox's setup) under 'reward.timeout_s'=5.0") in capsys.readouterr().err


NOBODY = 65534
NO_PROBES = {"setup": [], "probes": []}  # a probe test that only runs the program
SYSTEM_PYTHON = Path("/usr/bin/python3")


def _world_readable(path: Path) -> bool:
    return all(p.stat().st_mode & 0o005 == 0o005 for p in [path, *path.parents]) and \
        (path / "sandbox_launcher.py").stat().st_mode & 0o004


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0 or not SYSTEM_PYTHON.exists()
                    or not Path("/usr/bin/setpriv").exists()
                    or not _world_readable(REPO / "rltk" / "rewards" / "programs"),
                    reason="needs root to become another user, /usr/bin/python3, setpriv and a world-readable checkout")
def test_without_root_a_user_namespace_gives_the_same_protection(tmp_path):
    """As an ordinary user the sandbox adds a user namespace: the program keeps uid 0 there but has no
    capability, and the same limits hold (the process limit to the same count)."""
    escape = Path("/tmp") / f"rltk-sandbox-escape-{uuid.uuid4().hex}"
    secret = f"hunter2-{uuid.uuid4().hex}"
    fork = ("import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n"
            "        break\n    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n    n += 1\nprint(n)")
    cases = {  # name: (program, mode, tests, the outcome it must have)
        "probe": None,
        "forks": (fork, "io", [{"input": "", "output": "15"}], "pass"),
        "no capabilities": ("caps = [l.split()[1] for l in open('/proc/self/status') if l.startswith('Cap')]\n"
                            "assert set(caps) == {'0000000000000000'}, caps", "probe", [NO_PROBES], "evaluated"),
        "harness": ("open('/.harness.py', 'w').write('x')", "probe", [NO_PROBES], "denied"),
        "program": ("open('/work/solution.py', 'w').write('x')", "probe", [NO_PROBES], "denied"),
        "escape": (f"open({str(escape)!r}, 'w').write('x')\nopen('/etc/passwd', 'a').write('x')", "probe",
                   [NO_PROBES], "denied"),
        "mount": ("import ctypes\nassert ctypes.CDLL(None).mount(b'tmpfs', b'/work', b'tmpfs', 0, None) == 0",
                  "probe", [NO_PROBES], "failed"),
        "10 GB": ("x = bytearray(10 * 2**30)", "probe", [NO_PROBES], "memory"),
        "socket": ("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)", "probe", [NO_PROBES], "denied"),
        "secret": ("import os\nfound = os.environ.get('RLTK_TEST_SECRET', '')\nfor pid in os.listdir('/proc'):\n"
                   "    try:\n        found += open(f'/proc/{pid}/environ').read()\n    except OSError:\n        pass\n"
                   "print(found)", "io", [{"input": "", "output": secret}], "wrong_output"),
    }
    script = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(REPO / 'rltk' / 'rewards' / 'programs')!r})\n"
        "from sandbox import SandboxLimits, check_sandbox, run_in_sandbox\n"
        "cases = json.loads(sys.stdin.read())\n"
        "out = {'probe': check_sandbox()}\n"
        "for name, case in cases.items():\n"
        "    if case:\n"
        "        program, mode, tests, _ = case\n"
        "        limits = SandboxLimits(timeout_s=3.0, cpu_s=1)\n"
        "        out[name] = run_in_sandbox(program, mode, tests, limits)[0]['outcome']\n"
        "print(json.dumps(out))\n")
    import json
    import subprocess

    proc = subprocess.run(["/usr/bin/setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           str(SYSTEM_PYTHON), "-I", "-c", script], input=json.dumps(cases), capture_output=True,
                          text=True, timeout=scaled(120), cwd="/",
                          env={"PATH": "/usr/bin:/bin", "RLTK_TEST_SECRET": secret})
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"probe": None, **{name: case[3] for name, case in cases.items() if case}}
    assert not escape.exists()
