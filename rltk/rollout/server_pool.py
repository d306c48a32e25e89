"""The base of every rollout engine that samples on inference servers over HTTP (``vllm_server``, a plugin's).

What a server engine has to do apart from speaking its server's protocol is the same for every server, and
lives here once, in :class:`ServerPoolEngine`:

* **A pool.** Servers rltk starts on this machine (``launch: N``) and servers it is given
  (``servers: [url, ...]``), each with at most ``max_in_flight`` requests outstanding; requests go to them
  round-robin from a thread pool.
* **Launch and tether.** A launched server runs the command the engine gives (:meth:`ServerPoolEngine.launch_command`)
  in a session of its own under :mod:`rltk.rollout.tether`, in the launching process's working folder and
  environment, its output in a log in the engine's folder; the engine waits for its health route within
  ``start_timeout_s``. ``close()`` stops the group (SIGTERM, then SIGKILL); if the launching process dies
  without it, the tether stops the server.
* **Timeouts naming the server.** Every HTTP call has ``timeout_s``; a server that hangs, refuses or dies is
  a :class:`ServerError` naming its address (and, for a launched one, its exit code and log). After such an
  error ``close()`` keeps the launched servers' logs and warns where.
* **Abort and continue.** A sample a weight update interrupted comes back with finish reason ``"abort"``
  and the tokens sampled so far; it is sent again as prompt + those tokens for what is left (AReaL's
  interruptible rollout), so every token's log-prob is that of the weights that sampled it.
* **Version spans.** Each answer's tokens carry the weight version that sampled them
  (:class:`~rltk.rollout.base.Completion` ``versions``, when ``track_versions`` is set by an asynchronous
  producer), read from the server's own labels where it gives them.
* **Weight files.** ``update_weights`` writes the trainer's full weights (a LoRA policy's adapters merged) to
  one safetensors file under ``weight_dir`` that every server loads; ``load_weights_file`` has them load a file
  already written (an asynchronous run's policy file, tied tensors stored once, named as aliases), with no copy.
  With ``interrupt`` the servers are paused first and resumed after, so generation in flight stops at once.

A server engine subclasses :class:`ServerPoolEngine` and writes its protocol: how to start one server
(:meth:`~ServerPoolEngine.prepare_launch`, :meth:`~ServerPoolEngine.launch_command`), what to tell a server it
connects to (:meth:`~ServerPoolEngine.connect`), one request per sample group and its answer
(:meth:`~ServerPoolEngine.request_bodies`, :meth:`~ServerPoolEngine.send`, :meth:`~ServerPoolEngine.continuation`),
and how a server loads a weights file (:meth:`~ServerPoolEngine.load_on`, and :meth:`~ServerPoolEngine.pause` /
:meth:`~ServerPoolEngine.resume` where it can interrupt generation). The engine class declares the capabilities
the trainer reads (:class:`~rltk.rollout.base.RolloutEngine`): it runs in a producer, loads weight files and
owns its servers. torch is imported only where weights are handled, so validating a config that names a
server engine costs nothing of it.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, Sequence

from rltk.errors import ConfigError
from rltk.rollout import tether
from rltk.rollout.base import (
    Completion, ModelAndTokenizer, RolloutEngine, SamplingParams, cut_at_stop, validate_prompt_ids,
)

#: How often one sample may be aborted by weight updates and continued before it is an error.
MAX_CONTINUATIONS = 64
#: The finish reason of a sample a weight update interrupted (what :meth:`ServerPoolEngine.send` reports).
ABORTED = "abort"

#: One sampled continuation as a server answered it: token ids, their log-probs, the weight version of each
#: token, and the finish reason (``"stop"``, ``"length"``, or :data:`ABORTED`).
Sample = tuple[list[int], list[float], list[int], str | None]


class ServerError(RuntimeError):
    """An inference server did not answer as it should; the message names it."""


class Server:
    """One server: its address, a bound on in-flight requests, and the process when rltk started it."""

    def __init__(self, url: str, max_in_flight: int, process: subprocess.Popen | None = None,
                 log_path: str | None = None):
        self.url = url.rstrip("/")
        self.slots = threading.BoundedSemaphore(max_in_flight)
        self.process = process
        self.log_path = log_path
        self.in_flight = 0
        self.peak_in_flight = 0
        self.requests = 0
        self._lock = threading.Lock()

    def where_to_look(self) -> str:
        if self.process is not None and self.process.poll() is not None:
            return f"; its process exited with code {self.process.returncode} (log: {self.log_path})"
        return f"; its log: {self.log_path}" if self.log_path else ""


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerPoolEngine(ModelAndTokenizer, RolloutEngine):
    """Rollouts from a pool of inference servers over HTTP; subclasses speak one server's protocol.

    Args:
        model: the trainer's model (possibly wrapped); launched servers start from its config and weights.
        tokenizer: decodes completion text and supplies the eos id.
        servers: addresses of running servers (``http://host:port``).
        launch: how many local servers rltk starts (default 1 when ``servers`` is empty).
        max_in_flight: most requests outstanding on one server.
        timeout_s: limit on every HTTP call (generation included).
        start_timeout_s: how long a launched server may take to answer its health route.
        weight_dir: where weight files are written for the servers to read (default ``/dev/shm`` where it
            exists, else the engine's temporary folder).

    A subclass takes these keyword arguments in its own signature (``rollout.engine_args`` is checked
    against it) with its own, stores its own before calling ``super().__init__``, and overrides the
    protocol methods below.
    """

    runs_in_producer = True  # built in the producer from the config; its servers load the trainer's files
    loads_weight_files = True  # each server reads the trainer's weights file itself
    owns_servers = True
    #: How messages name one server of this engine ("vLLM server http://...").
    server_kind: ClassVar[str] = "inference server"
    #: The route a server answers 200 on once it is ready.
    health_path: ClassVar[str] = "/health"
    #: The prefix of the engine's temporary folder (launched servers' model copy and logs).
    folder_prefix: ClassVar[str] = "rltk-server-"
    #: The class of the errors naming a server (a subclass keeps its own name for its users).
    error_class: ClassVar[type[ServerError]] = ServerError

    def __init__(self, model: Any, tokenizer: Any, *, servers: Sequence[str] | None = None, launch: int | None = None,
                 max_in_flight: int = 64, timeout_s: float = 120.0, start_timeout_s: float = 600.0,
                 weight_dir: str | None = None):
        import httpx

        servers = list(servers or [])
        if launch is None:
            launch = 0 if servers else 1
        if not isinstance(launch, int) or launch < 0 or (launch == 0 and not servers):
            raise ConfigError(f"rollout.engine_args.launch must be an integer >= 0, and >= 1 without "
                              f"rollout.engine_args.servers; got launch={launch!r}, servers={servers!r}")
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ConfigError(f"rollout.engine_args.max_in_flight must be an integer >= 1, got {max_in_flight!r}")
        for key, value in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"rollout.engine_args.{key} must be a positive number of seconds, got {value!r}")
        for url in servers:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ConfigError(f"rollout.engine_args.servers: {url!r} is not an http(s):// address")
        self.model = model
        self.tokenizer = tokenizer
        self.timeout_s = float(timeout_s)
        self.weight_version = 0
        self.track_versions = False  # set by an asynchronous run's producer (RolloutEngine.track_versions)
        self.continued = 0  # samples continued after a weight update aborted them
        self._stats_lock = threading.Lock()
        self._weights_lock = threading.Lock()  # one weight update at a time
        self._failed = False  # an error named a server: close() keeps the launched servers' logs
        self.weights_torn: str | None = None  # why the servers' weights cannot be sampled from (deliver)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        # a folder only where something goes in it: a process killed without close() (a Ray producer's end) leaves
        # it behind, and the launched servers' tethers remove theirs
        needs_folder = launch or (weight_dir is None and shm is None)
        self._tmp = tempfile.mkdtemp(prefix=self.folder_prefix) if needs_folder else ""
        self.weight_dir = weight_dir if weight_dir is not None else (shm or self._tmp)
        self._servers: list[Server] = []
        self._client = httpx.Client(timeout=self.timeout_s, limits=httpx.Limits(max_connections=None))
        self._pool = ThreadPoolExecutor(max_workers=max(4, min(256, max_in_flight * (len(servers) + launch))))
        self._next = itertools.count()
        try:
            if launch:
                self._launch(launch, max_in_flight, float(start_timeout_s))
            self._servers += [Server(url, max_in_flight) for url in servers]
            for server in self._servers:
                self.connect(server)
            self.connected()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ the protocol (subclasses)

    def prepare_launch(self, folder: str) -> dict[str, str]:
        """Write what launched servers start from (the model's copy) into ``folder``, and return their
        environment; called once, before the first :meth:`launch_command`."""
        raise NotImplementedError(f"{type(self).__name__} cannot launch servers: give rollout.engine_args.servers")

    def launch_command(self, index: int, port: int) -> list[str]:
        """The command line of launched server ``index``, listening on ``127.0.0.1:port``."""
        raise NotImplementedError(f"{type(self).__name__} cannot launch servers: give rollout.engine_args.servers")

    def connect(self, server: Server) -> None:
        """Called once per server before the first request (launched ones once healthy); a no-op by default."""

    def connected(self) -> None:
        """Called once after :meth:`connect` has run on every server (a group they all join); a no-op by default."""

    def request_bodies(self, index: int, prompt_ids: list[int], params: SamplingParams,
                       stop_ids: list[int]) -> list[dict]:
        """The request bodies that sample ``params.n`` completions of prompt ``index`` (one request or several;
        a seeded call's seed per sample can derive from ``index``), stopping at ``stop_ids``."""
        raise NotImplementedError

    def send(self, server: Server, body: dict, submitted: int) -> list[Sample]:
        """Send one request to ``server`` (through :meth:`post`) and return its samples in order; ``submitted``
        is the engine's weight version when it was sent (the version of tokens the server does not label)."""
        raise NotImplementedError

    def continuation(self, body: dict, tokens: list[int]) -> dict | None:
        """The request that continues ``body``'s sample after an abort that left ``tokens``; None when nothing
        is left to sample. Only engines whose :meth:`pause` aborts requests need it."""
        return None

    def load_on(self, server: Server, path: str, version: int, aliases: dict[str, str]) -> None:
        """Have ``server`` load the safetensors file ``path`` as weights ``version`` (``aliases``: ``{name the
        model needs: name in the file}`` for tied tensors stored once), and check that it did."""
        raise NotImplementedError

    def pause(self, server: Server) -> None:
        """Stop ``server``'s generation in flight before a weight load (``interrupt``): its requests answer at
        once with :data:`ABORTED`. A no-op by default: a server that cannot pause finishes them first."""

    def resume(self, server: Server) -> None:
        """Undo :meth:`pause` after the load; a no-op by default."""

    def server_weights(self, state_dict_or_model: Any) -> dict:
        """The full tensors the servers load, from the trainer's module or state dict: a LoRA policy's adapters
        merged, a tied head under its own name too (what every server that builds the plain architecture needs)."""
        from rltk.models.wrappers import unwrap_model
        from rltk.rollout.vllm_engine import engine_weights, with_tied_head

        return with_tied_head(engine_weights(state_dict_or_model, self.model),
                              unwrap_model(self.model, through_peft=False).config)

    # ------------------------------------------------------------------ servers

    def _launch(self, count: int, max_in_flight: int, start_timeout_s: float) -> None:
        env = self.prepare_launch(self._tmp)
        for index in range(count):
            port = free_port()
            log_path = os.path.join(self._tmp, f"server{index}.log")
            command = self.launch_command(index, port)
            with open(log_path, "wb") as log:
                # a session of its own, led by a tether that stops it when this process ends, even by SIGKILL
                process = subprocess.Popen(tether.command(command, remove=self._tmp), stdout=log,
                                           stderr=subprocess.STDOUT, env=env, start_new_session=True)
            self._servers.append(Server(f"http://127.0.0.1:{port}", max_in_flight, process, log_path))
        deadline = time.monotonic() + start_timeout_s
        for server in self._servers:
            self._wait_healthy(server, deadline, start_timeout_s)

    def _wait_healthy(self, server: Server, deadline: float, start_timeout_s: float) -> None:
        import httpx

        while True:
            if server.process.poll() is not None:
                raise self.server_error(f"{self.server_kind} {server.url} exited with code "
                                        f"{server.process.returncode} while starting; its log: {server.log_path}")
            try:
                if self._client.get(server.url + self.health_path, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise self.server_error(f"{self.server_kind} {server.url} did not answer {self.health_path} within "
                                        f"{start_timeout_s:.0f} s (rollout.engine_args.start_timeout_s); its log: "
                                        f"{server.log_path}")
            time.sleep(1.0)

    def post(self, server: Server, path: str, body: dict | None = None, *, hint: str = "",
             timeout: float | None = None) -> dict:
        """POST ``body`` to ``server``'s ``path`` within ``timeout`` (default ``timeout_s``); its JSON answer, or a
        :class:`ServerError` naming the server (``hint``: what to do about an error answer)."""
        return self._call(server, "post", path, body, hint, timeout)

    def get(self, server: Server, path: str, *, hint: str = "") -> dict:
        """GET ``server``'s ``path`` within ``timeout_s``; its JSON answer, or a :class:`ServerError` naming it."""
        return self._call(server, "get", path, None, hint, None)

    def _call(self, server: Server, method: str, path: str, body: dict | None, hint: str,
              timeout: float | None) -> dict:
        import httpx

        limit = self.timeout_s if timeout is None else timeout
        try:
            if method == "get":
                response = self._client.get(server.url + path, timeout=limit)
            else:
                response = self._client.post(server.url + path, json=body, timeout=limit)
        except httpx.TimeoutException:
            raise self.server_error(f"{self.server_kind} {server.url} did not answer {path} within "
                                    f"{limit:.0f} s (rollout.engine_args.timeout_s)"
                                    f"{server.where_to_look()}") from None
        except httpx.HTTPError as exc:
            raise self.server_error(f"{self.server_kind} {server.url} failed on {path}: {type(exc).__name__}: "
                                    f"{exc}{server.where_to_look()}") from None
        if response.status_code != 200:
            raise self.server_error(f"{self.server_kind} {server.url} answered {path} with HTTP "
                                    f"{response.status_code}: {response.text[:300]}{'; ' + hint if hint else ''}"
                                    f"{server.where_to_look()}")
        return response.json()

    def server_error(self, message: str) -> ServerError:
        """The error to raise about a server (of the engine's own :class:`ServerError` subclass, if any);
        ``close()`` then keeps the launched servers' logs."""
        self._failed = True
        return self.error_class(message)

    @property
    def servers(self) -> list[str]:
        return [server.url for server in self._servers]

    def server_stats(self) -> list[dict[str, int]]:
        """Per server: requests sent and the most that were in flight at once."""
        return [{"requests": s.requests, "peak_in_flight": s.peak_in_flight} for s in self._servers]

    # ------------------------------------------------------------------ generate

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """Sample ``params.n`` completions per prompt, spread over the servers.

        A request a weight update aborts (:meth:`load_weights_file` or :meth:`update_weights` with
        ``interrupt=True``) comes back with the tokens sampled so far; it is continued from the prompt plus
        those tokens under the new weights (see :meth:`_sample`).
        """
        prompt_ids = validate_prompt_ids(prompt_ids)
        if self.weights_torn:
            raise self.server_error(self.weights_torn)
        stop_ids = self._stop_token_ids(params)
        jobs = []
        for index, ids in enumerate(prompt_ids):
            for body in self.request_bodies(index, ids, params, stop_ids):
                jobs.append((index, self._pool.submit(self._sample, body)))
        grouped: list[list[Completion]] = [[] for _ in prompt_ids]
        for index, future in jobs:
            for tokens, logprobs, versions in future.result():
                tokens, logprobs, reason = cut_at_stop(tokens, logprobs, stop_ids, params.max_new_tokens)
                versions = versions[: len(tokens)] if self.track_versions else None
                grouped[index].append(Completion(index, tokens, logprobs, reason, self._decode(tokens), versions))
        return grouped

    def _sample(self, body: dict) -> list[tuple[list[int], list[float], list[int]]]:
        """One request's samples as ``(token ids, log-probs, per-token weight versions)``.

        A sample that ends :data:`ABORTED` (a weight update paused the server) is sent again as prompt + its
        tokens, for the tokens still missing, until it ends otherwise (AReaL's interruptible rollout): the
        resubmitted prefix is computed afresh under the new weights. The aborted samples of one request are
        continued side by side, as the server sampled them: one after another, the ``n`` samples of a
        request would take ``n`` times as long after each update (16 samples of 1800 tokens went from ~10 s
        to minutes on a 2-core machine). The versions are the server's own labels where it gives them, so a
        request that waited in a paused server's queue is labelled with the weights that really sampled it.
        """
        samples = self._send_next(body)
        if sum(reason == ABORTED for *_, reason in samples) < 2:
            return [self._continue(body, *sample) for sample in samples]
        # a pool of its own: continuations queued behind this request's own worker in self._pool could wait on it
        with ThreadPoolExecutor(max_workers=len(samples)) as pool:
            return list(pool.map(lambda sample: self._continue(body, *sample), samples))

    def _continue(self, body: dict, tokens: list[int], logprobs: list[float], versions: list[int],
                  reason: str | None) -> tuple[list[int], list[float], list[int]]:
        """One sample of ``body``'s answer, sent again after each abort until it ends otherwise."""
        for _ in range(MAX_CONTINUATIONS):
            retry = self.continuation(body, tokens) if reason == ABORTED else None
            if retry is None:
                return tokens, logprobs, versions
            with self._stats_lock:
                self.continued += 1
            [(more_tokens, more_logprobs, more_versions, reason)] = self._send_next(retry)
            tokens, logprobs, versions = tokens + more_tokens, logprobs + more_logprobs, versions + more_versions
        raise self.server_error(f"a request was aborted {MAX_CONTINUATIONS} times in a row (weight updates "
                                f"faster than generation, or something else aborting requests on "
                                f"{', '.join(self.servers)})")

    def _send_next(self, body: dict) -> list[Sample]:
        """``body`` sent to the next server round-robin, within its ``max_in_flight``."""
        server = self._servers[next(self._next) % len(self._servers)]
        submitted = self.weight_version
        with server.slots:
            with server._lock:
                server.in_flight += 1
                server.requests += 1
                server.peak_in_flight = max(server.peak_in_flight, server.in_flight)
            try:
                return self.send(server, body, submitted)
            finally:
                with server._lock:
                    server.in_flight -= 1

    # ------------------------------------------------------------------ weights

    def update_weights(self, state_dict_or_model: Any, *, version: int | None = None,
                       interrupt: bool = False) -> None:
        """Write the trainer's full weights to one file and have every server load it as ``version``
        (default: the current version + 1). ``interrupt``: see :meth:`load_weights_file`."""
        from safetensors.torch import save_file

        version = self.weight_version + 1 if version is None else int(version)
        state = savable(self.server_weights(state_dict_or_model))
        path = os.path.join(self.weight_dir, f"rltk-weights-{os.getpid()}-{id(self)}-v{version}.safetensors")
        save_file(state, path, metadata={"format": "pt"})
        try:
            self._load_everywhere(path, version, {}, interrupt)
        finally:
            os.unlink(path)

    def load_weights_file(self, path: str, version: int, *, interrupt: bool = False) -> bool:
        """Have every server load the safetensors file ``path`` itself as weights ``version``: no copy.

        For a file with the model's own parameter names (an asynchronous run's policy file,
        :func:`rltk.training.rollouts.engine_weights.write_weights_file`), tied tensors stored once included
        (loaded under both names). Returns False, loading nothing, when the names are not the model's (a
        LoRA policy's adapters): then read the file into the module and call :meth:`update_weights`. The
        file must not change while it loads (hard-link a file that is renamed over, and pass the link).

        ``interrupt``: :meth:`pause` every server first and :meth:`resume` after the load, so generation in
        flight stops at once and :meth:`generate` continues it under the new weights; without it, requests
        in flight finish on whichever weights each step finds.
        """
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            names = set(f.keys())
        aliases = self._aliases(names)
        if aliases is None:
            return False
        self._load_everywhere(path, int(version), aliases, interrupt)
        return True

    def _aliases(self, names: set[str]) -> dict[str, str] | None:
        """``{missing name: stored name}`` that completes ``names`` to the engine's weights, or None."""
        wanted = savable_names(self.server_weights(self.model))
        if not names <= set(wanted):
            return None
        aliases = {}
        for name in wanted:
            if name not in names:
                source = next((other for other in wanted[name] if other in names), None)
                if source is None:
                    return None
                aliases[name] = source
        return aliases

    def _load_everywhere(self, path: str, version: int, aliases: dict[str, str], interrupt: bool) -> None:
        def load_each() -> None:
            futures = [self._pool.submit(self.load_on, server, path, version, aliases) for server in self._servers]
            for future in futures:
                future.result()

        self.deliver(load_each, version, interrupt)

    def deliver(self, load: Any, version: int, interrupt: bool) -> None:
        """Run ``load()`` (every server takes weights ``version``), one update at a time, with the servers paused
        around it when ``interrupt``; afterwards the engine's version is ``version``. A load that leaves the
        servers' weights torn sets :attr:`weights_torn` (the message): then they stay paused and
        :meth:`generate` refuses."""
        with self._weights_lock:
            paused = []
            try:
                if interrupt:
                    for future in [self._pool.submit(self.pause, server) for server in self._servers]:
                        future.result()
                    paused = list(self._servers)
                load()
                self.weight_version = version
            finally:
                for server in paused if not self.weights_torn else ():
                    # even after a failed load: the servers' queued requests must not hang
                    try:
                        self.resume(server)
                    except ServerError:
                        # the load's own error (if any) is the one to raise; a server that cannot resume
                        # fails its next request, which names it
                        pass

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop the servers rltk started (SIGTERM, then SIGKILL after 30 s) and remove their files: all of
        them after a clean run; all but the servers' logs once an error named a server, so that the log its
        message points to is still there to read."""
        for server in getattr(self, "_servers", []):
            process = server.process
            if process is not None and process.poll() is None:
                signal_group(process, signal.SIGTERM)  # the server and whatever it started
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    signal_group(process, signal.SIGKILL)
                    process.wait()
        self._servers = []
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        client = getattr(self, "_client", None)
        if client is not None:
            client.close()
        tmp = getattr(self, "_tmp", "")
        logs = sorted(Path(tmp).glob("server*.log")) if tmp and getattr(self, "_failed", False) else []
        if not logs:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
            return
        for path in Path(tmp).iterdir():  # the weight files go (they can be large), the logs stay
            if path in logs:
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        warnings.warn(f"the {self.server_kind}s rltk started failed; their logs are kept: "
                      f"{', '.join(map(str, logs))}", RuntimeWarning, stacklevel=2)
        self._tmp = ""  # the folder is the reader's now

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def signal_group(process: subprocess.Popen, sig: int) -> None:
    """Signal a launched server's process group: its tether (the leader, started with ``start_new_session``),
    the server and whatever it started."""
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def savable_names(state: dict) -> dict[str, list[str]]:
    """Each name of ``state``, with the other names whose tensor is the same storage (tied weights)."""
    by_storage: dict[tuple, list[str]] = {}
    for name, tensor in state.items():
        by_storage.setdefault((tensor.untyped_storage().data_ptr(), tensor.storage_offset()), []).append(name)
    return {name: [other for other in group if other != name] for group in by_storage.values() for name in group}


def savable(state: dict) -> dict:
    """CPU, contiguous tensors for ``save_file``, with a copy for each that shares storage with an earlier one.

    Tied weights are written twice on purpose: vLLM's layerwise reload leaves a
    tied ``lm_head`` broken unless its own name arrives too (measured on 0.32).
    """
    seen, out = set(), {}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu().contiguous()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        out[name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    return out
