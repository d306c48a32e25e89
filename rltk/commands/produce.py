"""``rltk produce RUN_DIR``: a rollout producer for an asynchronous run, started by your own launcher.

The trainer (``rltk run grpo trainer.mode=async ...``, one process or many under
torchrun / accelerate / deepspeed) starts ``trainer.producers`` local producers
itself; set it to 0 and start the producers yourself, on any machine that
shares the run folder (NFS, Lustre, a Kubernetes ReadWriteMany volume)::

    rltk produce /shared/runs/exp1 --name "producer-$SLURM_PROCID"
    rltk produce /shared/runs/exp1 --name producer-0 rollout.engine=vllm_server \\
        'rollout.engine_args.servers=[http://gpu-node-3:8000]'

The trainer's rank 0 writes ``RUN_DIR/async/stage_<i>/producer.json`` when an
asynchronous stage starts: where that stage's resolved config, SQLite
experience queue (``buffer.queue_path`` if set) and versioned weights file
are. The producer waits for it (a producer may start before the trainer, or
while a supervised warm-up stage runs), builds the stage's model and workflow
from that config (``key=value`` overrides after the folder change what this
producer uses, e.g. its inference servers), and then runs exactly as a local
producer (:mod:`rltk.training.rollouts.asynchronous.producer`): the newest published weights, the
staleness gate, batches put into the queue, each experience id
``<name>-b<batch>-<index>``. It exits 0 when the trainer records the stage's
end in the queue.

``--name`` must be unique among the stage's producers and stable across a
restart of the same producer: a restarted producer goes on after its last put
batch, so nothing is put twice. Two live producers with one name are refused
(a lock file per name beside the queue). The trainer's own producers are named
``producer-<k>``. ``--index K --count N`` gives this producer the rows
``K, K + N, ...`` only (give each of N producers its own K); by default every
producer samples from all rows, in an order and with a seed of its own (from
its name).

Waits end: for the stage to start after ``--timeout`` seconds, for the
trainer (weights, room in the staleness bound) after the stage's
``buffer.queue_timeout_s`` (or ``--timeout`` if given), with an error naming
what was waited for (exit 3).

This is the rendezvous AReaL's name_resolve does through a shared file system;
rltk writes no cluster manager: Slurm, Kubernetes or a shell loop starts the
processes (docs/tutorials/async.md, "Several machines").
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
import zlib
from pathlib import Path

from rltk.errors import ConfigError

#: Exit status of a wait for the run's asynchronous stage that ran out.
EXIT_TIMEOUT = 3
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_ABSENT = object()


class ProduceTimeout(Exception):
    """``rltk produce`` waited ``--timeout`` seconds for the trainer to start an asynchronous stage."""


def add_parser(sub) -> None:
    p = sub.add_parser("produce", help="a rollout producer for an asynchronous run (trainer.producers=0, or more "
                                       "beside the local ones), started by your own launcher on any machine "
                                       "sharing the run folder")
    p.add_argument("run_dir", help="the run's output_dir, as this machine sees it (a shared file system)")
    p.add_argument("overrides", nargs="*", help="key=value changes to the stage's config for this producer "
                                                "(e.g. rollout.engine_args.servers=[...])")
    p.add_argument("--name", default=None,
                   help="this producer's name, unique among the run's producers and stable across its restarts "
                        "(default: the host name)")
    p.add_argument("--stage", type=int, default=None,
                   help="the stage index to produce for (default: the newest asynchronous stage not yet ended)")
    p.add_argument("--index", type=int, default=None, help="this producer's share of the rows: K of --count")
    p.add_argument("--count", type=int, default=None, help="how many producers split the rows by --index")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds to wait for the stage to start (default 600) and, if given, for the trainer "
                        "during the stage (default: the stage's buffer.queue_timeout_s)")


def _check_name(name: str, rendezvous: dict) -> None:
    if not NAME.match(name):
        raise ConfigError(f"bad value {name!r} for --name: letters, digits, '.', '_' and '-' only, starting with a "
                          f"letter or digit (it prefixes the experience ids)")
    local = int(rendezvous.get("local_producers", 0))
    m = re.fullmatch(r"producer-(\d+)", name)
    if m and int(m.group(1)) < local:
        raise ConfigError(f"bad value {name!r} for --name: the trainer runs its own producers producer-0.."
                          f"producer-{local - 1} (trainer.producers={local}); choose another name")


def _run_mode(run_dir: Path) -> str | None:
    """``trainer.mode`` of the run's saved ``config.yaml``; None before the trainer has written it."""
    from omegaconf import OmegaConf

    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return None
    cfg = OmegaConf.load(saved)
    # a stage may switch the mode in its own overrides (e.g. sync warm-up, then async RL)
    for stage in OmegaConf.select(cfg, "stages", default=None) or []:
        if "mode" in str(OmegaConf.select(stage, "overrides", default="")):
            return None
    return OmegaConf.select(cfg, "trainer.mode", default="sync")


def _finished(rendezvous: dict) -> bool:
    from rltk.training.rollouts.asynchronous.queue import ExperienceQueue

    if not Path(rendezvous["queue"]).is_file():
        return False
    with ExperienceQueue(rendezvous["queue"], journal_mode=rendezvous.get("journal_mode", "wal")) as queue:
        return queue.finished_step is not None


def find_stage(run_dir: Path, stage: int | None, timeout_s: float, poll_s: float = 0.5) -> dict:
    """The rendezvous (:data:`rltk.training.rollouts.asynchronous.async_rollout.RENDEZVOUS`) of the stage to
    produce for.

    Waits up to ``timeout_s`` for the trainer to start it. Refuses (``ConfigError``) a run whose
    saved config trains synchronously: its trainer never reads a queue.
    """
    from rltk.training.rollouts.asynchronous.async_rollout import RENDEZVOUS, stage_folder

    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"rltk produce: '{run_dir}' is a file; pass the run's output_dir")
    start = time.monotonic()
    while True:
        mode = _run_mode(run_dir)
        if mode == "sync":
            raise ConfigError(
                f"rltk produce: the run in {run_dir} trains with trainer.mode=sync (its config.yaml): it reads no "
                f"experience queue; run it with trainer.mode=async or one_step_off to feed it from producers")
        if stage is not None:
            candidates = [stage_folder(run_dir, stage) / RENDEZVOUS]
        else:
            found = [(int(p.parent.name.split("_")[-1]), p) for p in run_dir.glob(f"async/stage_*/{RENDEZVOUS}")
                     if p.parent.name.split("_")[-1].isdigit()]
            candidates = [p for _, p in sorted(found, reverse=True)]
        for path in candidates:
            if path.is_file():
                rendezvous = json.loads(path.read_text(encoding="utf-8"))
                if stage is not None or not _finished(rendezvous):
                    return rendezvous
        if (run_dir / "summary.json").is_file():
            raise ConfigError(f"rltk produce: the run in {run_dir} has finished (summary.json): no asynchronous "
                              f"stage is left to produce for; pass the output_dir of a run that is to train")
        waited = time.monotonic() - start
        if waited > timeout_s:
            where = (str(stage_folder(run_dir, stage) / RENDEZVOUS) if stage is not None
                     else f"{run_dir}/async/stage_<i>/{RENDEZVOUS} of a stage not yet ended")
            raise ProduceTimeout(
                f"rltk produce: waited {timeout_s:g} s (--timeout) for the trainer of {run_dir} to start an "
                f"asynchronous stage (rank 0 writes {where}); is the trainer running with output_dir={run_dir} "
                f"and trainer.mode=async or one_step_off, and does this machine see the same folder?")
        time.sleep(poll_s)


def _apply_overrides(cfg, overrides: list[str]):
    from omegaconf import OmegaConf

    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"rltk produce: '{item}' is not a key=value override")
        key = item.split("=", 1)[0]
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        # a component's arguments (rollout.engine_args, ...) take any name the component accepts
        free = parent.endswith("_args") and OmegaConf.select(cfg, parent, default=None) is not None
        if not free and OmegaConf.select(cfg, key, default=_ABSENT) is _ABSENT:
            raise ConfigError(f"rltk produce: unknown config key '{key}' in override '{item}' (the stage's config "
                              f"has no such key)")
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides)) if overrides else cfg


def _claim(folder: Path, name: str):
    """Hold ``folder/producers/<name>.lock`` for this process's life; a second live holder is refused."""
    import fcntl

    locks = folder / "producers"
    locks.mkdir(parents=True, exist_ok=True)
    handle = open(locks / f"{name}.lock", "a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(f"bad value {name!r} for --name: a producer with that name is running for this stage "
                          f"({holder}, lock {locks / (name + '.lock')}); give each producer its own --name") from None
    handle.truncate(0)
    handle.write(f"host {socket.gethostname()} pid {os.getpid()}\n")
    handle.flush()
    return handle


def cmd_produce(args) -> int:
    from omegaconf import OmegaConf

    from rltk.training.rollouts.asynchronous.producer import run_producer

    run_dir = Path(args.run_dir).expanduser()
    name = args.name or socket.gethostname()
    _check_name(name, {})
    if (args.index is None) != (args.count is None):
        raise ConfigError("rltk produce: --index and --count go together (this producer's K of N row shares)")
    index, count = (0, 1) if args.index is None else (args.index, args.count)
    if count < 1 or not 0 <= index < count:
        raise ConfigError(f"bad value --index {index} --count {count}: need --count >= 1 and 0 <= --index < --count")
    if args.timeout is not None and not args.timeout > 0:
        raise ConfigError(f"bad value {args.timeout!r} for --timeout: a number of seconds > 0")
    try:
        rendezvous = find_stage(run_dir, args.stage, 600.0 if args.timeout is None else args.timeout)
    except ProduceTimeout as exc:
        print(f"rltk: error: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT
    _check_name(name, rendezvous)
    lock = _claim(Path(rendezvous["weights"]).parent, name)
    try:
        cfg = _apply_overrides(OmegaConf.load(rendezvous["config"]), list(args.overrides))
        timeout_s = float(rendezvous["timeout_s"] if args.timeout is None else args.timeout)
        print(f"rltk produce: {name} for stage {rendezvous['stage']} of {run_dir} (queue {rendezvous['queue']})",
              flush=True)
        try:
            return run_producer(cfg, stage_index=int(rendezvous["stage"]), queue_path=rendezvous["queue"],
                                weights_path=rendezvous["weights"], name=name, timeout_s=timeout_s, index=index,
                                count=count, trainer=False, seed_salt=zlib.crc32(name.encode()) % 1_000_000)
        except SystemExit as exc:  # the producer's own exits: done (0), a wait that ran out (3)
            return int(exc.code or 0)
    finally:
        lock.close()
