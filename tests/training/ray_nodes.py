"""Helpers of the ``launcher=ray`` tests: a Ray cluster of several nodes on this machine
(``ray.cluster_utils.Cluster``), each node with a folder of its own and every process audited.

Each node's processes record the paths they open, create or list under the test's folder
(``sys.addaudithook`` from a ``sitecustomize`` on the nodes' ``PYTHONPATH``; SQLite's opens are its
``sqlite3.connect`` events), so a test can check that no process touched another node's folder. The audit
sees what Python opens, in every Python process started with the node's environment (vLLM servers a
producer launches included); a C or Rust library opening a file by itself (safetensors' reader) is not seen.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

from ray.cluster_utils import Cluster

from tests.waits import scaled, wait_until

RL_STEPS = 8
NAME = "ray-test"
RUN = [f"name={NAME}", "data.task_args.max_digits=1", "data.train_size=70", "data.eval_size=20",
       f"trainer.total_steps={RL_STEPS}", "trainer.warmup_steps=2", "trainer.prompts_per_step=4", "rollout.n=4",
       "trainer.eval_every=8", "logging.logger=[jsonl]", "logging.plot=false", "checkpoint.every=2",
       f"buffer.queue_timeout_s={scaled(240):.0f}", "stages=[{name: rl, type: rl}]", "trainer.mode=async",
       "trainer.max_staleness=1", "launcher=ray", "launcher_args.producer.resources={rollout: 1}"]
QUEUE = Path("async") / "stage_0" / "experience_queue.sqlite"
RLTK = str(Path(sys.executable).with_name("rltk"))
#: Every node of a test's cluster on the loopback (``ray start --node-ip-address=127.0.0.1``): its raylet, object
#: store, agents and workers listen there, and ``cluster.address`` is 127.0.0.1:port. Without it Ray puts the
#: nodes on this machine's interface address, and the tests' traffic on the network.
LOOPBACK = {"node_ip_address": "127.0.0.1"}

AUDIT_HOOK = '''
import os, sys
_log, _root, _node = (os.environ.get(k) for k in ("RLTK_AUDIT_LOG", "RLTK_AUDIT_ROOT", "RLTK_AUDIT_NODE"))
if _log and _root and _node:
    _fd = os.open(os.path.join(_log, f"{_node}-{os.getpid()}.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    _events = {"open", "sqlite3.connect", "os.mkdir", "os.listdir", "os.scandir", "os.remove", "os.rename"}

    def _audit(event, args):
        if event in _events and args and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.abspath(os.fsdecode(args[0]))
            if path.startswith(_root):
                os.write(_fd, f"{event} {path}\\n".encode())

    sys.addaudithook(_audit)
'''


class Nodes:
    """A head (the trainer's node, resource ``trainer``), rollout nodes (resource ``rollout``, and
    ``rollout_gpus`` GPUs that Ray counts and hands out, whether or not the machine has them) and optionally a
    node for reward services (resource ``reward``), each with its own folder under ``root``, every process
    audited into ``root/audit``; ``env`` is added to every node's."""

    def __init__(self, root: Path, rollout_nodes: int, reward_node: bool = False, *, rollout_gpus: int = 0,
                 env: dict | None = None):
        self.root = root.resolve()
        self.extra_env = dict(env or {})
        self.audit = self.root / "audit"
        self.audit.mkdir()
        (self.audit / "sitecustomize.py").write_text(AUDIT_HOOK)
        self.folders = {"head": self.root / "head"}
        self.cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=1, resources={"trainer": 1}, include_dashboard=False, env_vars=self.env("head"), **LOOPBACK,
            # a node that stops answering is declared dead within a few seconds, not half a minute
            _system_config={"health_check_period_ms": 1000, "health_check_failure_threshold": 3}))
        self.rollout = {}
        for k in range(rollout_nodes):
            name = f"node_{k}"
            self.folders[name] = self.root / name
            self.rollout[name] = self.cluster.add_node(
                num_cpus=1, num_gpus=rollout_gpus, resources={"rollout": 1}, **LOOPBACK,
                env_vars={**self.env(name), "RLTK_RAY_WORK_DIR": str(self.folders[name])})
        if reward_node:  # a node of its own for reward services (resource ``reward``), never lost
            self.folders["rewards"] = self.root / "rewards"
            self.cluster.add_node(num_cpus=1, resources={"reward": 1}, **LOOPBACK, env_vars={
                **self.env("rewards"), "RLTK_RAY_WORK_DIR": str(self.folders["rewards"])})
        for folder in self.folders.values():
            folder.mkdir(exist_ok=True)
        self.cluster.wait_for_nodes()

    def env(self, node: str) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(self.audit), os.environ.get("PYTHONPATH", "")) if p)
        return {"PYTHONPATH": path, "RLTK_AUDIT_LOG": str(self.audit), "RLTK_AUDIT_ROOT": str(self.root),
                "RLTK_AUDIT_NODE": node, "OMP_NUM_THREADS": "1", **self.extra_env}

    def trainer(self, overrides: list[str], *, run_dir: Path, address: str | None = None) -> subprocess.Popen:
        """``rltk run grpo`` as the trainer on the head's machine; with no ``address``, RAY_ADDRESS names the
        cluster, as ``ray job submit`` does for the job it runs."""
        env = {**os.environ, **self.env("head"), "RAY_ADDRESS": address or self.cluster.address}
        log = open(run_dir.parent / f"{run_dir.name}.log", "w")
        return subprocess.Popen([RLTK, "run", "grpo", f"output_dir={run_dir}", *overrides], env=env, stdout=log,
                                stderr=subprocess.STDOUT, text=True)

    def lose(self, node: str) -> None:
        """The machine of ``node`` goes down: its Ray processes (raylet, object store) and every worker process
        on it (a worker outlives its raylet for a while; on a real machine it would not). The workers are
        frozen first, so that nothing on the node works on while Ray takes it down (a producer would go on
        putting batches, and on a fast step could finish the stage before its node is gone)."""
        workers = [int(log.stem.rsplit("-", 1)[1]) for log in self.audit.glob(f"{node}-*.txt")]
        _signal(workers, signal.SIGSTOP)
        self.cluster.remove_node(self.rollout.pop(node), allow_graceful=False)
        _signal(workers, signal.SIGKILL)

    def opened(self) -> dict[str, list[tuple[str, str, str]]]:
        """node -> [(pid, event, path)] every audited process of it recorded."""
        out: dict[str, list] = {}
        for log in self.audit.glob("*.txt"):
            node, pid = log.stem.rsplit("-", 1)
            out.setdefault(node, []).extend((pid, *line.split(" ", 1)) for line in log.read_text().splitlines())
        return out

    def shutdown(self) -> None:
        self.cluster.shutdown()


def _signal(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def wait_for(what: str, done, timeout_s: float, proc: subprocess.Popen, log: Path, poll_s: float = 0.5):
    """:func:`tests.waits.wait_until` for the trainer ``proc``, whose log's tail the failure shows."""
    return wait_until(done, what, timeout_s, poll_s=poll_s, alive=lambda: proc.poll() is None,
                      details=lambda: log.read_text()[-5000:])


def put_count(run_dir: Path) -> int:
    if not (run_dir / QUEUE).exists():
        return 0
    with sqlite3.connect(f"file:{run_dir / QUEUE}?mode=ro", uri=True, timeout=scaled(30)) as db:
        try:
            return db.execute("SELECT COUNT(*) FROM experiences").fetchone()[0]
        except sqlite3.OperationalError:  # the table is not there yet
            return 0


def trained_steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [row for row in map(json.loads, path.read_text().splitlines()) if "staleness/max" in row]




def committed(run_dir: Path) -> list[tuple[str, int]]:
    """(experience id, training step) of each experience a committed lease trained."""
    with sqlite3.connect(run_dir / QUEUE) as db:
        return db.execute("SELECT e.id, l.step FROM experiences e JOIN leases l ON e.lease = l.id "
                          "WHERE e.status = 'consumed' AND l.state = 'committed'").fetchall()


def assert_no_node_touched_another_nodes_folder(nodes: Nodes) -> dict[str, list[tuple[str, str, str]]]:
    """Assert that no audited process opened, created or listed anything in another node's folder; what
    each node's processes did (:meth:`Nodes.opened`)."""
    opened = nodes.opened()
    for node, events in opened.items():
        for pid, event, path in events:
            for other, folder in nodes.folders.items():
                assert other == node or not path.startswith(f"{folder}{os.sep}"), (
                    f"a process of {node} (pid {pid}) did {event} on {path}, in {other}'s folder")
    return opened
