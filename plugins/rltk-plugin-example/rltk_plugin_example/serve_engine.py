"""Rollout engine ``rltk_serve``: rltk's own OpenAI-compatible endpoint (``rltk serve``) as inference servers.

A server engine in one short file: the pool, launch and tether, health, round-robin with ``max_in_flight``,
timeouts naming the server, version labels, weight files and close are
:class:`rltk.rollout.server_pool.ServerPoolEngine`'s; this file is the endpoint's protocol:

* launch: the policy saved as a Hugging Face folder, served by ``rltk serve FOLDER --accept-weights``
  (whole completions per engine call, ``--slice-tokens 0``);
* a request: ``POST /v1/completions`` with the prompt's token ids, ``return_token_ids`` (each choice's exact
  ids and the weight version of each token) and ``stop_token_ids`` (the trainer's own end tokens);
* weights: ``POST /rltk/weights`` with the file's path and version; the endpoint loads it between two
  engine calls, so a batch in flight finishes on the weights it started with and later tokens carry the
  new label. The endpoint cannot abort generation, so the engine does not override ``pause``.

``rollout.engine=rltk_serve`` runs ``trainer.mode=async`` like ``vllm_server``: the engine class declares it
(``runs_in_producer``, ``loads_weight_files``, ``owns_servers``, inherited from the base).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence

import rltk
from rltk.rollout.base import SamplingParams
from rltk.rollout.server_pool import Sample, Server, ServerPoolEngine, savable


class RltkServeEngine(ServerPoolEngine):
    """Rollouts from ``rltk serve`` endpoints (registered as ``rltk_serve``).

    Args:
        servers, launch, max_in_flight, timeout_s, start_timeout_s, weight_dir: the server pool's
            (:class:`~rltk.rollout.server_pool.ServerPoolEngine`); a given server must run with
            ``--accept-weights`` on a machine that sees ``weight_dir``.
        max_tokens: launched endpoints' budget of new tokens per request (``rltk serve --max-tokens``).
        serve_args: extra command-line arguments for launched endpoints.
    """

    server_kind = "rltk serve endpoint"
    folder_prefix = "rltk-serve-engine-"

    def __init__(self, model: Any, tokenizer: Any, *, servers: Sequence[str] | None = None,
                 launch: int | None = None, max_in_flight: int = 64, timeout_s: float = 120.0,
                 start_timeout_s: float = 600.0, weight_dir: str | None = None, max_tokens: int = 256,
                 serve_args: Sequence[str] = ()):
        self._serve_args = ["--max-tokens", str(max_tokens), *serve_args]
        self._model_ids: dict[str, str] = {}
        super().__init__(model, tokenizer, servers=servers, launch=launch, max_in_flight=max_in_flight,
                         timeout_s=timeout_s, start_timeout_s=start_timeout_s, weight_dir=weight_dir)

    def prepare_launch(self, folder: str) -> dict[str, str]:
        """The policy as a model folder ``rltk serve`` loads: config, weights and tokenizer."""
        from safetensors.torch import save_file

        from rltk.models.wrappers import unwrap_model

        self._model_dir = os.path.join(folder, "model")
        os.makedirs(self._model_dir)
        unwrap_model(self.model, through_peft=False).config.save_pretrained(self._model_dir)
        save_file(savable(self.server_weights(self.model)), os.path.join(self._model_dir, "model.safetensors"),
                  metadata={"format": "pt"})
        self.tokenizer.save_pretrained(self._model_dir)
        return dict(os.environ)

    def launch_command(self, index: int, port: int) -> list[str]:
        return [sys.executable, "-m", "rltk.commands.cli", "serve", self._model_dir, "--host", "127.0.0.1",
                "--port", str(port), "--device", "cpu", "--accept-weights", "--slice-tokens", "0",
                *self._serve_args]

    def connect(self, server: Server) -> None:
        # refused unless the endpoint takes weights: said now, not at the first update
        self.get(server, "/rltk/weights", hint="start rltk serve with --accept-weights")
        self._model_ids[server.url] = self.get(server, "/v1/models")["data"][0]["id"]

    def request_bodies(self, index: int, prompt_ids: list[int], params: SamplingParams,
                       stop_ids: list[int]) -> list[dict]:
        body = {"prompt": prompt_ids, "max_tokens": params.max_new_tokens, "logprobs": 0, "return_token_ids": True,
                "stop_token_ids": stop_ids, "temperature": 0 if params.greedy else params.temperature,
                "top_p": params.top_p, "top_k": params.top_k}
        if params.seed is None:
            return [{**body, "n": params.n}]
        # a seed per sample, as vllm_server does: reproducible whichever endpoint takes it
        return [{**body, "n": 1, "seed": params.seed + index * params.n + j} for j in range(params.n)]

    def send(self, server: Server, body: dict, submitted: int) -> list[Sample]:
        answer = self.post(server, "/v1/completions", {**body, "model": self._model_ids[server.url]})
        samples = []
        for choice in sorted(answer["choices"], key=lambda c: c["index"]):
            tokens = list(choice["token_ids"])
            versions = list(choice.get("token_versions") or [submitted] * len(tokens))
            samples.append((tokens, [float(lp) for lp in choice["logprobs"]["token_logprobs"]], versions,
                            choice["finish_reason"]))
        return samples

    def load_on(self, server: Server, path: str, version: int, aliases: dict[str, str]) -> None:
        answered = self.post(server, "/rltk/weights", {"path": path, "version": version, "aliases": aliases},
                             hint=f"the endpoint must run with --accept-weights and see {path} "
                                  f"(rollout.engine_args.weight_dir)")["weight_version"]
        if answered != version:
            raise self.server_error(f"{self.server_kind} {server.url} reports weight version {answered!r} after "
                                    f"loading version {version}{server.where_to_look()}")


@rltk.hookimpl
def rltk_rollout_engines():
    return {"rltk_serve": RltkServeEngine}
