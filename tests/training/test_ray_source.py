"""``launcher=ray`` against a real Ray cluster of several nodes on this machine (``ray.cluster_utils.Cluster``).

Each node has a folder of its own (the head's holds the trainer's run folder; each rollout node's is its
``RLTK_RAY_WORK_DIR``), and every process of every node is audited (:mod:`tests.training.ray_nodes`), so the
test can check that no process touched another node's folder. The audit sees what Python opens; a C or Rust
library opening a file by itself (safetensors' reader) is not seen, which is why the producers' weights path
is also checked by what it reads: the object store, never a file.

Slow (a cluster, a trainer, producer actors): about a minute and a half in all on a quiet machine.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
from tests.training.ray_nodes import (  # noqa: E402
    NAME, QUEUE, RL_STEPS, RUN, Nodes, assert_no_node_touched_another_nodes_folder, committed, put_count,
    trained_steps, wait_for,
)
from tests.waits import scaled

pytestmark = pytest.mark.slow


@pytest.fixture
def nodes(tmp_path):
    started = Nodes(tmp_path, rollout_nodes=2)
    yield started
    started.shutdown()


@pytest.fixture
def nodes_and_rewards(tmp_path):
    started = Nodes(tmp_path, rollout_nodes=2, reward_node=True)
    yield started
    started.shutdown()


def lose_the_producers_node_mid_run(nodes: Nodes, overrides: list[str], run_dir: Path,
                                    address: str | None = None) -> tuple[str, int, str]:
    """Start the trainer, lose the node its producer works on once the producer's first batch is in the queue
    (which holds at most two ahead at staleness 1, so the stage still needs the producer), and wait for the
    trainer to end: (the node lost, the trainer's exit status, its output)."""
    log = run_dir.parent / f"{run_dir.name}.log"
    trainer = nodes.trainer(overrides, run_dir=run_dir, address=address)
    try:
        def producer_node():
            return next((name for name in nodes.rollout
                         if (nodes.folders[name] / NAME / "stage_0" / "producer-0").is_dir()), None)

        lost = wait_for("the producer actor's folder on a rollout node", producer_node, 240, trainer, log)
        # looked at often: a producer may put a batch a few tenths of a second, and the stage must still need it
        wait_for("the producer's first batch in the queue", lambda: put_count(run_dir) >= 16, 300, trainer, log,
                 poll_s=0.02)
        nodes.lose(lost)
        assert put_count(run_dir) < 16 * RL_STEPS, "the producer put the whole stage before its node was lost"
        trainer.wait(timeout=scaled(480))
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    return lost, trainer.returncode, log.read_text()


def test_a_producer_on_another_node_feeds_the_trainer_over_the_network_and_survives_losing_its_node(
        nodes_and_rewards):
    nodes = nodes_and_rewards
    run_dir = nodes.folders["head"] / "run"
    scored_elsewhere = "launcher_args.rewards={exact_match: {resources: {reward: 1}}}"  # on a third node
    first, code, output = lose_the_producers_node_mid_run(nodes, [*RUN, scored_elsewhere], run_dir)
    assert code == 0, output[-6000:]
    (second,) = nodes.rollout
    # Ray placed the actor again on the node left, and the trainer started its loop again
    assert (nodes.folders[second] / NAME / "stage_0" / "producer-0").is_dir(), output[-3000:]
    assert "rollout producer 'producer-0'" in output and "starting it again" in output, output[-3000:]

    # every step trained one whole batch of the producer, in order, each experience once, within staleness 1:
    # the restarted producer went on after the last batch the queue held
    trained = committed(run_dir)
    assert sorted(trained) == sorted((f"producer-0-b{s - 1}-{i}", s) for s in range(1, RL_STEPS + 1)
                                     for i in range(16))
    rows = trained_steps(run_dir)
    assert [r["step"] for r in rows] == list(range(1, RL_STEPS + 1))
    assert all(r["staleness/max"] <= 1 and r["staleness/dropped"] == 0 for r in rows)

    # every sample was scored by the reward service on the third node: the producers' (both of them, before and
    # after the loss) and the trainer's held-out evaluations (20 rows, greedy and sampled, at steps 0 and 8 and
    # at the end), with no failure
    assert "rltk: reward service 'exact_match' replica 0 on node" in output
    assert f"folder {nodes.folders['rewards'] / NAME / 'reward-exact_match-0'})" in output, output[-3000:]
    scored = int(output.split("rltk: reward service rltk-reward/ray-test/exact_match/0 scored ")[1].split()[0])
    assert scored >= 16 * RL_STEPS + 3 * 2 * 20, output[-3000:]
    assert all(r["reward_fn/failures/exact_match"] == 0 for r in rows)

    # no process opened, created or listed anything in another node's folder
    opened = assert_no_node_touched_another_nodes_folder(nodes)
    # ... and the audit saw each side at work: the trainer's files on the head, the queue opened there by the
    # queue's front actor (a process of its own), each producer's folder made on its node
    head = opened["head"]
    queue = str(run_dir / QUEUE)
    assert any(event == "sqlite3.connect" and path == queue for _, event, path in head)
    assert len({p for p, event, path in head if event == "sqlite3.connect" and path == queue}) == 2  # trainer, front
    for node in (first, second):
        assert any(event == "os.mkdir" and path.endswith(f"{NAME}{os.sep}stage_0{os.sep}producer-0")
                   for _, event, path in opened[node]), (node, opened.get(node))
    assert any(event == "os.mkdir" and path == str(nodes.folders["rewards"] / NAME / "reward-exact_match-0")
               for _, event, path in opened["rewards"]), opened.get("rewards")
    # the hf producers loaded the weights from the object store: no weights file beside the queue or the producers
    assert not [p for folder in [run_dir / "async", *(nodes.folders[n] for n in (first, second))]
                for p in folder.rglob("*.safetensors")]


def test_a_producer_whose_node_is_lost_with_no_restarts_left_stops_the_run_naming_it(nodes):
    run_dir = nodes.folders["head"] / "run"
    overrides = [*RUN, "launcher_args.max_restarts=0", f"buffer.queue_timeout_s={scaled(120):.0f}"]
    _, code, output = lose_the_producers_node_mid_run(nodes, overrides, run_dir, address=nodes.cluster.address)
    assert code == 1, output[-6000:]
    error = output[output.index("rltk: error:"):]
    assert "rollout producer 'producer-0'" in error and "launcher_args.max_restarts=0" in error, error[:3000]
    assert "died" in error or "gave its actor up" in error, error[:3000]
    assert len(trained_steps(run_dir)) < RL_STEPS


def test_requests_no_node_meets_and_unreachable_clusters_are_refused_naming_the_key(tmp_path):
    from rltk.config import load_config
    from rltk.errors import ConfigError
    from rltk.training.scaffold.ray_cluster import connect, open_cluster

    ray_run = ["trainer.mode=async", "launcher=ray"]
    ray.shutdown()  # whatever an earlier test of this process left connected: connect() would use it
    # the address tried is the one given: Ray's own resolving would have turned 127.0.0.1 into this machine's
    # interface address
    with pytest.raises(ConfigError, match=r"bad value '127\.0\.0\.1:9' for 'launcher_args\.address': no Ray "
                                          r"cluster at 127\.0\.0\.1:9 within 5 s "
                                          r"\(launcher_args\.connect_timeout_s\): nothing listens there"):
        connect(load_config([], [*ray_run, "launcher_args.address=127.0.0.1:9", "launcher_args.connect_timeout_s=5"]))
    # something else listens at the address (on the loopback only): refused in time, not after ray.init's
    # minutes of retries
    with socket.create_server(("127.0.0.1", 0)) as other:
        port = other.getsockname()[1]
        elsewhere = [f"launcher_args.address=127.0.0.1:{port}", "launcher_args.connect_timeout_s=5"]
        start = time.monotonic()
        with pytest.raises(ConfigError, match=rf"'launcher_args\.address': no Ray cluster at 127\.0\.0\.1:{port} "
                                              r"within 5 s .*something listens there, but it did not answer as a "
                                              r"Ray cluster's head does"):
            connect(load_config([], [*ray_run, *elsewhere]))
        assert time.monotonic() - start < scaled(30)
    assert not ray.is_initialized()
    nodes = Nodes(tmp_path, rollout_nodes=1)
    try:
        address = f"launcher_args.address={nodes.cluster.address}"
        unmet = [(["launcher_args.producer.resources={gpu_pool: 1}"],
                  r"'launcher_args\.producer\.resources\.gpu_pool': no node of the Ray cluster has 1 of resource "
                  r"'gpu_pool'\. The nodes: (?=.*node \w+ \(127\.0\.0\.1\): CPU 1, trainer 1)"
                  r"(?=.*node \w+ \(127\.0\.0\.1\): CPU 1, rollout 1)"),
                 (["launcher_args.producer.cpus=2"], r"'launcher_args\.producer\.cpus': no node .* has 2 CPUs"),
                 (["launcher_args.producer.labels={pool: big}"],
                  r"'launcher_args\.producer\.labels\.pool': no node .* has label pool=big"),
                 (["launcher_args.producer.resources={trainer: 1, rollout: 1}"],
                  r"'launcher_args\.producer': no node of the Ray cluster has all of 1 CPUs, 0 GPUs, 1 of resource "
                  r"'trainer', 1 of resource 'rollout' at once")]
        for overrides, match in unmet:
            with pytest.raises(ConfigError, match=match):
                open_cluster(load_config([], [*ray_run, address, *overrides]))
        ray.shutdown()
        # two producers for the one rollout node: the second is never placed, and the run says so in time
        run_dir = nodes.folders["head"] / "run"
        placement_s = round(scaled(10))  # long enough for the first actor to start on a loaded machine
        trainer = nodes.trainer([*RUN, "trainer.producers=2", f"launcher_args.placement_timeout_s={placement_s}"],
                                run_dir=run_dir)
        trainer.wait(timeout=scaled(240))
        output = (run_dir.parent / "run.log").read_text()
        assert trainer.returncode == 2, output[-5000:]
        assert ("bad value for 'launcher_args.producer': the Ray cluster placed 1 of 2 rollout producer actors "
                f"within {placement_s} s (launcher_args.placement_timeout_s); not placed: producer-1") in output, output[-5000:]
    finally:
        ray.shutdown()
        nodes.shutdown()


def test_a_trainer_that_crashed_resumes_from_its_queue_and_trains_each_experience_once(tmp_path):
    from rltk.commands.cli import main
    from tests.crash import crash_at_step

    ray.shutdown()  # whatever an earlier test of this process left connected: the run would use it
    nodes = Nodes(tmp_path, rollout_nodes=1)
    run_dir = nodes.folders["head"] / "run"
    # a reward service too: the resumed run places it again under the same name, in the same process
    overrides = [f"output_dir={run_dir}", *RUN, f"launcher_args.address={nodes.cluster.address}",
                 # on the head: the rollout node's one CPU is the producer's
                 "launcher_args.rewards={exact_match: {cpus: 0.5, resources: {trainer: 0.5}}}"]
    try:
        with crash_at_step(5):  # after the checkpoint of step 4: the leases of step 5 go back to the queue
            main(["run", "grpo", *overrides])
        assert main(["run", "grpo", *overrides]) == 0  # the same driver: Ray stays connected, new actors
    finally:
        ray.shutdown()
        nodes.shutdown()
    trained = committed(run_dir)
    # the resumed producer went on after the queue's last batch; the returned lease trained step 5 again
    assert sorted(trained) == sorted((f"producer-0-b{s - 1}-{i}", s) for s in range(1, RL_STEPS + 1)
                                     for i in range(16))
    assert [r["step"] for r in trained_steps(run_dir)] == list(range(1, RL_STEPS + 1))  # nothing logged twice


def test_weights_travel_as_arrays_of_their_dtype_with_a_tied_weight_once():
    import torch

    from rltk.models.tiny import build_char_tokenizer, build_tiny_model
    from rltk.training.rollouts.engine_weights import load_weights_state
    from rltk.training.rollouts.asynchronous.ray_source import as_arrays, from_arrays

    mixed = {"a": torch.randn(3, 4).bfloat16(), "b": torch.arange(5), "c": torch.randn(2).half()}
    back = from_arrays(as_arrays(mixed))
    assert all(back[k].dtype == mixed[k].dtype and torch.equal(back[k], mixed[k]) for k in mixed)
    tokenizer = build_char_tokenizer()
    sent, received = (build_tiny_model(tokenizer, seed=seed) for seed in (0, 1))
    state = sent.state_dict()
    arrays = as_arrays(state)
    tied = [k for k in state if k not in arrays]
    assert tied == ["lm_head.weight"]  # the head shares the embedding's storage: sent once
    load_weights_state(received, from_arrays(arrays), "test")
    assert all(torch.equal(p, q) for p, q in zip(sent.state_dict().values(), received.state_dict().values()))


@pytest.mark.distributed
def test_every_trainer_rank_scores_its_held_out_share_through_the_reward_service(tmp_path):
    from tests.isolated import run_isolated

    nodes = Nodes(tmp_path, rollout_nodes=1, reward_node=True)
    run_dir = nodes.folders["head"] / "run"
    try:
        out = run_isolated([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            "-m", "rltk.commands.cli", "run", "grpo", f"output_dir={run_dir}", *RUN,
                            "launcher_args.rewards={exact_match: {resources: {reward: 1}}}"],
                           extra_env={**nodes.env("head"), "RAY_ADDRESS": nodes.cluster.address}, timeout=scaled(600))
    finally:
        nodes.shutdown()
    assert [r["step"] for r in trained_steps(run_dir)] == list(range(1, RL_STEPS + 1))
    scored = int(out.stdout.split("rltk: reward service rltk-reward/ray-test/exact_match/0 scored ")[1].split()[0])
    # the producer's batches (the trained 8, and at most the 2 staleness 1 lets it put ahead) and three whole
    # held-out evaluations (steps 0 and 8 and the end: 20 rows, greedy and sampled), half of each from rank 1,
    # which had no other way to score: a rank left out would leave 60 samples unscored
    assert 16 * RL_STEPS + 3 * 2 * 20 <= scored <= 16 * (RL_STEPS + 2) + 3 * 2 * 20, out.stdout[-3000:]
    assert "rltk: final held-out" in out.stdout
