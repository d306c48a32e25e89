"""Reward services on Ray: a reward function run by Ray actors of its own, on the nodes its request names.

With ``launcher=ray``, ``launcher_args.rewards.<name>: {cpus, gpus, resources, labels, replicas, timeout_s}``
takes the reward function ``<name>`` of ``reward.reward_fn`` out of the processes that score samples (the
producers, the trainer's held-out evaluation) and into ``replicas`` :class:`RewardService` actors, placed like
producers: a reward model on a GPU node (``reward_model`` with its ``path`` loads it there once), code sandboxes
on nodes kept for untrusted programs (``code_execution``), an LLM judge beside its endpoint. The trainer places
them as the run opens (:func:`rltk.training.scaffold.ray_cluster.place_reward_services`), so they live as long
as the trainer's process, and a resumed run places new ones: nothing about them is saved in the config.

Each actor runs the function as the run's own :class:`~rltk.rewards.compose.RewardComposer` would (in worker
processes under ``reward.timeout_s`` unless it is bounded or batched) and sends back each sample's
:class:`~rltk.rewards.pool.CallOutcome`. Whoever scores holds a :class:`RemoteReward` in the function's place,
a batched reward that splits a step's samples among the replicas and waits at most ``timeout_s``; so the
weights, the fallback and the failure and timeout counts of ``reward_fn/*`` are the caller's, as for a
function run in place. Actors are found by name in the run's Ray namespace (:func:`service_name`), which is
how a producer on another node, started again or not, reaches them.

A call cut short by the actor's death is made again by Ray (scoring is idempotent) once Ray has started the
actor again (``launcher_args.max_restarts``); when Ray gives it up, the caller raises
:class:`RewardServiceGone`, which stops training (a configuration or cluster failure, not a bad sample).

Imports Ray when first called, so only runs that place reward services need it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from rltk.io import node_work_dir
from rltk.rewards.compose import build_reward_composer
from rltk.rewards.marks import batched
from rltk.rewards.pool import CallOutcome, RewardWorkerError

class RewardServiceGone(RewardWorkerError):
    """A reward service's actor is gone for good (Ray gave it up, or nothing by its name was ever placed)."""


def service_name(run_name: str, reward: str, replica: int) -> str:
    """The Ray actor name of ``reward``'s ``replica`` in the run named ``run_name`` (within its namespace)."""
    return f"rltk-reward/{run_name}/{reward}/{replica}"


class RewardService:
    """One replica of a reward service: the function ``name`` of ``reward`` (the run's ``reward`` section,
    as a plain mapping) scored as the run's composer would, in a folder of this node
    (``<node work dir>/<run name>/reward-<name>-<replica>``, :func:`~rltk.io.node_work_dir`)."""

    def __init__(self, *, reward: dict, name: str, work_dir: str | None, run_name: str, replica: int):
        folder = os.path.join(node_work_dir(work_dir), run_name, f"reward-{name}-{replica}")
        os.makedirs(folder, exist_ok=True)
        os.chdir(folder)  # whatever the function writes by a relative path stays on this node
        self.folder, self.name = folder, name
        self.composer = build_reward_composer(
            [name], args={name: (reward.get("reward_fn_args") or {}).get(name) or {}},
            fallback=reward.get("fallback", 0.0), timeout_s=reward.get("timeout_s", 5.0),
            workers=reward.get("workers", 4))
        self.scored = 0

    def where(self) -> dict:
        """Where it runs: its node's id and address, its folder, its process id."""
        import ray

        context = ray.get_runtime_context()
        return {"node": context.get_node_id(), "address": ray.util.get_node_ip_address(), "folder": self.folder,
                "pid": os.getpid()}

    def outcomes(self, samples: list[dict]) -> list[CallOutcome]:
        """Each sample's outcome (a value, or why it has none); see :meth:`RewardComposer.outcomes`."""
        out = [per_sample[0] for per_sample in self.composer.outcomes(samples)]
        self.scored += len(samples)
        return out

    def samples_scored(self) -> int:
        return self.scored

    def close(self) -> None:
        self.composer.close()


class RemoteReward:
    """Stands in for the reward function ``name`` in a caller's composer: a batched reward whose samples are
    scored by the ``replicas`` :class:`RewardService` actors of the run ``run_name`` in ``namespace``, each
    step's call waiting at most ``timeout_s``. The actors are looked up by name for at most ``lookup_timeout_s``
    (the trainer places them as the run opens; another trainer rank may ask first)."""

    def __init__(self, name: str, *, run_name: str, namespace: str, replicas: int, timeout_s: float,
                 lookup_timeout_s: float):
        self.name, self.run_name, self.namespace = name, run_name, namespace
        self.replicas, self.timeout_s, self.lookup_timeout_s = int(replicas), float(timeout_s), float(lookup_timeout_s)
        self._actors: list | None = None
        batched(self)

    @property
    def where(self) -> str:
        return (f"reward service '{self.name}' (Ray actors {service_name(self.run_name, self.name, 0)}"
                f"{' ...' if self.replicas > 1 else ''} in namespace '{self.namespace}')")

    def __call__(self, *, prompt: list, response: list, ground_truth: list, extras: list) -> list:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        samples = [{"prompt": p, "response": r, "ground_truth": g, "extras": e}
                   for p, r, g, e in zip(prompt, response, ground_truth, extras)]
        if not samples:
            return []
        actors = self._find()
        chunks = _split(samples, len(actors))
        refs = [actor.outcomes.remote(chunk) for actor, chunk in zip(actors, chunks) if chunk]
        try:
            parts = ray.get(refs, timeout=self.timeout_s)
        except GetTimeoutError:
            for ref in refs:
                ray.cancel(ref)
            timed_out = CallOutcome(ok=False, error_type="RewardTimeout", timed_out=True,
                                    error=f"{self.where} did not score {len(samples)} samples within "
                                          f"{self.timeout_s:g} s (launcher_args.rewards.{self.name}.timeout_s)")
            return [timed_out] * len(samples)
        except RayActorError as exc:
            self._actors = None
            raise RewardServiceGone(f"{self.where} is gone and Ray did not start it again "
                                    f"(launcher_args.max_restarts): {type(exc).__name__}: "
                                    f"{(str(exc).strip().splitlines() or [''])[0][:300]}") from None
        return [outcome for part in parts for outcome in part]

    def _find(self) -> list:
        """The service's actors, looked up by name once (waiting while the trainer still places them)."""
        import ray

        if self._actors is not None:
            return self._actors
        if not ray.is_initialized():  # ray.get_actor would start a Ray of this process's own
            raise RewardServiceGone(f"{self.where} is out of reach: this process is not connected to the run's Ray "
                                    f"cluster (launcher=ray connects the trainer as the run opens)")
        deadline = time.monotonic() + self.lookup_timeout_s
        found = []
        for replica in range(self.replicas):
            name = service_name(self.run_name, self.name, replica)
            while True:
                try:
                    found.append(ray.get_actor(name, namespace=self.namespace))
                    break
                except ValueError:  # not (yet) there
                    if time.monotonic() > deadline:
                        raise RewardServiceGone(
                            f"no Ray actor named '{name}' in namespace '{self.namespace}' within "
                            f"{self.lookup_timeout_s:g} s (launcher_args.placement_timeout_s): the trainer places "
                            f"the reward services of launcher_args.rewards as the run opens; is this process "
                            f"connected to the run's cluster?") from None
                    time.sleep(0.5)
        self._actors = found
        return found


def _split(samples: Sequence[Any], parts: int) -> list[list[Any]]:
    """``samples`` in ``parts`` contiguous chunks of sizes differing by at most one, in order."""
    size, extra = divmod(len(samples), parts)
    out, start = [], 0
    for k in range(parts):
        end = start + size + (k < extra)
        out.append(list(samples[start:end]))
        start = end
    return out

