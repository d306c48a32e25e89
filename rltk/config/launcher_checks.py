"""``launcher`` and ``launcher_args``: where an asynchronous stage's producers run, read and checked.

``launcher=local`` (the default) starts producer processes beside the trainer, which share its run folder.
``launcher=ray`` places them as Ray actors on the nodes of a Ray cluster
(:mod:`rltk.training.rollouts.asynchronous.ray_source`); :func:`ray_launcher_settings` reads ``launcher_args`` into
:class:`RayLauncherSettings`, checking every value without touching Ray, so a typo exits 2 before anything
starts. Whether the cluster is reachable and can meet the requests is checked when the run connects
(:mod:`rltk.training.scaffold.ray_cluster`), still before a model is built.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from rltk.errors import ConfigError
from rltk.registry import did_you_mean

#: ``launcher_args`` keys and what each holds, for messages.
RAY_KEYS = {
    "address": "the cluster: auto (the one `ray start` runs on this node, or RAY_ADDRESS), host:port of its "
               "head, or empty to start a Ray of its own on this machine",
    "namespace": "the Ray namespace of the run's actors",
    "connect_timeout_s": "seconds to reach the cluster",
    "placement_timeout_s": "seconds an actor may wait for a node that meets its request",
    "max_restarts": "how many times a producer actor whose process or node died is started again",
    "work_dir": "the folder on each producer's node where it works (default: $RLTK_RAY_WORK_DIR set on that "
                "node, else <tmp>/rltk-ray)",
    "producer": "each producer actor's request: {cpus, gpus, resources: {name: amount}, labels: {key: value}}",
    "rewards": "reward functions of reward.reward_fn run as reward services, Ray actors of their own: {name: {cpus, "
               "gpus, resources, labels, replicas, timeout_s}}",
}
PRODUCER_KEYS = ("cpus", "gpus", "resources", "labels")
#: a reward service's keys: where its actors go (as a producer's), how many, how long a call may take
REWARD_SERVICE_KEYS = (*PRODUCER_KEYS, "replicas", "timeout_s")


@dataclass(frozen=True)
class ActorRequest:
    """What one actor asks of the node it is placed on (``launcher_args.producer``)."""

    cpus: float = 1.0
    gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # custom resources a node declares (ray start)
    labels: dict[str, str] = field(default_factory=dict)  # node labels (ray start --labels)


@dataclass(frozen=True)
class RayLauncherSettings:
    """``launcher_args`` of ``launcher=ray``, checked; see :data:`RAY_KEYS` for each field."""

    address: str | None = None
    namespace: str = "rltk"
    connect_timeout_s: float = 30.0
    placement_timeout_s: float = 120.0
    max_restarts: int = 1
    work_dir: str | None = None
    producer: ActorRequest = field(default_factory=ActorRequest)
    rewards: dict[str, "RewardServiceRequest"] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardServiceRequest:
    """``launcher_args.rewards.<name>``: one reward function run by ``replicas`` Ray actors, each placed by
    ``request``; a step's call to them waits at most ``timeout_s`` (then its samples get ``reward.fallback``)."""

    request: ActorRequest = field(default_factory=ActorRequest)
    replicas: int = 1
    timeout_s: float = 300.0


def _number(key: str, value, *, minimum: float = 0.0, strict: bool = False) -> float:
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value > minimum if strict else value >= minimum))
    if not ok:
        raise ConfigError(f"bad value {value!r} for '{key}': must be a number {'>' if strict else '>='} {minimum:g}")
    return float(value)


def _mapping(key: str, value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"bad value {value!r} for '{key}': must be a mapping {{name: value}}")
    return value


def _request(value, key: str = "launcher_args.producer", keys: tuple[str, ...] = PRODUCER_KEYS) -> ActorRequest:
    value = _mapping(key, value)
    for name in value:
        if name not in keys:
            raise ConfigError(f"unknown key '{key}.{name}'.{did_you_mean(name, list(keys))} Valid: {', '.join(keys)}")
    resources = {}
    for name, amount in _mapping(f"{key}.resources", value.get("resources")).items():
        if name in ("CPU", "GPU"):
            raise ConfigError(f"bad key '{key}.resources.{name}': ask for {name.lower()}s with {key}.{name.lower()}s")
        resources[str(name)] = _number(f"{key}.resources.{name}", amount, strict=True)
    labels = {}
    for name, label in _mapping(f"{key}.labels", value.get("labels")).items():
        if not isinstance(label, str) or not label:
            raise ConfigError(f"bad value {label!r} for '{key}.labels.{name}': must be a non-empty string (the value "
                              f"`ray start --labels` gave the node)")
        labels[str(name)] = label
    return ActorRequest(cpus=_number(f"{key}.cpus", value.get("cpus", 1)),
                        gpus=_number(f"{key}.gpus", value.get("gpus", 0)), resources=resources, labels=labels)


def _reward_services(value, reward_fns: list[str]) -> dict[str, RewardServiceRequest]:
    """``launcher_args.rewards``: each entry names a function of ``reward.reward_fn``."""
    services = {}
    for name, entry in _mapping("launcher_args.rewards", value).items():
        key = f"launcher_args.rewards.{name}"
        if name not in reward_fns:
            raise ConfigError(f"unknown key '{key}': '{name}' is not one of the run's rewards "
                              f"(reward.reward_fn: {', '.join(reward_fns)}).{did_you_mean(name, reward_fns)}")
        entry = _mapping(key, entry)
        replicas = entry.get("replicas", 1)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ConfigError(f"bad value {replicas!r} for '{key}.replicas': must be an integer >= 1 (how many Ray "
                              f"actors serve '{name}'; a step's samples are split among them)")
        services[name] = RewardServiceRequest(
            request=_request({k: v for k, v in entry.items() if k in PRODUCER_KEYS or k not in REWARD_SERVICE_KEYS},
                             key, REWARD_SERVICE_KEYS),
            replicas=replicas, timeout_s=_number(f"{key}.timeout_s", entry.get("timeout_s", 300.0), strict=True))
    return services


def ray_launcher_settings(cfg: DictConfig) -> RayLauncherSettings:
    """``cfg.launcher_args`` read and checked (ConfigError naming the key); nothing is connected."""
    args = OmegaConf.to_container(cfg.launcher_args, resolve=True) if cfg.get("launcher_args") else {}
    for key in args:
        if key not in RAY_KEYS:
            raise ConfigError(f"unknown key 'launcher_args.{key}'.{did_you_mean(key, list(RAY_KEYS))} Valid: "
                              + "; ".join(f"{k} ({what})" for k, what in RAY_KEYS.items()))
    address = args.get("address") or None
    if address is not None and not isinstance(address, str):
        raise ConfigError(f"bad value {address!r} for 'launcher_args.address': {RAY_KEYS['address']}")
    if address and address.startswith("ray://"):
        # the trainer's node keeps the durable queue (a front actor pinned beside it writes it): a Ray Client
        # driver is no node of the cluster, so nothing could be pinned to the machine that holds the run folder
        raise ConfigError(
            f"bad value {address!r} for 'launcher_args.address': Ray Client (ray://) is not supported, since the "
            f"trainer keeps the experience queue in its own run folder and its node must be a node of the "
            f"cluster. Run the trainer on a cluster node (`ray job submit -- rltk run ...`, or on the head) with "
            f"launcher_args.address=auto or the head's host:port")
    namespace = args.get("namespace", "rltk")
    if not isinstance(namespace, str) or not namespace:
        raise ConfigError(f"bad value {namespace!r} for 'launcher_args.namespace': must be a non-empty string")
    restarts = args.get("max_restarts", 1)
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise ConfigError(f"bad value {restarts!r} for 'launcher_args.max_restarts': must be an integer >= 0 "
                          f"({RAY_KEYS['max_restarts']})")
    work_dir = args.get("work_dir")
    if work_dir is not None and (not isinstance(work_dir, str) or not work_dir):
        raise ConfigError(f"bad value {work_dir!r} for 'launcher_args.work_dir': {RAY_KEYS['work_dir']}")
    return RayLauncherSettings(
        address=address, namespace=namespace,
        connect_timeout_s=_number("launcher_args.connect_timeout_s", args.get("connect_timeout_s", 30.0),
                                  strict=True),
        placement_timeout_s=_number("launcher_args.placement_timeout_s", args.get("placement_timeout_s", 120.0),
                                    strict=True),
        max_restarts=restarts, work_dir=work_dir, producer=_request(args.get("producer")),
        rewards=_reward_services(args.get("rewards"), [str(name) for name in cfg.reward.reward_fn]))


def _stage_modes(cfg: DictConfig) -> set[str]:
    """``trainer.mode`` of the run and of every stage that overrides it."""
    modes = {cfg.trainer.mode}
    for stage in OmegaConf.to_container(cfg, resolve=False).get("stages") or []:
        overrides = stage.get("overrides") or {}  # a dotted key, or a nested trainer: {mode: ...}
        mode = overrides.get("trainer.mode", (overrides.get("trainer") or {}).get("mode"))
        if mode is not None:
            modes.add(mode)
    return modes


def check_launcher(cfg: DictConfig) -> None:
    """``launcher`` and ``launcher_args`` (``launcher`` itself is a plain choice, checked before)."""
    if cfg.get("launcher", "local") != "ray":
        if cfg.get("launcher_args"):
            raise ConfigError(f"'launcher_args' is set ({list(cfg.launcher_args)}) but launcher={cfg.launcher}: the "
                              f"arguments apply to launcher=ray; set it, or remove launcher_args")
        return
    if importlib.util.find_spec("ray") is None:
        raise ConfigError("bad value 'ray' for 'launcher': Ray is not installed here; install it with "
                          "`pip install 'rltk[ray]'` (every node of the cluster needs rltk and ray), or use "
                          "launcher=local")
    settings = ray_launcher_settings(cfg)
    if not _stage_modes(cfg) - {"sync"} and not settings.rewards:
        raise ConfigError("bad value 'ray' for 'launcher': Ray places the rollout producers of an asynchronous "
                          "stage and the reward services of launcher_args.rewards, and here every stage runs "
                          "trainer.mode=sync with no reward service; set trainer.mode=one_step_off or async, place a "
                          "reward on Ray (launcher_args.rewards), or use launcher=local")
    producers = cfg.trainer.get("producers", 1)
    if producers == 0 and _stage_modes(cfg) - {"sync"}:
        raise ConfigError("bad value 0 for 'trainer.producers' with launcher=ray: Ray starts the producers, so at "
                          "least one (each a Ray actor placed by launcher_args.producer)")
