"""``launcher=ray`` through Ray's job server: ``ray job submit -- rltk run grpo ... launcher=ray`` against a real
cluster of two nodes on this machine (``ray.cluster_utils.Cluster``), the head with the dashboard (``ray[default]``).

The job server runs the entrypoint as the job's driver on the head node and sets ``RAY_ADDRESS`` for it; rltk
connects to that cluster (``launcher_args.address`` left empty) and places its producer on the rollout node.
The test reads the cluster's own record of the job and its actors (the dashboard's job and state APIs), so a
driver that had started a Ray of its own would fail it. The CLI is run as ``python -m ray.scripts.scripts``
with the interpreter running the tests: that is the ``ray`` command of the environment rltk is installed in.

Slow (a cluster with its dashboard, a trainer, a producer actor): about a minute on a quiet machine.
"""

from __future__ import annotations

import os
import shlex
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from unittest import mock

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("aiohttp_cors", reason="the job server needs ray[default] (pip install 'rltk[ray]')")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.job_submission import JobStatus, JobSubmissionClient  # noqa: E402
from ray.util.state import list_actors  # noqa: E402

from .ray_nodes import LOOPBACK  # noqa: E402
from .test_ray_source import NAME, QUEUE, RL_STEPS, RUN, trained_steps  # noqa: E402

from tests.waits import scaled

pytestmark = pytest.mark.slow

RAY = [sys.executable, "-m", "ray.scripts.scripts"]
RLTK = str(Path(sys.executable).with_name("rltk"))
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class JobCluster:
    """A head (resource ``trainer``, the dashboard and its job server on a free port) and one rollout node
    (resource ``rollout``) whose producers work in ``rollout_dir``. The head's dashboard agent, which runs the
    jobs, gets a free port too: its default (52365) may be taken by another Ray on the machine."""

    def __init__(self, rollout_dir: Path, deadline_s: float = 180):
        self.rollout_dir = rollout_dir
        # the nodes on the loopback; the Ray processes they start (the job server among them) keep it too, with
        # Ray's switch for that: else the job server looks for the GCS at this machine's interface address,
        # where nothing answers, and `ray job submit` hangs
        with mock.patch.dict(os.environ, {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}):
            self.cluster = Cluster(initialize_head=True, head_node_args=dict(
                num_cpus=1, resources={"trainer": 1}, include_dashboard=True, dashboard_host="127.0.0.1",
                dashboard_port=free_port(), dashboard_agent_listen_port=free_port(), env_vars=ONE_THREAD,
                **LOOPBACK))
            try:
                self.rollout = self.cluster.add_node(num_cpus=1, resources={"rollout": 1}, **LOOPBACK,
                                                     env_vars={**ONE_THREAD, "RLTK_RAY_WORK_DIR": str(rollout_dir)})
            except BaseException:
                self.cluster.shutdown()
                raise
        try:
            self.cluster.wait_for_nodes(timeout=scaled(120))
            self.url = f"http://{self.cluster.webui_url}"
            self._wait_for_the_job_server(deadline_s)
        except BaseException:
            self.cluster.shutdown()
            raise
        self.client = JobSubmissionClient(self.url)

    def _wait_for_the_job_server(self, deadline_s: float) -> None:
        """The dashboard answers /api/version once it serves; on a loaded 2-core machine that takes a while.
        Ray 2.60 turns token authentication on for a cluster started by a process that ran ``ray.init`` before
        (an earlier test of this worker), so the request carries the token Ray's own clients send (from
        ``~/.ray/auth_token``); a cluster without authentication ignores it."""
        from ray._raylet import AuthenticationTokenLoader

        token = AuthenticationTokenLoader.instance().get_token_for_http_header()
        start, why = time.monotonic(), None
        while time.monotonic() - start < deadline_s:
            try:
                request = urllib.request.Request(f"{self.url}/api/version", headers=token)
                with urllib.request.urlopen(request, timeout=scaled(10)) as answer:
                    if answer.status == 200:
                        return
            except OSError as exc:
                why = exc
            time.sleep(1)
        raise TimeoutError(f"the Ray dashboard at {self.url} did not answer /api/version within {deadline_s} s "
                           f"({why})")

    def submit(self, submission_id: str, entrypoint: list[str], timeout_s: float) -> tuple[int, str]:
        """``ray job submit`` (which waits for the job and prints its log): the CLI's exit status and output.
        A job still running after ``timeout_s`` is stopped, and the test fails saying so."""
        command = [*RAY, "job", "submit", "--address", self.url, "--submission-id", submission_id, "--",
                   *entrypoint]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            self.stop(submission_id)
            pytest.fail(f"`{shlex.join(command)}` did not end within {timeout_s} s:\n{str(exc.stdout)[-5000:]}")
        return done.returncode, done.stdout + done.stderr

    def stop(self, submission_id: str, timeout_s: float = 60) -> None:
        """Stop a job and wait until the job server reports it ended."""
        self.client.stop_job(submission_id)
        start = time.monotonic()
        while not self.client.get_job_status(submission_id).is_terminal():
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"the Ray job {submission_id} was not stopped within {timeout_s} s")
            time.sleep(1)

    def shutdown(self) -> None:
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def job_cluster(tmp_path_factory):
    """One cluster for the module's jobs (each job has an id and a run folder of its own)."""
    ray.shutdown()  # whatever an earlier test of this process left connected
    started = JobCluster(tmp_path_factory.mktemp("rollout"))
    yield started
    started.shutdown()


def test_ray_job_submit_runs_the_trainer_on_the_cluster_and_its_producer_on_the_rollout_node(job_cluster, tmp_path):
    run_dir = tmp_path / "run"
    code, output = job_cluster.submit("rltk-async", [RLTK, "run", "grpo", f"output_dir={run_dir}", *RUN],
                                      timeout_s=480)
    job = job_cluster.client.get_job_info("rltk-async")
    assert code == 0 and job.status == JobStatus.SUCCEEDED, output[-6000:]
    assert job.driver_exit_code == 0
    head, rollout = job_cluster.cluster.head_node.node_id, job_cluster.rollout.node_id
    assert job.driver_node_id == head  # the job server ran the trainer on the head node

    # the cluster's own record: the job's driver (rltk) made the queue front on the head and the producer on
    # the rollout node; a driver with a Ray of its own would have left no actor of this job here
    actors = list_actors(address=job_cluster.url, filters=[("job_id", "=", job.job_id)], detail=True,
                         raise_on_missing_output=False)
    placed = sorted((a.class_name, a.node_id) for a in actors if a.class_name in ("ProducerActor", "QueueFront"))
    assert placed == [("ProducerActor", rollout), ("QueueFront", head)], actors

    # the run went to its end: every RL step trained one whole batch of the producer, each experience once
    assert (run_dir / "summary.json").is_file(), output[-3000:]
    assert [r["step"] for r in trained_steps(run_dir)] == list(range(1, RL_STEPS + 1))
    with sqlite3.connect(run_dir / QUEUE) as db:
        trained = db.execute("SELECT e.id, l.step FROM experiences e JOIN leases l ON e.lease = l.id "
                             "WHERE e.status = 'consumed' AND l.state = 'committed'").fetchall()
    assert sorted(trained) == sorted((f"producer-0-b{s - 1}-{i}", s) for s in range(1, RL_STEPS + 1)
                                     for i in range(16))
    # the producer worked in the rollout node's folder (RLTK_RAY_WORK_DIR as that node's environment sets it)
    assert (job_cluster.rollout_dir / NAME / "stage_0" / "producer-0").is_dir()


def test_bad_launcher_args_in_a_job_fail_it_with_rltks_exit_2_naming_the_key(job_cluster, tmp_path):
    def refused(submission_id: str, overrides: list[str]) -> str:
        code, output = job_cluster.submit(submission_id, [RLTK, "run", "grpo", f"output_dir={tmp_path / submission_id}",
                                                          "trainer.mode=async", "launcher=ray", *overrides],
                                          timeout_s=240)
        job = job_cluster.client.get_job_info(submission_id)
        assert code == 1 and job.status == JobStatus.FAILED and job.driver_exit_code == 2, output[-5000:]
        assert "Job entrypoint command failed with exit code 2" in output, output[-5000:]  # the CLI says it too
        assert "Traceback" not in job_cluster.client.get_job_logs(submission_id), output[-5000:]
        return output

    # RAY_ADDRESS from the job server: the message lists this cluster's two nodes
    output = refused("rltk-unmet", ["launcher_args.producer.resources={gpu_pool: 1}"])
    assert "rltk: error: bad value for 'launcher_args.producer.resources.gpu_pool': no node of the Ray cluster " \
           "has 1 of resource 'gpu_pool'" in output, output[-5000:]
    assert "CPU 1, trainer 1" in output and "CPU 1, rollout 1" in output, output[-5000:]
    # an address given in the config is used instead of RAY_ADDRESS, and nothing listens there
    output = refused("rltk-nowhere", ["launcher_args.address=127.0.0.1:9", "launcher_args.connect_timeout_s=5"])
    assert "rltk: error: bad value '127.0.0.1:9' for 'launcher_args.address': no Ray cluster at" in output, \
        output[-5000:]
    assert "within 5 s (launcher_args.connect_timeout_s): nothing listens there" in output, output[-5000:]
