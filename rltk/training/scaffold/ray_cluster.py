"""Reaching a Ray cluster for ``launcher=ray``, and placing actors on it: checked first, with timeouts.

Imported only when a config says ``launcher=ray`` (``import rltk`` never imports Ray). :func:`connect`
runs as the run opens, before a model is built, on the trainer's rank 0, and refuses with a
:class:`~rltk.errors.ConfigError` (``rltk run`` exits 2) naming the key:

* ``launcher_args.address`` that names no running cluster (nothing answers at host:port, or what answers is
  no Ray cluster, within ``launcher_args.connect_timeout_s``; ``auto`` with no cluster on this node and no
  ``RAY_ADDRESS``);
* ``launcher_args.producer.*`` requests that no node of the cluster can meet (each node's total
  CPUs, GPUs, custom resources and labels, :func:`check_request`).

Empty ``address`` connects to ``RAY_ADDRESS`` when it is set (``ray job submit`` sets it for the job it
runs), else starts a Ray of its own on this machine; unlike ``ray.init()`` it never joins a cluster it
happens to find on the machine (another user's, or a dead one's leftover address file). A driver already
connected (a script that called ``ray.init`` itself) is used as it is.

A loopback address stays the loopback (:func:`init_ray`): Ray on its own turns ``127.0.0.1`` into this
machine's interface address, both in an address to connect to and in the node address of a driver or of a Ray
it starts, so a cluster on ``127.0.0.1`` could not be reached as given, and a Ray of rltk's own would listen
on the network. Errors name the address that was tried, which is the one given.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket

from rltk.config.launcher_checks import ActorRequest, RayLauncherSettings, ray_launcher_settings
from rltk.errors import ConfigError, ProcessWaitError


def _reachable(address: str, timeout_s: float) -> str | None:
    """None if something accepts TCP connections at ``host:port`` within ``timeout_s``, else why not."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except (OSError, ValueError) as exc:
        return f"nothing listens there ({type(exc).__name__}: {exc})"


#: Asks the cluster's GCS (its head's control store) for its nodes, in a process of its own: ``ray.init`` on an
#: address where something else listens retries for minutes, and a thread stuck in Ray's C++ client cannot be
#: stopped, whereas a process can.
_PROBE = ("import sys\nfrom ray._raylet import GcsClient\n"
          "GcsClient(address=sys.argv[1]).get_all_node_info(timeout=float(sys.argv[2]))\n")


#: What Ray's client reports when the cluster wants a token this process did not send (or a different one).
_TOKEN_REFUSED = ("AuthenticationError", "InvalidAuthToken", "UNAUTHENTICATED", "Unauthenticated")


def _gcs_answers(address: str, timeout_s: float) -> str | None:
    """None if the Ray GCS at ``address`` lists its nodes within ``timeout_s``, else why not."""
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, address, str(timeout_s)], capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "something listens there, but it did not answer as a Ray cluster's head does"
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        last = lines[-1] if lines else f"status {done.returncode}"
        if any(word in done.stderr for word in _TOKEN_REFUSED):
            return token_refused(last)
        return f"it is not a Ray cluster that answers ({last})"
    return None


_WANTS_TOKEN = "a Ray cluster answers there, but it wants its authentication token"


def token_refused(said: str) -> str:
    """Why a cluster that refused this process's (missing or wrong) token did, and what to set."""
    mode = os.environ.get("RAY_AUTH_MODE")
    here = f"RAY_AUTH_MODE={mode}" if mode else "RAY_AUTH_MODE is unset"
    return (f"{_WANTS_TOKEN} ({said}; Ray token authentication; here {here}). Set RAY_AUTH_MODE=token for rltk, "
            f"with the cluster's token in ~/.ray/auth_token (a head started on this machine wrote it there), "
            f"RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN; or start the cluster with RAY_AUTH_MODE=disabled")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 in brackets or not) is this machine's loopback."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def _loopback_kept():
    """Within it, Ray keeps a loopback host as 127.0.0.1, where it would otherwise put this machine's interface
    address (``services.resolve_ip_for_localhost``): in the address it connects to and in the node address of
    the driver or the Ray it starts. It is Ray's own switch for the same (``ENABLE_RAY_CLUSTER``, off on macOS
    and Windows so that a local Ray stays on the loopback), read each time Ray asks for this node's address."""
    from ray._private import ray_constants

    kept = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = kept


def bootstrap_address(address: str) -> str | None:
    """What ``ray.init(address=...)`` would connect to (host:port, the cluster ``auto`` finds, or None for a Ray of
    its own), with a loopback host kept as the loopback; Ray's ValueError or ConnectionError if none."""
    from ray._private import services

    with _loopback_kept():
        return services.canonicalize_bootstrap_address(address)


def init_ray(address: str, **kwargs) -> None:
    """``ray.init(address=address, **kwargs)``, on the loopback when the cluster is (``address`` names a loopback
    host) or when it starts a Ray of its own (``local``): that Ray's processes and this driver then listen on
    127.0.0.1 only, and a cluster on 127.0.0.1 is reached there."""
    import ray

    gcs = bootstrap_address(address)
    on_loopback = gcs is None or is_loopback(gcs.rpartition(":")[0])
    with _loopback_kept() if on_loopback else contextlib.nullcontext():
        ray.init(address=gcs or "local", **kwargs)


def connect(cfg) -> RayLauncherSettings:
    """Connect this process to the cluster of ``launcher_args`` (or start a local Ray); the settings."""
    import ray

    settings = ray_launcher_settings(cfg)
    if ray.is_initialized():
        return settings
    # empty: RAY_ADDRESS (ray job submit sets it), else a Ray of its own; never a cluster found lying around
    wanted = settings.address or os.environ.get("RAY_ADDRESS") or "local"
    value = f"bad value {settings.address or ''!r} for 'launcher_args.address'" + (
        "" if settings.address else f" (RAY_ADDRESS={wanted})" if wanted != "local" else "")
    try:
        # what ray.init would connect to: host:port, or (auto) the cluster `ray start` runs on this node
        gcs = bootstrap_address(wanted)
    except (ConnectionError, ValueError) as exc:
        raise ConfigError(f"{value}: no Ray cluster to connect to ({exc}). Start one (`ray start --head` on this "
                          f"node), give the head's host:port, or leave it empty for a Ray of its own on this "
                          f"machine") from None
    if gcs is not None:
        why = _reachable(gcs, settings.connect_timeout_s) or _gcs_answers(gcs, settings.connect_timeout_s)
        if why is not None:
            raise ConfigError(
                f"{value}: no Ray cluster at {gcs} within {settings.connect_timeout_s:g} s "
                f"(launcher_args.connect_timeout_s): {why}" + (
                    "" if why.startswith(_WANTS_TOKEN) else ". Is the cluster's head running (`ray status`)?"))
    try:
        if gcs is None:
            init_ray("local", namespace=settings.namespace, include_dashboard=False, log_to_driver=True)
        else:
            init_ray(gcs, namespace=settings.namespace, log_to_driver=True)
    except Exception as exc:  # ray raises ConnectionError, RuntimeError, ValueError ... by cause
        said = f"{type(exc).__name__}: {exc}"
        why = token_refused(said) if any(word in said for word in _TOKEN_REFUSED) else said
        raise ConfigError(f"{value}: could not connect to the Ray cluster at {gcs or 'a new local Ray'}: "
                          f"{why}") from None
    return settings


def open_cluster(cfg) -> RayLauncherSettings:
    """:func:`connect`, then :func:`check_request` of ``launcher_args.producer`` against the cluster's nodes."""
    import ray

    settings = connect(cfg)
    nodes = ray.nodes()
    check_request(settings.producer, "launcher_args.producer", nodes)
    for name, service in settings.rewards.items():
        check_request(service.request, f"launcher_args.rewards.{name}", nodes)
    return settings


def join_cluster(cfg, *, main_process: bool, finished: bool) -> None:
    """As a ``launcher=ray`` run opens: the trainer's first process connects, checks the requests and places
    the reward services (:func:`place_reward_services`); the others connect only when there are reward
    services, whose stand-ins score their share of the held-out evaluation. A finished run connects only for
    its services (its final evaluation)."""
    settings = ray_launcher_settings(cfg)
    if main_process:
        if not finished or settings.rewards:
            open_cluster(cfg)
            place_reward_services(cfg, settings)
        return
    if not settings.rewards:
        return  # only rank 0 talks to Ray: it hands the other ranks their experiences
    if not (settings.address or os.environ.get("RAY_ADDRESS")):
        raise ConfigError("bad value for 'launcher_args.address': every process of a multi-process trainer scores "
                          "its share of the held-out set through the reward services of launcher_args.rewards, so "
                          "they must all join one cluster; give its address (launcher_args.address=auto or "
                          "host:port, or RAY_ADDRESS) instead of a Ray of the first process's own")
    connect(cfg)


#: The reward services this process placed (actor name -> handle): holding the handles keeps the actors, which
#: Ray ends with this process; a run opened again in the same process replaces them.
_SERVICES: dict[str, object] = {}
#: Seconds a service's name may stay taken after its actor was ended (Ray frees it asynchronously).
NAME_RELEASE_S = 30.0


def place_reward_services(cfg, settings: RayLauncherSettings) -> None:
    """Start ``launcher_args.rewards``' actors, named for the run (:func:`~rltk.rewards.ray_service.service_name`),
    each placed by its request within ``launcher_args.placement_timeout_s`` (ConfigError naming the key)."""
    import ray
    from omegaconf import OmegaConf

    from rltk.rewards.ray_service import RewardService, service_name

    release_reward_services(report=False)
    reward = OmegaConf.to_container(cfg.reward, resolve=True)
    waiting_for = {}
    for name, service in settings.rewards.items():
        options = {**actor_options(service.request, max_restarts=settings.max_restarts),
                   "max_task_retries": settings.max_restarts, "namespace": settings.namespace}  # scoring is idempotent
        for replica in range(service.replicas):
            actor_name = service_name(cfg.name, name, replica)
            handle = _create_named(ray.remote(RewardService).options(name=actor_name, **options), actor_name,
                                   settings.namespace, reward=reward, name=name, work_dir=settings.work_dir,
                                   run_name=str(cfg.name), replica=replica)
            _SERVICES[actor_name] = handle
            waiting_for[handle.where.remote()] = (name, replica)
    if not waiting_for:
        return
    placed, waiting = ray.wait(list(waiting_for), num_returns=len(waiting_for), timeout=settings.placement_timeout_s)
    if waiting:
        release_reward_services(report=False)
        names = sorted({waiting_for[ref][0] for ref in waiting})
        raise ConfigError(f"bad value for 'launcher_args.rewards.{names[0]}': the Ray cluster placed {len(placed)} of "
                          f"{len(waiting_for)} reward service actors within {settings.placement_timeout_s:g} s "
                          f"(launcher_args.placement_timeout_s); not placed: {', '.join(names)}. Ask for less, fewer "
                          f"replicas, or add nodes")
    for ref in placed:
        name, replica = waiting_for[ref]
        try:
            where = ray.get(ref)
        except ray.exceptions.RayActorError as exc:  # its __init__ failed: a path missing on its node ...
            release_reward_services(report=False)
            raise ProcessWaitError(f"reward service '{name}' (launcher_args.rewards.{name}) could not start on its "
                                   f"node: {exc}") from None
        print(f"rltk: reward service '{name}' replica {replica} on node {where['node'][:8]} ({where['address']}, "
              f"pid {where['pid']}, folder {where['folder']})", flush=True)


def _create_named(actor_type, actor_name: str, namespace: str, **kwargs):
    """``actor_type.remote(**kwargs)`` under ``actor_name``, waiting up to :data:`NAME_RELEASE_S` for an ended
    actor's name to be freed; a name another live run holds is refused, naming the keys that tell runs apart."""
    import time

    deadline = time.monotonic() + NAME_RELEASE_S
    while True:
        try:
            return actor_type.remote(**kwargs)
        except ValueError as exc:  # the name is taken
            if time.monotonic() > deadline:
                raise ConfigError(f"bad value {kwargs['run_name']!r} for 'name': another run of that name holds the "
                                  f"reward service actor '{actor_name}' in the Ray namespace '{namespace}' ({exc}); "
                                  f"give this run another name, or another launcher_args.namespace") from None
            time.sleep(0.5)


def release_reward_services(*, report: bool = True) -> None:
    """End the reward services this process placed; with ``report``, first say how many samples each scored."""
    import ray

    for actor_name, handle in list(_SERVICES.items()):
        if report:
            try:
                scored = ray.get(handle.samples_scored.remote(), timeout=30)
                print(f"rltk: reward service {actor_name} scored {scored} samples", flush=True)
            except Exception as exc:  # a service already gone: nothing to report, ending it is all that is left
                print(f"rltk: reward service {actor_name} did not answer at the end ({type(exc).__name__})",
                      flush=True)
        ray.kill(handle, no_restart=True)
    _SERVICES.clear()


def _describe(node: dict) -> str:
    res = node.get("Resources", {})
    shown = ", ".join(f"{k} {v:g}" for k, v in sorted(res.items())
                      if not k.startswith("node:") and k not in ("memory", "object_store_memory"))
    labels = {k: v for k, v in (node.get("Labels") or {}).items() if not k.startswith("ray.io/")}
    return f"node {node['NodeID'][:8]} ({node.get('NodeManagerAddress', '?')}): {shown or 'nothing'}" + (
        f"; labels {labels}" if labels else "")


def check_request(request: ActorRequest, key: str, nodes: list[dict]) -> None:
    """Refuse ``request`` (the config's ``key``) when no alive node in ``nodes`` (``ray.nodes()``) has it all,
    naming the first part that no node has, and listing the nodes."""
    alive = [n for n in nodes if n.get("Alive")]
    parts = [(f"{key}.cpus", lambda res, labels: res.get("CPU", 0) >= request.cpus, f"{request.cpus:g} CPUs"),
             (f"{key}.gpus", lambda res, labels: res.get("GPU", 0) >= request.gpus, f"{request.gpus:g} GPUs")]
    parts += [(f"{key}.resources.{name}", lambda res, labels, name=name, amount=amount: res.get(name, 0) >= amount,
               f"{amount:g} of resource '{name}'") for name, amount in request.resources.items()]
    parts += [(f"{key}.labels.{name}", lambda res, labels, name=name, value=value: labels.get(name) == value,
               f"label {name}={value}") for name, value in request.labels.items()]

    def meets(node, checks) -> bool:
        return all(check(node.get("Resources", {}), node.get("Labels") or {}) for _, check, _ in checks)

    if any(meets(node, parts) for node in alive):
        return
    listing = "; ".join(_describe(n) for n in alive) or "none alive"
    for part_key, check, what in parts:
        if not any(meets(node, [(part_key, check, what)]) for node in alive):
            raise ConfigError(f"bad value for '{part_key}': no node of the Ray cluster has {what}. The nodes: "
                              f"{listing}")
    raise ConfigError(f"bad value for '{key}': no node of the Ray cluster has all of "
                      f"{', '.join(what for _, _, what in parts)} at once. The nodes: {listing}")


def actor_options(request: ActorRequest, *, max_restarts: int) -> dict:
    """Ray ``.options(...)`` of an actor with ``request``, restarted up to ``max_restarts`` times."""
    options = {"num_cpus": request.cpus, "num_gpus": request.gpus, "max_restarts": max_restarts,
               "max_task_retries": 0}  # a producer's run is restarted by the trainer, which counts it
    if request.resources:
        options["resources"] = dict(request.resources)
    if request.labels:
        options["label_selector"] = dict(request.labels)
    return options


def pinned_here() -> dict:
    """Ray ``.options(...)`` that place an actor on this process's node, and nowhere else."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False), "num_cpus": 0}
