"""The trainer's side of the ``rltk_broadcast`` weight transfer to vLLM servers (``weight_sync: broadcast``).

The servers' workers and the trainer form one process group of the weights' own
(:mod:`rltk.rollout.weight_broadcast`: a ``TCPStore`` the trainer hosts on ``broadcast_address``, gloo on CPU,
NCCL on CUDA); vLLM's worker receives through rltk's ``rltk_broadcast`` backend
(:mod:`rltk.rollout.vllm_weight_sync`). Nothing is written to a file and no folder is shared: a server on
another machine needs only to reach the trainer's address.

One update, as vLLM's own NCCL backend drives it: ``/start_weight_update`` on every server, then
``/update_weights`` with the layout (names, dtypes, shapes) on every server *while* the trainer broadcasts the
buckets (the call returns once the worker has received and loaded them), then ``/finish_weight_update`` with
the version, ``/reset_prefix_cache``, and ``/weight_info`` read back (``engine.check_version``).

**Deltas** (``delta: true``): the trainer keeps a CPU copy of the version the servers hold and sends, per
tensor, only the elements whose bits changed (or the tensor dense above ``delta_density``); the workers keep a
copy too and rebuild the full tensors exactly. A full update goes instead on the first update after the group
formed, every ``delta_full_every``-th update, and whenever a server reports a version other than the one the
delta is against.

**Faults.** A group that does not form within ``broadcast_timeout_s`` is an error naming the servers whose
workers never joined. A transfer that fails (a server dies mid-broadcast, a worker errs) is an error naming
the server and what the trainer waited for; before raising, every server still answering is paused and left
paused, and the engine refuses to generate after it: no server samples from half-loaded weights. Each update
labels the servers ``loading-N`` until it finishes, so a torn server is also visible from outside
(``/weight_info``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from rltk.errors import ConfigError
from rltk.rollout import weight_broadcast as wire

if TYPE_CHECKING:
    from rltk.rollout.server_pool import Server, ServerPoolEngine

#: The label a server carries while an update is being loaded into it.
LOADING = "loading-"


def check_settings(*, bucket_bytes: Any, backend: Any, address: Any, timeout_s: Any, delta: Any,
                   delta_density: Any, delta_full_every: Any, verify: Any = False) -> None:
    """Refuse bad ``rollout.engine_args`` of the broadcast backend, naming the key and what is valid."""
    key = "rollout.engine_args."
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1 << 10:
        raise ConfigError(f"{key}bucket_bytes must be an integer >= 1024 (bytes per broadcast), got {bucket_bytes!r}")
    if backend not in ("auto", *wire.BACKENDS):
        raise ConfigError(f"{key}broadcast_backend must be one of auto, gloo, nccl; got {backend!r}")
    if not isinstance(address, str) or not address:
        raise ConfigError(f"{key}broadcast_address must be the trainer's address the servers reach "
                          f"(e.g. 127.0.0.1), got {address!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ConfigError(f"{key}broadcast_timeout_s must be a positive number of seconds, got {timeout_s!r}")
    for name, value in (("delta", delta), ("verify_weights", verify)):
        if not isinstance(value, bool):
            raise ConfigError(f"{key}{name} must be true or false, got {value!r}")
    if isinstance(delta_density, bool) or not isinstance(delta_density, (int, float)) or not 0 <= delta_density <= 1:
        raise ConfigError(f"{key}delta_density must be a fraction in [0, 1] (above it a tensor goes dense), "
                          f"got {delta_density!r}")
    if isinstance(delta_full_every, bool) or not isinstance(delta_full_every, int) or delta_full_every < 1:
        raise ConfigError(f"{key}delta_full_every must be an integer >= 1 (a full update every that many), "
                          f"got {delta_full_every!r}")


class BroadcastSync:
    """One weight group between the trainer and a pool's servers, and the delta state over it."""

    def __init__(self, *, bucket_bytes: int, backend: str, address: str, timeout_s: float, delta: bool,
                 delta_density: float, delta_full_every: int, verify: bool = False):
        import torch

        self.backend = backend if backend != "auto" else (wire.NCCL if torch.cuda.is_available() else wire.GLOO)
        self.bucket_bytes = bucket_bytes
        self.address = address
        self.timeout_s = float(timeout_s)
        self.delta = delta
        self.delta_density = float(delta_density)
        self.delta_full_every = delta_full_every
        self.verify = verify
        self.group = None
        self.ranks: dict[str, int] = {}  # server url -> its first worker's rank
        self._base: dict | None = None  # delta mode: the tensors of the version the servers hold (CPU)
        self._base_version: int | None = None
        self._since_full = 0
        #: What the last update moved: {"version", "full", "bytes", "seconds", "density"}.
        self.last: dict = {}

    # ------------------------------------------------------------------ the group

    def form(self, engine: ServerPoolEngine, servers: list[Server]) -> None:
        """Rank 0 hosts the store; every server's workers join through ``/init_weight_transfer_engine``."""
        worlds = [int(engine.get(s, "/get_world_size").get("world_size", 1)) for s in servers]
        world_size = 1 + sum(worlds)
        rendezvous = wire.store(self.address, 0, world_size, is_master=True, timeout_s=self.timeout_s)
        self._store = rendezvous
        offset = 1
        calls = []
        for server, workers in zip(servers, worlds):
            self.ranks[server.url] = offset
            init = {"address": self.address, "port": rendezvous.port, "rank_offset": offset,
                    "world_size": world_size, "backend": self.backend, "timeout_s": self.timeout_s,
                    "bucket_bytes": self.bucket_bytes, "keep_copy": self.delta}
            calls.append((server, engine._pool.submit(
                engine.post, server, "/init_weight_transfer_engine", {"init_info": init},
                hint="start it with --weight-transfer-config '{\"backend\": \"rltk_broadcast\"}' (rltk installed "
                     "next to vLLM) and let it reach rollout.engine_args.broadcast_address",
                timeout=self.timeout_s + engine.timeout_s)))
            offset += workers
        try:
            self.group = wire.join(rendezvous, self.backend, 0, world_size, self.timeout_s, address=self.address)
        except wire.GroupError as exc:
            raise engine.server_error(f"{exc}; {self._who(servers, worlds, exc.missing)} (rollout.engine_args."
                                      f"broadcast_timeout_s)") from None
        for server, call in calls:
            call.result()  # its error names the server
        self._base, self._base_version, self._since_full = None, None, 0  # a joined server: full first

    def _who(self, servers: list[Server], worlds: list[int], missing: list[int]) -> str:
        """The servers whose workers' ranks never joined."""
        absent = [f"vLLM server {server.url} (ranks {self.ranks[server.url]}..{self.ranks[server.url] + workers - 1})"
                  f"{server.where_to_look()}" for server, workers in zip(servers, worlds)
                  if any(self.ranks[server.url] <= rank < self.ranks[server.url] + workers for rank in missing)]
        return "waited for the workers of " + (", ".join(absent) if absent else "every server to join")

    # ------------------------------------------------------------------ an update

    def plan(self, engine: ServerPoolEngine, state: dict) -> tuple[list[dict], dict, int | None]:
        """The pieces of this update, their payloads, and the version a delta is against (None: full)."""
        full = (not self.delta or self._base is None or self._since_full + 1 >= self.delta_full_every
                or set(self._base) != set(state)
                or any(engine.get(s, "/weight_info").get("weight_version") != str(self._base_version)
                       for s in engine._servers))
        pieces, payloads = [], {}
        for name, tensor in state.items():
            if full:
                entry, payload = wire.piece(name, tensor), (tensor.detach().contiguous(),)
            else:
                encoded = wire.encode_delta(name, tensor, self._base[name], self.delta_density)
                if encoded is None:
                    continue
                entry, payload = encoded
            pieces.append(entry)
            payloads[name] = payload
        return pieces, payloads, None if full else self._base_version

    def send(self, engine: ServerPoolEngine, state: dict, version: int) -> None:
        """Every server loads ``state`` as ``version`` (a full update or a delta), or the error names one."""
        if engine.weights_torn:
            raise engine.server_error(engine.weights_torn)
        start = time.perf_counter()
        servers = list(engine._servers)
        device = wire.device_of(self.backend)
        sent = 0
        try:
            pieces, payloads, base_version = self.plan(engine, state)
            update = {"pieces": pieces, "version": version, "base_version": base_version,
                      "digests": {name: wire.digest(t) for name, t in state.items()} if self.verify else {}}
            for server in servers:
                engine.post(server, "/update_weight_version", {"new_version": f"{LOADING}{version}"})
                engine.post(server, "/start_weight_update")
            calls = [(s, engine._pool.submit(engine.post, s, "/update_weights", {"update_info": update},
                                             timeout=self.timeout_s + engine.timeout_s)) for s in servers]
            try:
                sent = wire.send(self.group, pieces, payloads, self.bucket_bytes, device, self.timeout_s)
            except Exception as exc:  # a peer gone: the servers' own answers say which, where they can
                self._fail(engine, servers, calls, version, f"the broadcast of its buckets failed "
                                                             f"({type(exc).__name__}: {str(exc).splitlines()[0]})")
            for server, call in calls:
                try:
                    call.result()
                except Exception as exc:
                    self._fail(engine, servers, calls, version, str(exc), culprit=server)
            for server in servers:
                engine.post(server, "/finish_weight_update", {"weight_version": str(version)})
                engine.post(server, "/reset_prefix_cache")  # cached keys and values belong to the old weights
                engine.check_version(server, version)
        except Exception as exc:
            if engine.weights_torn:  # _fail's own error, naming the server
                raise
            message = f"weight update to version {version} failed: {exc}"
            self._tear(engine, servers, message)
            raise engine.server_error(message) from None
        self._remember(state, version, base_version is None)
        changed = sum(entry.get("nnz", _numel(entry)) for entry in pieces)  # a dense piece counts whole
        density = changed / max(1, sum(tensor.numel() for tensor in state.values()))
        self.last = {"version": version, "full": base_version is None, "bytes": sent,
                     "seconds": time.perf_counter() - start, "density": density}

    def _remember(self, state: dict, version: int, full: bool) -> None:
        if not self.delta:
            return
        if self._base is None or set(self._base) != set(state):
            self._base = {name: tensor.detach().to("cpu", copy=True) for name, tensor in state.items()}
        else:
            for name, tensor in state.items():
                self._base[name].copy_(tensor.detach())
        self._base_version = version
        self._since_full = 0 if full else self._since_full + 1

    def _fail(self, engine, servers, calls, version: int, what: str, culprit: Server | None = None) -> None:
        """Raise the transfer's error, naming the server that failed (the first whose own call failed, or whose
        process exited) and what the trainer waited for."""
        if culprit is None:
            for server, call in calls:
                if server.process is not None and server.process.poll() is not None:
                    culprit = server
                    break
                if call.done() and call.exception() is not None:
                    culprit = server
                    break
        who = (f"vLLM server {culprit.url} (rank {self.ranks.get(culprit.url)}){culprit.where_to_look()}"
               if culprit is not None else "a server of " + ", ".join(s.url for s in servers))
        message = (f"weight broadcast of version {version} failed: {who}; the trainer waited for its worker to "
                   f"receive and load the update within {self.timeout_s:g} s (rollout.engine_args."
                   f"broadcast_timeout_s): {what}")
        self._tear(engine, servers, message)
        raise engine.server_error(message)

    def _tear(self, engine, servers, message: str) -> None:
        """Pause every server that still answers and keep it paused: its weights may be half loaded."""
        engine.weights_torn = (f"{message}. The servers were paused and stay paused: their weights may be half "
                     f"loaded; start the run again (a new engine sends a full update)")
        self._base = None
        for server in servers:
            try:
                engine.post(server, "/pause?mode=abort", timeout=10.0)
            except Exception:  # a dead server samples nothing either; the error already names it
                pass

    def close(self, engine: ServerPoolEngine) -> None:
        for server in list(engine._servers):
            try:
                engine.post(server, "/shutdown_weight_transfer_engine", timeout=5.0)
            except Exception:  # closing: a server already gone has no group left to leave
                pass
        self.group = None


def _numel(entry: dict) -> int:
    import math

    return math.prod(entry["shape"])
