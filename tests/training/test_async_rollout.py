"""The pieces of asynchronous RL below the recipe: the producer's staleness gate, the weights file it follows,
the decoupled loss fed the sampler's log-probs by the update, a producer that dies being reported, and a resume
whose experience queue was lost or damaged after the checkpoint: refused, or resumed with a fresh queue on request."""

from __future__ import annotations

import math
import re
import sys

import pytest
import torch

import rltk
from rltk.batch import Experience, collate
from rltk.training.rollouts.asynchronous.queue import ExperienceQueue, QueueFileError
from rltk.errors import ConfigError
from rltk.training.rollouts.asynchronous.async_rollout import ProducerFailed, ProducerProcess, open_stage_queue
from rltk.training.rollouts.engine_weights import read_weights_file, weights_file_version, write_weights_file
from rltk.training.step.estimator import compute_advantages
from rltk.training.step.forward import ForwardSettings, batched_logprobs
from rltk.training.step.loss_components import LossComponents
from rltk.training.rollouts.asynchronous.producer import batch_of, gate_open
from rltk.training.updates.rl import policy_update
from tests.training.rl_step_helpers import one_process_strategy, worker
from tests.waits import scaled


@pytest.mark.parametrize("taken, ready, version, bound, open_", [
    # one_step_off: step 5 trains (taken 5) with weights 4; published 4, nothing ready: the batch sampled
    # now by 4 trains at step 6 under version 5, one behind
    (5, 0, 4, 1, True),
    # ... and a second batch, queued behind it, would train at step 7 under version 6: two behind
    (5, 8, 4, 1, False),
    # the trainer waits for step 6 (taken 5, published 5): two ready batches make the next one train at 8
    # under version 7, two behind (staleness 2 allows it, 1 does not)
    (5, 16, 5, 2, True), (5, 16, 5, 1, False),
    # staleness 0 samples only for the step the trainer is waiting for, with its weights
    (5, 0, 5, 0, True), (5, 0, 4, 0, False),
    # a partial batch counts as a batch ahead
    (5, 3, 5, 0, False),
])
def test_the_gate_bounds_the_version_a_batch_trains_under(taken, ready, version, bound, open_):
    assert gate_open(taken, ready, 8, version, bound) is open_


def test_ids_carry_the_batch_a_restarted_producer_goes_on_from():
    assert batch_of("producer-0-b12-7") == 12


def test_the_weights_file_round_trips_tied_weights_and_its_version(tmp_path):
    trained = worker.shared.tiny_qwen2(seed=0)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01)
    path = tmp_path / "policy.safetensors"
    assert weights_file_version(path) is None
    write_weights_file(trained, path, 7)
    assert weights_file_version(path) == 7
    assert [p.name for p in tmp_path.iterdir()] == ["policy.safetensors"]  # the temporary was renamed
    fresh = worker.shared.tiny_qwen2(seed=1)
    assert read_weights_file(fresh, path) == 7
    for (name, a), b in zip(trained.state_dict().items(), fresh.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_a_weights_file_of_another_model_is_refused(tmp_path):
    path = tmp_path / "policy.safetensors"
    write_weights_file(torch.nn.Linear(2, 2), path, 1)
    with pytest.raises(RuntimeError, match=r"does not match the model"):
        read_weights_file(worker.shared.tiny_qwen2(seed=0), path)


def _batch(strategy, rows: int = 4):
    batch = collate(worker.local_experiences(0, 0, 1)[:rows], pad_token_id=0)
    batch["old_logprobs"], _ = batched_logprobs(strategy.unwrap(), batch, ForwardSettings(micro_batch_size=2))
    compute_advantages(rltk.get_component("advantage_fn", "grpo"), batch, {})
    return batch


def _update(policy_loss: str, batch):
    strategy = one_process_strategy()
    loss = LossComponents(policy_loss=rltk.get_component("policy_loss", policy_loss),
                          loss_agg=rltk.get_component("loss_agg", "token-mean"))
    metrics, _ = policy_update(strategy, batch, loss, ForwardSettings(micro_batch_size=2), kl_coef=0.0,
                               mini_batches=1, ppo_epochs=1)
    return metrics


def test_the_update_feeds_a_decoupled_loss_the_samplers_logprobs():
    batch = _batch(one_process_strategy())
    plain = _update("ppo_clip", batch)
    # sampled by a policy 0.5 nats below the proximal one on every token: each term weighs e^0.5
    batch["rollout_logprobs"] = batch["old_logprobs"] - 0.5
    batch["has_rollout_logprobs"] = torch.ones_like(batch["has_rollout_logprobs"])
    decoupled = _update("decoupled_ppo", batch)
    assert decoupled["behaviour_weight_mean"] == pytest.approx(math.exp(0.5), rel=1e-5)
    assert decoupled["pg_loss"] == pytest.approx(math.exp(0.5) * plain["pg_loss"], rel=1e-4)
    # rows without the engine's log-probs (expert data) weigh 1: the loss is ppo_clip's
    batch["has_rollout_logprobs"] = torch.zeros_like(batch["has_rollout_logprobs"])
    unweighted = _update("decoupled_ppo", batch)
    assert unweighted["behaviour_weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert unweighted["pg_loss"] == pytest.approx(plain["pg_loss"], rel=1e-5)


def test_a_producer_that_dies_is_restarted_once_then_reported_with_its_log(tmp_path):
    # a config file that is not there: the producer exits at once, with the reason in its log
    args = ["--config", str(tmp_path / "missing.yaml"), "--stage", "1", "--queue", str(tmp_path / "q.sqlite"),
            "--weights", str(tmp_path / "w.safetensors"), "--timeout", "5"]
    producer = ProducerProcess("producer-0", args, tmp_path / "producer-0.log")
    producer.start()
    producer.proc.wait(scaled(60))
    producer.check()  # the first exit: started again
    assert producer.starts == 2
    producer.proc.wait(scaled(60))
    with pytest.raises(ProducerFailed, match=r"(?s)rollout producer 'producer-0' \(pid \d+\) exited with status 1 "
                                             r"after 2 starts; its log is .*producer-0\.log.*missing\.yaml"):
        producer.check()


@pytest.mark.slow  # a process that builds a model: seconds on a quiet machine
def test_a_producer_waiting_for_weights_stops_after_its_timeout_naming_the_file(tmp_path):
    import subprocess

    from omegaconf import OmegaConf

    from rltk.config import load_config
    from rltk.training.rollouts.asynchronous.producer import EXIT_TIMEOUT

    cfg = load_config([], ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
                           "data.train_size=8", "data.eval_size=4"])
    OmegaConf.save(cfg, tmp_path / "c.yaml", resolve=True)
    done = subprocess.run(
        [sys.executable, "-m", "rltk.training.rollouts.asynchronous.producer", "--config", str(tmp_path / "c.yaml"), "--stage", "1",
         "--queue", str(tmp_path / "q.sqlite"), "--weights", str(tmp_path / "w.safetensors"), "--timeout", "1",
         "--name", "p"], capture_output=True, text=True, timeout=scaled(300))
    assert done.returncode == EXIT_TIMEOUT, done.stderr
    assert (f"rltk producer p: error: waited 1 s (buffer.queue_timeout_s) for the trainer's first weights in "
            f"{tmp_path / 'w.safetensors'}") in done.stderr


def _lease(groups: list[int]):
    from rltk.batch import Experience
    from rltk.training.rollouts.asynchronous.queue import Lease

    experiences, ids = [], []
    for g, size in enumerate(groups):
        for i in range(size):
            experiences.append(Experience(prompt_ids=[1], response_ids=[2, 3], score=float(g), group_id=g))
            ids.append(f"p-b0-{len(ids)}")
    return Lease(9, 4, 3, experiences, ids, [[3, 3]] * len(ids), [f"k{e.group_id}" for e in experiences],
                 {"staleness/max": 1.0}, [3] * len(ids))


def test_rank_shares_give_whole_groups_round_robin_and_every_id_once():
    from rltk.training.rollouts.asynchronous.async_rollout import rank_shares

    lease = _lease([4, 4, 4, 4, 4])  # five groups of four over two ranks: groups 0, 2, 4 and 1, 3
    shares = rank_shares(lease, 2)
    assert [sorted({e.group_id for e in s.experiences}) for s in shares] == [[0, 2, 4], [1, 3]]
    assert [len(s) for s in shares] == [12, 8]
    assert sorted(i for s in shares for i in s.ids) == sorted(lease.ids)
    for share in shares:  # each id still describes its experience, and every rank logs the batch's metrics
        assert all(f"k{e.group_id}" == k for e, k in zip(share.experiences, share.group_keys))
        assert share.sampled_versions == [3] * len(share)
        assert (share.step, share.version, share.metrics) == (4, 3, {"staleness/max": 1.0})
    assert rank_shares(lease, 1)[0].ids == lease.ids


def test_full_weights_from_a_state_dict_round_trip_with_tied_tensors_stored_apart(tmp_path):
    from rltk.training.rollouts.engine_weights import write_weights_state

    trained = worker.shared.tiny_qwen2(seed=0)
    state = trained.state_dict()  # tied embedding and head share storage, as a gathered state may
    path = tmp_path / "policy.safetensors"
    write_weights_state(state, path, 3)
    fresh = worker.shared.tiny_qwen2(seed=1)
    assert read_weights_file(fresh, path) == 3
    for (name, a), b in zip(state.items(), fresh.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_the_queue_records_the_trainers_end_and_who_put(tmp_path):
    from rltk.batch import Experience
    from rltk.training.rollouts.asynchronous.queue import ExperienceQueue

    with ExperienceQueue(tmp_path / "q.sqlite") as queue:
        assert queue.finished_step is None and queue.producers() == {}
        group = [Experience(prompt_ids=[1], response_ids=[2], score=0.0, group_id=0)] * 2
        queue.put(group, ids=["a-b0-0", "a-b0-1"], versions=0, producer="a")
        queue.put(group[:1], ids=["b-b0-0"], versions=0, producer="b")
        queue.finish(8)
    with ExperienceQueue(tmp_path / "q.sqlite") as queue:  # another process sees both
        assert queue.finished_step == 8 and queue.producers() == {"a": 2, "b": 1}


# ---------------------------------------------------------------- a queue lost between a crash and the resume

def _produce(queue, batches: int, name: str = "p") -> None:
    """Put ``batches`` batches of two groups of two, going on after the producer's last id as
    :func:`rltk.training.rollouts.asynchronous.producer.run_producer` does (ids ``<name>-b<batch>-<i>``)."""

    last = queue.last_id(name)
    start = 0 if last is None else batch_of(last) + 1
    for b in range(start, start + batches):
        queue.put([Experience(prompt_ids=[b], response_ids=[1, 2], score=float(i), group_id=i // 2)
                   for i in range(4)], ids=[f"{name}-b{b}-{i}" for i in range(4)], versions=b, producer=name)


def _train(queue, steps: range) -> list[str]:
    """The trainer's side: one batch a step, every 2nd step the cursor into the checkpoint, then the commit."""
    trained, cursor = [], None
    for step in steps:
        trained += queue.take(4, step=step, version=step - 1).ids
        if step % 2 == 0:
            cursor = queue.cursor(step)
            queue.commit(step)
    return trained, cursor


def _crashed_after_a_checkpoint(path):
    """A trainer dead at step 5 holding its lease, after the checkpoint of step 4: that checkpoint's cursor and
    the ids it trained."""
    with ExperienceQueue(path) as queue:
        queue.recover(0)
        _produce(queue, 6)
        trained, cursor = _train(queue, range(1, 6))
    return cursor, trained[:16]


def _damage(path, how: str) -> None:
    if how == "empty":
        path.write_bytes(b"")
    elif how == "halved":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "deleted":
        path.unlink()
    elif how == "replaced":  # another run's queue in its place
        path.unlink()
        with ExperienceQueue(path) as other:
            _produce(other, 1, name="q")


@pytest.mark.parametrize("how, what", [
    ("empty", r"is empty \(0 bytes\), but the checkpoint this run resumes from \(training step 4\) trained 16 "
              r"experiences from it; resuming with it would train them again"),
    ("halved", r"is damaged: SQLite cannot read it \(database disk image is malformed\)"),
    ("deleted", r"does not exist \(deleted\?\), but the checkpoint this run resumes from \(training step 4\)"),
    ("replaced", r"is another queue \(id [0-9a-f]+, not the checkpoint's [0-9a-f]+: a replaced file, or another "
                 r"run's or stage's queue\), but the checkpoint of training step 4 trained 16 experiences"),
])
def test_a_queue_lost_after_a_checkpoint_is_refused_and_resumed_fresh_only_when_asked(tmp_path, capsys, how, what):
    path = tmp_path / "experience_queue.sqlite"
    cursor, checkpointed = _crashed_after_a_checkpoint(path)
    _damage(path, how)
    before = path.read_bytes() if path.exists() else None
    hint = "checkpoint.resume=never: the run starts over"
    with pytest.raises(QueueFileError) as refused:
        open_stage_queue(path, resumed_step=4, cursor=cursor, start_over=hint)
    assert isinstance(refused.value, ConfigError)  # `rltk run` exits 2 with the message, no traceback
    message = str(refused.value)
    assert message.startswith(f"experience queue {path} ") and re.search(what, message), message
    assert (f"Either start the stage over ({hint}), or resume from this checkpoint without the queue's leftovers "
            f"with buffer.queue_resume=fresh") in message
    assert (path.read_bytes() if path.exists() else None) == before  # the refusal changed nothing

    # resumed without the leftovers: a new queue, the producer going on after the checkpoint's last batch (3)
    queue = open_stage_queue(path, resumed_step=4, cursor=cursor, queue_resume="fresh", start_over=hint)
    with queue:
        _produce(queue, 4)
        resumed, _ = _train(queue, range(5, 9))
    assert not set(resumed) & set(checkpointed), "an experience the checkpoint trained was trained again"
    assert resumed == [f"p-b{b}-{i}" for b in range(4, 8) for i in range(4)]
    discarded = tmp_path / "experience_queue.sqlite.discarded"
    assert discarded.exists() == (how != "deleted")
    if before is not None:
        assert discarded.read_bytes() == before  # kept as it was, beside the new one
    err = capsys.readouterr().err
    assert (f"rltk: buffer.queue_resume=fresh: a new experience queue {path} (the old one renamed to {discarded})"
            if how != "deleted" else "(there was no old one)") in err
    assert "the producers going on where the checkpoint's trained ones end (p after p-b3-3)" in err


def test_an_intact_queue_resumes_and_a_fresh_one_needs_a_checkpoint_with_a_cursor(tmp_path):
    path = tmp_path / "q.sqlite"
    cursor, checkpointed = _crashed_after_a_checkpoint(path)
    with open_stage_queue(path, resumed_step=4, cursor=cursor) as queue:  # the crashed step 5's lease is back
        assert queue.counts() == {"ready": 8, "leased": 0, "consumed": 16, "dropped": 0}
        resumed, _ = _train(queue, range(5, 7))
    assert resumed == [f"p-b{b}-{i}" for b in (4, 5) for i in range(4)]
    # a checkpoint of an rltk that kept no cursor: the queue is taken as it is, but it cannot be replaced
    with open_stage_queue(path, resumed_step=6, cursor=None):
        pass
    with pytest.raises(ConfigError, match=r"buffer\.queue_resume=fresh: the checkpoint this stage resumes from "
                                          r"\(training step 6\) keeps no cursor of the experience queue .*q\.sqlite"):
        open_stage_queue(path, resumed_step=6, cursor=None, queue_resume="fresh")
