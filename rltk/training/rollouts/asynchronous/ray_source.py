"""``launcher=ray``: an asynchronous stage's producers as Ray actors on other machines, with no shared folder.

The trainer keeps the durable record, as with local producers: the stage's SQLite
:class:`~rltk.training.rollouts.asynchronous.queue.ExperienceQueue` in its own run folder, with the same leases,
exactly-once commits with each checkpoint, and cursor checks on resume (:class:`RayRollouts` is an
:class:`~rltk.training.rollouts.asynchronous.async_rollout.AsyncRollouts`; only where producers run and how they reach
the queue and the weights differ). Over the network instead of through files:

* **Experiences.** A :class:`QueueFront` actor, pinned to the trainer's node (a hard node affinity), opens
  the same queue file (WAL mode, one machine, as a local producer does) and serves the calls a producer
  makes (``put``, ``progress``, ``last_id``, ``finished_step``). A put returns once its SQLite transaction
  has committed, so a producer holds nothing a crash may lose: a restarted one asks the queue for its last
  id and goes on after it, as a restarted local producer does. A front actor rather than calls into the
  trainer: a Ray driver cannot serve calls, and the trainer's loop would have to poll for them.
* **Weights.** Each version is put into Ray's object store once (``ray.put`` of a CPU state dict, owned by
  the trainer) and announced with its version on the front; a producer (:class:`RayWeightsFollower`) polls
  the version and fetches the object when it is newer. The ``hf`` engine loads it into the producer's
  module; a ``vllm_server`` engine's servers load it from a file the producer writes into its own folder
  on its own node. Ray's object store was chosen over a torch.distributed broadcast because producers come
  and go (a restarted actor joins with no process-group rendezvous) and the object is pulled only by
  producers that want it.
* **Producers.** :class:`ProducerActor` runs :class:`~rltk.training.rollouts.asynchronous.producer.Producer` in a Ray
  actor placed by ``launcher_args.producer`` (cpus, gpus, custom resources, node labels). The vLLM servers a
  producer launches (``vllm_server`` with ``launch``) are its child processes on its node, in its folder, with
  the devices Ray gave the actor (``CUDA_VISIBLE_DEVICES``; none when it asked for no GPU) and ended with it
  (:mod:`rltk.rollout.tether`). The actor has Ray's
  ``max_restarts`` = ``launcher_args.max_restarts``: an actor whose process or node dies is started again
  on a node that meets the request, and the trainer (:class:`RayProducer`) starts its loop again, at most
  ``max_restarts`` times, then reports it, naming the producer, where it ran and what happened. Each
  producer works in a folder of its own node (:func:`~rltk.io.node_work_dir`),
  and nothing on its node reads the trainer's run folder (the config travels as a value; data and model
  paths in it must exist on every node, or be built in memory like the tiny model).

Every cross-node wait has a timeout that names what it waited for: a producer's calls to the front and its
weight fetches (``buffer.queue_timeout_s``), the trainer's publish (the same), the actors' placement
(``launcher_args.placement_timeout_s``).

Imported only when ``launcher=ray`` (it imports Ray).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import ray
import torch
from omegaconf import OmegaConf
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

from rltk.training.rollouts.asynchronous.queue import ExperienceQueue
from rltk.errors import ConfigError, ProcessWaitError
from rltk.training.rollouts.asynchronous.async_rollout import (
    HANDOFF_MARGIN_S, AsyncRollouts, ProducerFailed, _handoff_group, open_trainer_queue,
)
from rltk.training.rollouts.asynchronous.producer import EXIT_TIMEOUT, WeightsFollower
from rltk.io import node_work_dir
from rltk.training.scaffold.ray_cluster import actor_options, open_cluster, pinned_here

#: Seconds between a Ray producer's looks at the queue and the weights (each is a call to another node).
POLL_S = 0.05
FRONT = "the experience queue's front actor on the trainer's node"


class FrontTimeout(ProcessWaitError):
    """A call to the queue's front actor, or a weight fetch, took longer than ``buffer.queue_timeout_s``."""


def _call(ref, timeout_s: float, what: str):
    """``ray.get(ref)`` within ``timeout_s``, its errors naming ``what`` was waited for."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        raise FrontTimeout(f"waited {timeout_s:g} s (buffer.queue_timeout_s) for {what}") from None
    except RayActorError as exc:
        raise ProcessWaitError(f"{FRONT} is gone (the trainer stopped, or its node died) while waiting for "
                               f"{what}: {type(exc).__name__}") from None


#: dtypes numpy has not, sent as the integers of their width and viewed back on arrival
_NO_NUMPY = {torch.bfloat16: torch.int16}


def as_arrays(state: dict) -> dict:
    """Full weights as ``{name: (dtype name, numpy array)}`` for Ray's object store: numpy arrays are stored
    out of band and read back without a copy (a reader's arrays point into the object store), where torch
    tensors would be pickled into the object and copied out again. Tensors that share their storage (tied
    weights) are sent once, under the first name, as a weights file stores them."""
    out, seen = {}, set()
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        if key in seen:  # a tied weight (the output head on the embedding) goes once: loading accepts that
            continue
        seen.add(key)
        tensor = tensor.detach().cpu().contiguous()
        carrier = _NO_NUMPY.get(tensor.dtype)
        out[name] = (str(tensor.dtype).removeprefix("torch."),
                     (tensor.view(carrier) if carrier is not None else tensor).numpy())
    return out


def from_arrays(arrays: dict) -> dict:
    """:func:`as_arrays` back to tensors, without a copy: they share the read-only arrays' memory, so load
    them into a module (a copy) and drop them."""
    import warnings

    state = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, (dtype, array) in arrays.items():
            tensor = torch.from_numpy(array)
            state[name] = tensor.view(getattr(torch, dtype)) if tensor.dtype != getattr(torch, dtype) else tensor
    return state


def publish_weights(front, state: dict, version: int, timeout_s: float):
    """Put ``state`` (full weights, :func:`as_arrays`) into Ray's object store and announce it as ``version``
    on the :class:`QueueFront` ``front``; returns the object's reference, which keeps it stored while held."""
    ref = ray.put(as_arrays(state))  # copied into the object store here: the trainer may change its weights next
    _call(front.publish_weights.remote(int(version), [ref]), timeout_s,
          f"{FRONT} to announce weights version {version}")
    return ref


class QueueFront:
    """The experience queue's door for producers on other nodes: a Ray actor on the trainer's node that opens
    the trainer's queue file and serves a producer's calls, and announces the newest published weights."""

    def __init__(self, path: str, journal_mode: str, timeout_s: float):
        self.queue = ExperienceQueue(path, timeout_s=timeout_s, journal_mode=journal_mode)
        self.weights: tuple[int, list] | None = None  # (version, [object ref]): a boxed ref stays a ref

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def put(self, experiences, ids, versions, producer, counters) -> int:
        return self.queue.put(experiences, ids=ids, versions=versions, producer=producer, counters=counters)

    def progress(self) -> tuple[int, int]:
        return self.queue.progress()

    def last_id(self, producer: str) -> str | None:
        return self.queue.last_id(producer)

    def finished_step(self) -> int | None:
        return self.queue.finished_step

    def publish_weights(self, version: int, boxed_ref: list) -> None:
        self.weights = (int(version), boxed_ref)

    def weights_version(self) -> int | None:
        return None if self.weights is None else self.weights[0]

    def newest_weights(self) -> tuple[int, list] | None:
        return self.weights


class RemoteQueue:
    """What a producer calls on its queue (:class:`~rltk.training.rollouts.asynchronous.producer.Producer`), through the
    :class:`QueueFront` actor; every call waits at most ``timeout_s``."""

    def __init__(self, front, timeout_s: float):
        self.front, self.timeout_s = front, float(timeout_s)

    def put(self, experiences, *, ids, versions, producer, counters=None) -> int:
        return _call(self.front.put.remote(experiences, ids, versions, producer, counters), self.timeout_s,
                     f"{FRONT} to store {len(ids)} experiences of '{producer}'")

    def progress(self) -> tuple[int, int]:
        return _call(self.front.progress.remote(), self.timeout_s, f"{FRONT} to say how far the trainer took")

    def last_id(self, producer: str) -> str | None:
        return _call(self.front.last_id.remote(producer), self.timeout_s, f"{FRONT} to give '{producer}''s last id")

    @property
    def finished_step(self) -> int | None:
        return _call(self.front.finished_step.remote(), self.timeout_s, f"{FRONT} to say whether the stage ended")


class RayWeightsFollower(WeightsFollower):
    """:class:`~rltk.training.rollouts.asynchronous.producer.WeightsFollower` over Ray: the version announced on the
    :class:`QueueFront`, the weights fetched from Ray's object store. ``path`` is the producer's own file, on
    its own node, which a ``vllm_server`` engine's servers load."""

    def __init__(self, engine, policy, path, *, front, timeout_s: float):
        super().__init__(engine, policy, path)
        self.front, self.timeout_s = front, float(timeout_s)

    @property
    def source(self) -> str:
        return f"Ray's object store (announced by {FRONT})"

    def published_version(self) -> int | None:
        return _call(self.front.weights_version.remote(), self.timeout_s, f"{FRONT} to announce the weights")

    def _load(self, interrupt: bool) -> int:
        from rltk.training.rollouts.engine_weights import load_weights_state, write_weights_state

        version, (ref,) = _call(self.front.newest_weights.remote(), self.timeout_s, f"{FRONT} to hand the weights")
        state = from_arrays(_call(ref, self.timeout_s,
                                  f"weights version {version} from the trainer's node (Ray object store)"))
        if not self.servers:
            load_weights_state(self.policy, state, f"weights version {version} from the trainer")
            return version
        write_weights_state(state, self.path, version)  # this node's own file: the servers beside it load it
        return self._into_servers(self.path, interrupt)


class ProducerActor:
    """One rollout producer as a Ray actor: :func:`~rltk.training.rollouts.asynchronous.producer.run_producer` in a
    folder of its own node, with its queue and weights reached through the :class:`QueueFront`."""

    def __init__(self, cfg: str, *, stage_index: int, name: str, index: int, count: int, timeout_s: float,
                 work_dir: str | None, front):
        self.cfg, self.stage_index, self.name, self.index, self.count = cfg, stage_index, name, index, count
        self.timeout_s, self.front = float(timeout_s), front
        self.folder = os.path.join(node_work_dir(work_dir), str(OmegaConf.create(cfg).name), f"stage_{stage_index}",
                                   name)
        os.makedirs(self.folder, exist_ok=True)
        os.chdir(self.folder)  # whatever the producer writes by a relative path stays on its node
        if not ray.get_runtime_context().get_accelerator_ids().get("GPU"):
            # Ray (ray-project/ray#54868) leaves CUDA_VISIBLE_DEVICES alone for an actor that asked for no GPU: the
            # vLLM servers this producer launches would see, and take, every GPU of its node
            os.environ["CUDA_VISIBLE_DEVICES"] = ""

    def where(self) -> dict:
        """Where it runs: its node's id and address, its folder, its process id."""
        context = ray.get_runtime_context()
        return {"node": context.get_node_id(), "address": ray.util.get_node_ip_address(), "folder": self.folder,
                "pid": os.getpid()}

    def run(self) -> int:
        """Produce until the trainer ends the stage (0) or a wait runs out (the producer's exit status)."""
        from rltk.training.rollouts.asynchronous.producer import run_producer

        follower = functools.partial(RayWeightsFollower, front=self.front, timeout_s=self.timeout_s)
        try:
            return run_producer(OmegaConf.create(self.cfg), stage_index=self.stage_index, queue_path=None,
                                weights_path=os.path.join(self.folder, "policy.safetensors"), name=self.name,
                                timeout_s=self.timeout_s, index=self.index, count=self.count, poll_s=POLL_S,
                                trainer=False, queue=RemoteQueue(self.front, self.timeout_s),
                                follower_type=follower)
        except SystemExit as exc:  # a producer's exit status; an actor that called exit would not be restarted
            return int(exc.code or 0)


class RayProducer:
    """The trainer's handle on one :class:`ProducerActor`: starts its loop, starts it again when it ended or its
    actor died (Ray itself starts a dead actor again on a node that meets its request), and reports it after
    ``max_restarts`` restarts or when Ray gives the actor up.

    After a death the handle asks the actor where it runs (:attr:`probe`) and starts the loop once that
    answers: a call made before Ray has noticed the death fails as "unavailable" and is made again (not a
    restart); one that fails as "died" means Ray will not start it again. A restart Ray cannot place is
    bounded by the trainer's wait for experiences (``buffer.queue_timeout_s``), whose message names it.
    """

    def __init__(self, name: str, actor, max_restarts: int):
        self.name, self.actor, self.max_restarts = name, actor, max_restarts
        self.starts, self.run_ref = 0, None
        self.probe = actor.where.remote()  # answers once the actor runs (again)
        self.where: dict | None = None

    @property
    def log(self) -> str:
        """Where it runs, for messages (a Ray actor's output is in the trainer's, prefixed with its name)."""
        if self.probe is not None or self.where is None:
            return "a Ray actor waiting to be placed" + (" again" if self.starts else "")
        return (f"a Ray actor on node {self.where['node'][:8]} ({self.where['address']}, pid {self.where['pid']}, "
                f"folder {self.where['folder']}); its output is in the trainer's")

    def placed(self, where: dict) -> None:
        """The actor answered from ``where``: start its loop."""
        self.where, self.probe = where, None
        self.starts += 1
        self.run_ref = self.actor.run.remote()

    def check(self) -> None:
        """Start the producer's loop again if it ended (at most ``max_restarts`` times); then
        :class:`~rltk.training.rollouts.asynchronous.async_rollout.ProducerFailed`."""
        if self.probe is not None:
            if ray.wait([self.probe], timeout=0)[0]:
                self._answered()
            return
        if self.run_ref is None or not ray.wait([self.run_ref], timeout=0)[0]:
            return
        where = self.log
        try:
            code = ray.get(self.run_ref)
            why = f"exited with status {code}" + (" (a wait of buffer.queue_timeout_s ran out)"
                                                  if code == EXIT_TIMEOUT else "")
        except RayActorError as exc:
            why = f"died: its process or node is gone ({type(exc).__name__}: {_first_line(exc)})"
        except RayTaskError as exc:
            why = f"failed: {str(exc.cause if exc.cause is not None else exc).splitlines()[-1][:500]}"
        if self.starts > self.max_restarts:
            raise ProducerFailed(f"rollout producer '{self.name}' ({where}) {why}, after {self.starts} starts "
                                 f"(launcher_args.max_restarts={self.max_restarts})")
        print(f"rltk: rollout producer '{self.name}' ({where}) {why}; starting it again (Ray places a dead actor "
              f"again on a node that meets launcher_args.producer)", file=sys.stderr, flush=True)
        self.run_ref, self.probe = None, self.actor.where.remote()

    def _answered(self) -> None:
        try:
            where = ray.get(self.probe)
        except ActorUnavailableError:  # Ray has not noticed the death yet: ask again
            self.probe = self.actor.where.remote()
            return
        except RayActorError as exc:
            self.probe = None
            raise ProducerFailed(f"rollout producer '{self.name}' could not be started again: Ray gave its actor up "
                                 f"({type(exc).__name__}: {_first_line(exc)}; launcher_args.max_restarts="
                                 f"{self.max_restarts})") from None
        self.placed(where)

    def stop(self, grace_s: float = 10.0) -> None:
        ray.kill(self.actor, no_restart=True)


def _first_line(exc: BaseException, limit: int = 300) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:limit]


class RayRollouts(AsyncRollouts):
    """:class:`~rltk.training.rollouts.asynchronous.async_rollout.AsyncRollouts` whose producers are Ray actors, fed and
    kept up to date over the network (module docstring). ``weights`` is None: no file is written."""

    front = None
    newest_weights = None  # the trainer's reference to the newest version's object, which keeps it stored

    @classmethod
    def start(cls, stage, strategy, *, resumed_step: int, cursor: dict | None = None) -> "RayRollouts":
        """As :meth:`AsyncRollouts.start`: the queue settled, the weights published as ``resumed_step``, the
        producers placed and started (rank 0); collective. Placement waits ``launcher_args.placement_timeout_s``."""
        cfg = stage.cfg
        group = _handoff_group(strategy, float(cfg.buffer.queue_timeout_s) + HANDOFF_MARGIN_S)
        if not strategy.is_main:
            rollouts = cls(stage, strategy, None, [], None, group=group)
            rollouts._publish(resumed_step)  # a sharded strategy gathers on every rank
            return rollouts
        settings = open_cluster(cfg)  # connected as the run opened; the nodes may have changed since
        queue, queue_path = open_trainer_queue(stage, resumed_step, cursor)
        rollouts = cls(stage, strategy, queue, [], None, group=group)
        try:
            rollouts.front = ray.remote(QueueFront).options(**pinned_here(), max_restarts=0).remote(
                str(Path(queue_path).resolve()), cfg.buffer.queue_journal, float(cfg.buffer.queue_timeout_s))
            rollouts._publish(resumed_step)
            queue.publish_version(resumed_step)
            rollouts.producers = rollouts._place_producers(settings)  # each one's loop started
            rollouts.local = len(rollouts.producers)
        except BaseException:
            rollouts.close()
            raise
        return rollouts

    def _place_producers(self, settings) -> list[RayProducer]:
        """``trainer.producers`` actors, each placed by ``launcher_args.producer`` within
        ``launcher_args.placement_timeout_s`` (ConfigError naming the keys otherwise)."""
        cfg, count = self.stage.cfg, int(self.stage.cfg.trainer.producers)
        # the resolved config as YAML: small enough to travel inline with the actor's creation, so Ray can
        # start the actor again after its node died (arguments in the object store might be gone by then).
        # The front's handle is an argument too, which is why Ray warns that "constructor arguments in the
        # object store" may stop a restart (ray-project/ray#53727): the front lives on the trainer's node as
        # long as the stage, so a restart that matters finds it (the node-loss test restarts a producer).
        values = OmegaConf.to_yaml(cfg, resolve=True)
        actor_type = ray.remote(ProducerActor).options(**actor_options(settings.producer,
                                                                       max_restarts=settings.max_restarts))
        producers = [RayProducer(f"producer-{k}", actor_type.remote(
            values, stage_index=self.stage.index, name=f"producer-{k}", index=k, count=count,
            timeout_s=float(cfg.buffer.queue_timeout_s), work_dir=settings.work_dir, front=self.front),
            settings.max_restarts) for k in range(count)]
        refs = [p.probe for p in producers]
        placed, waiting = ray.wait(refs, num_returns=len(refs), timeout=settings.placement_timeout_s)
        if waiting:
            for producer in producers:
                producer.stop()
            names = ", ".join(p.name for p, ref in zip(producers, refs) if ref in waiting)
            raise ConfigError(
                f"bad value for 'launcher_args.producer': the Ray cluster placed {len(placed)} of {count} rollout "
                f"producer actors within {settings.placement_timeout_s:g} s (launcher_args.placement_timeout_s); "
                f"not placed: {names}. Ask for less (launcher_args.producer {settings.producer}), fewer producers "
                f"(trainer.producers), or add nodes")
        try:
            where = ray.get(refs)  # an actor whose __init__ failed raises here
        except RayActorError as exc:
            for producer in producers:
                producer.stop()
            raise ProcessWaitError(f"a rollout producer actor could not start on its node: {exc}") from None
        for producer, answer in zip(producers, where):
            producer.placed(answer)
        return producers

    def _publish(self, version: int) -> None:
        """Put the weights into Ray's object store as ``version`` and announce them on the front (rank 0).
        Collective under a strategy that shards parameters (every rank gathers)."""
        state = self.strategy.export_state_dict() if self.strategy.shards_parameters else None
        if not self.strategy.is_main:
            return
        if state is None:
            state = self.strategy.unwrap().state_dict()
        # the older version's object is freed once no producer still reads it
        self.newest_weights = publish_weights(self.front, state, version, self.timeout_s)

    def close(self) -> None:
        try:
            super().close()  # producers killed, the queue told the stage ended, closed
        finally:
            if self.front is not None:
                ray.kill(self.front, no_restart=True)
                self.front = None
            self.newest_weights = None
