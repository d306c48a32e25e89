"""The ``/api/v1`` routes, grouped as the SDK uses them: service and sessions, training clients,
samplers, futures. Each parses its body with the SDK's type, checks it (400s name the field), and
either answers at once or queues the work and answers with a future."""

from __future__ import annotations

import math

from fastapi import Request  # a module global: FastAPI resolves the routes' string annotations here
from fastapi.responses import JSONResponse, Response
from tinker import types

from rltk.serve.errors import APIError
from rltk.serve.limits import json_body, read_body
from rltk.tinker_service.state import (
    RETRIEVE_WAIT_S, ServiceState, on_worker, retrieve_payload, served_model, submit,
)
from rltk.tinker_service.validation import bad, check_forward_backward, check_tokens, parse


def _client_config(state: ServiceState) -> dict:
    """The SDK's feature flags as this service wants them (see ``tinker.types.ClientConfigResponse``)."""
    return {
        "pjwt_auth_enabled": False,  # plain API keys (X-API-Key), no JWT exchange
        "use_pyqwest_transport": False,
        "proto_compress_fwdbwd": False,
        "parallel_fwdbwd_chunks": True,
        "fwdbwd_max_chunk_len": state.limits.max_datums,
        "fwdbwd_max_chunk_bytes_count": state.limits.max_body_bytes // 2,
        "sample_use_retrieve_futures": False,
        "custom_loss_server_side": False,  # forward_backward_custom runs its loss in the client
        "sample_join_sampling_session": False,
    }


def add_service_routes(app, state: ServiceState) -> None:
    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config(request: Request):
        return _client_config(state)

    @app.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config(request: Request):
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request):
        await read_body(request, state.limits)  # read and dropped: nothing is reported anywhere
        return {"status": "accepted"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities(request: Request):
        return {"supported_models": [{"model_name": state.model_name, "max_context_length": state.workspace.context,
                                      "trainable": True, "sampleable": True}]}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        parse(types.CreateSessionRequest, await json_body(request, state.limits))
        with state.lock:
            session = state.registry.new_session(state.owner(request))
        return {"type": "create_session", "session_id": session.id}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        body = parse(types.SessionHeartbeatRequest, await json_body(request, state.limits))
        with state.lock:
            state.registry.session(body.session_id, state.owner(request))
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        with state.lock:
            state.registry.session(session_id, state.owner(request))
        state.release(session_id)
        return {}

    @app.get("/rltk/status")
    async def status(request: Request):
        """What the caller's key holds, and the adapters loaded for everyone (rltk's own route)."""
        owner = state.owner(request)
        with state.lock:
            registry = state.registry
            mine = {"sessions": sum(s.owner == owner for s in registry.sessions.values()),
                    "training_clients": sum(m.owner == owner for m in registry.models.values()),
                    "samplers": sum(s.owner == owner for s in registry.samplers.values()),
                    "queued": state.futures.queued(owner)}
        adapters = await on_worker(state, lambda: len(state.workspace.peft_model.peft_config)
                                   if state.workspace.peft_model is not None else 0)
        return {**mine, "adapters_loaded": adapters}

    @app.post("/api/v1/cancel_future")
    async def cancel_future(request: Request):
        body = await json_body(request, state.limits)
        entry = state.futures.get(str(body.get("request_id")), state.owner(request))
        if entry is not None:
            entry.future.cancel()
        return {}


def add_training_routes(app, state: ServiceState) -> None:
    ws = state.workspace

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        body = parse(types.CreateModelRequest, await json_body(request, state.limits))
        served_model(state, "base_model", body.base_model)
        lora = body.lora_config
        if lora is None:
            raise bad("lora_config", "this service trains LoRA adapters only; give lora_config with a rank")
        if not 1 <= lora.rank <= state.limits.max_lora_rank:
            raise bad("lora_config.rank", f"must be in [1, {state.limits.max_lora_rank}] (--max-lora-rank), "
                                          f"got {lora.rank}")
        if not (lora.train_attn or lora.train_mlp):
            raise bad("lora_config", "train_attn and train_mlp are both false: nothing would be trained")
        if body.optimizer_config.type != "adamw":
            raise bad("optimizer_config.type", f"only 'adamw' is supported, got {body.optimizer_config.type!r}")
        with state.lock:
            session = state.registry.session(body.session_id, state.owner(request))
            try:
                model = state.registry.new_model(session, body.model_seq_id, lora.rank, body.base_model)
            except ValueError as exc:
                raise bad("model_seq_id", str(exc).split(": ", 1)[1]) from None
            except PermissionError as exc:
                raise APIError(429, str(exc), code="too_many_models") from None

        def work():
            ws.create(model.id, lora.rank, seed=lora.seed, train_attn=lora.train_attn, train_mlp=lora.train_mlp)
            return {"model_id": model.id, "type": "create_model"}

        return submit(state, session.owner, session.id, work, model_id=model.id)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        body = parse(types.GetInfoRequest, await json_body(request, state.limits))
        model = state.registry.model(body.model_id, state.owner(request))
        arch = getattr(getattr(ws.base, "config", None), "model_type", None)
        return {"type": "get_info", "model_id": model.id, "is_lora": True, "lora_rank": model.rank,
                "model_name": state.model_name,
                "model_data": {"arch": arch, "model_name": state.model_name, "tokenizer_id": state.tokenizer.name}}

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        return await _forward_backward(state, request)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        body = parse(types.OptimStepRequest, await json_body(request, state.limits))
        model = state.registry.model(body.model_id, state.owner(request))
        params = body.optim_params
        if not isinstance(params, types.AdamParams):
            raise bad("optimizer_params", "only Adam (adam_params) is supported")
        checks = {"learning_rate": params.learning_rate >= 0, "beta1": 0 <= params.beta1 < 1,
                  "beta2": 0 <= params.beta2 < 1, "eps": params.eps > 0, "weight_decay": params.weight_decay >= 0,
                  "grad_clip_norm": params.grad_clip_norm >= 0}
        for name, ok in checks.items():
            value = getattr(params, name)
            if not ok or not math.isfinite(value):
                raise bad(f"adam_params.{name}", f"{value!r} is out of range")

        def work():
            metrics = ws.optim_step(model.id, params.learning_rate, params.beta1, params.beta2, params.eps,
                                    params.weight_decay, params.grad_clip_norm)
            return {"metrics": metrics}

        return submit(state, model.owner, model.session, work, model_id=model.id)

    add_checkpoint_routes(app, state)


async def _forward_backward(state: ServiceState, request) -> dict:
    from rltk.tinker_service.losses import LossError, plan_loss
    from rltk.tinker_service.wire import (
        WireError, decode_forward_backward, encode_forward_backward_output, unsupported_chunk,
    )

    raw = await read_body(request, state.limits)
    try:
        fwd = decode_forward_backward(raw, request.headers.get("content-encoding"))
    except WireError as exc:
        raise APIError(400, str(exc), param=exc.field) from None
    model = state.registry.model(fwd.model_id, state.owner(request))
    for index, datum in enumerate(fwd.data):
        if datum.images and state.workspace.processor is None:
            raise bad(datum.images[0].field, unsupported_chunk("image"))
        datum.tokens, datum.vision = _with_images(state, datum.tokens, datum.images)
    try:
        plan = plan_loss(fwd.loss_fn, fwd.loss_fn_config)
    except LossError as exc:
        raise APIError(400, str(exc), param=str(exc).split(":")[0]) from None
    ws = state.workspace
    check_forward_backward(fwd.data, plan.needs, vocab_size=ws.vocab_size, context=ws.context, limits=state.limits)

    def work():
        outputs, metrics = ws.forward_backward(model.id, plan, fwd.data, forward_only=fwd.forward_only)
        return encode_forward_backward_output(outputs, metrics)

    return submit(state, model.owner, model.session, work, proto=True, model_id=model.id)


def add_checkpoint_routes(app, state: ServiceState) -> None:
    """``save_state`` / ``load_state`` (``weights``) and ``save_weights_for_sampler``."""
    ws, registry = state.workspace, state.registry

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        body = parse(types.SaveWeightsRequest, await json_body(request, state.limits))
        model = registry.model(body.model_id, state.owner(request))
        path, folder = _checkpoint(registry, model, "weights", body.path, body.overwrite)

        def work():
            ws.save(model.id, folder, optimizer=True)
            return {"path": path, "type": "save_weights"}

        return submit(state, model.owner, model.session, work, model_id=model.id)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        body = parse(types.LoadWeightsRequest, await json_body(request, state.limits))
        owner = state.owner(request)
        model_id, folder = _resolve(registry, body.path, owner, ("weights",))
        rank = _saved_rank(folder)
        if body.model_id is not None:
            model = registry.model(body.model_id, owner)
            if rank != model.rank:
                raise bad("path", f"the checkpoint's LoRA rank is {rank}, this training client's {model.rank}")
            create = False
        else:
            if body.session_id is None or body.model_seq_id is None:
                raise bad("model_id", "give model_id, or session_id with model_seq_id to create a training client")
            with state.lock:
                session = registry.session(body.session_id, owner)
                try:
                    model = registry.new_model(session, body.model_seq_id, rank, state.model_name)
                except ValueError as exc:
                    raise bad("model_seq_id", str(exc).split(": ", 1)[1]) from None
                except PermissionError as exc:
                    raise APIError(429, str(exc), code="too_many_models") from None
            create = True

        def work():
            if create:
                ws.create_from_folder(model.id, folder)
            ws.load(model.id, folder, optimizer=body.optimizer)
            return {"path": body.path, "model_id": model.id, "type": "load_weights"}

        return submit(state, model.owner, model.session, work, model_id=model.id)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request):
        body = parse(types.SaveWeightsForSamplerRequest, await json_body(request, state.limits))
        model = registry.model(body.model_id, state.owner(request))
        if body.path is not None:
            path, folder = _checkpoint(registry, model, "sampler_weights", body.path, True)

            def work():
                ws.save(model.id, folder, optimizer=False)
                return {"path": path, "type": "save_weights_for_sampler"}

            return submit(state, model.owner, model.session, work, model_id=model.id)
        with state.lock:
            sampler, evicted = registry.new_sampler(registry.sessions[model.session], None, state.model_name)

        def snapshot():
            for old in evicted:
                ws.drop_sampler(old)
            ws.add_sampler(sampler.id, model.id)
            return {"sampling_session_id": sampler.id, "type": "save_weights_for_sampler"}

        return submit(state, model.owner, model.session, snapshot, model_id=model.id)


def _checkpoint(registry, model, kind: str, name: str | None, overwrite: bool):
    import uuid

    try:
        path, folder = registry.checkpoint_path(model, kind, name or uuid.uuid4().hex[:12])
    except ValueError as exc:
        raise bad("path", str(exc).split(": ", 1)[1]) from None
    if folder.exists() and not overwrite:
        raise bad("path", f"{path} exists; save under another name or pass overwrite")
    return path, folder


def _resolve(registry, path: str, owner: str, kinds: tuple[str, ...]):
    try:
        return registry.resolve_checkpoint(path, owner, kinds)
    except ValueError as exc:
        raise bad("path", str(exc).split(": ", 1)[1]) from None


def _saved_rank(folder) -> int:
    from rltk.models.lora import adapter_config

    return int(adapter_config(folder)["r"])


def add_sampling_routes(app, state: ServiceState) -> None:
    ws, registry = state.workspace, state.registry

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        body = parse(types.CreateSamplingSessionRequest, await json_body(request, state.limits))
        owner = state.owner(request)
        folder = None
        if body.model_path is not None:
            _, folder = _resolve(registry, body.model_path, owner, ("sampler_weights", "weights"))
        else:
            served_model(state, "base_model", body.base_model)
        with state.lock:
            session = registry.session(body.session_id, owner)
            sampler, evicted = registry.new_sampler(session, body.model_path, state.model_name)

        def add():
            for old in evicted:
                ws.drop_sampler(old)
            if folder is None:
                ws.add_sampler(sampler.id, None)
            else:
                ws.add_sampler_from_folder(sampler.id, folder)

        await on_worker(state, add)
        return {"type": "create_sampling_session", "sampling_session_id": sampler.id}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request):
        sampler = registry.sampler(sampler_id, state.owner(request))
        return {"sampler_id": sampler.id, "base_model": sampler.base_model, "model_path": sampler.model_path}

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        return await _asample(state, request)


def _sampling_params(state: ServiceState, body, prompt_len: int):
    """rltk's SamplingParams and the stop strings for a SampleRequest, checked (400s name the field)."""
    from rltk.rollout.base import SamplingParams

    sp = body.sampling_params
    context = state.workspace.context
    room = (context - prompt_len) if context else None
    if room is not None and room < 1:
        raise bad("prompt", f"{prompt_len} tokens, over this model's limit of {context - 1} prompt tokens (its "
                            f"context of {context}, with room for at least one new token)")
    max_tokens = sp.max_tokens if sp.max_tokens is not None else min(room or 256, 256)
    if max_tokens < 1:
        raise bad("sampling_params.max_tokens", f"must be >= 1, got {max_tokens}")
    if room is not None and max_tokens > room:
        raise bad("sampling_params.max_tokens", f"{prompt_len} prompt tokens + {max_tokens} new tokens exceed the "
                                                f"model's context of {context}")
    if not 1 <= body.num_samples <= state.limits.max_samples:
        raise bad("num_samples", f"must be in [1, {state.limits.max_samples}], got {body.num_samples}")
    if body.num_samples * max_tokens > state.limits.max_sample_tokens:
        raise bad("sampling_params.max_tokens", f"num_samples x max_tokens = {body.num_samples * max_tokens}, over "
                                                f"this service's limit of {state.limits.max_sample_tokens}")
    stop = sp.stop
    stop_ids, stop_strings = None, []
    if isinstance(stop, str):
        stop_strings = [stop]
    elif stop is not None and all(isinstance(s, str) for s in stop) and len(stop):
        stop_strings = list(stop)
    elif stop is not None:
        stop_ids = [int(s) for s in stop]
        check_tokens("sampling_params.stop", stop_ids, state.workspace.vocab_size)
    try:
        params = SamplingParams(n=body.num_samples, temperature=sp.temperature if sp.temperature > 0 else 1.0,
                                greedy=sp.temperature == 0, top_p=sp.top_p, top_k=max(sp.top_k, 0),
                                max_new_tokens=max_tokens, stop_token_ids=stop_ids, seed=sp.seed)
    except ValueError as exc:
        raise bad("sampling_params", str(exc)) from None
    return params, stop_strings


UNSUPPORTED_SAMPLE_FIELDS = ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k")


def _with_images(state: ServiceState, tokens: list[int], images: list):
    """A model input's tokens with its images' tokens in place, and their processor outputs (None without)."""
    from rltk.tinker_service.images import ImageChunkError, expand

    try:
        return expand(state.workspace.processor, tokens, images)
    except ImageChunkError as exc:
        raise bad(exc.field, str(exc)[len(exc.field) + 2:]) from None


async def _asample(state: ServiceState, request) -> dict:
    from rltk.tinker_service.images import ImageIn
    from rltk.tinker_service.wire import encode_sample_response, unsupported_chunk

    body = parse(types.SampleRequest, await json_body(request, state.limits))
    if body.sampling_session_id is None:
        raise bad("sampling_session_id", "create a sampling client first (this service samples from samplers)")
    sampler = state.registry.sampler(body.sampling_session_id, state.owner(request))
    for name in UNSUPPORTED_SAMPLE_FIELDS:
        if getattr(body, name):
            raise bad(name, "not supported by rltk serve-tinker")
    if body.target_prompt_logprobs is not None or body.record_stability_info:
        raise bad("target_prompt_logprobs" if body.target_prompt_logprobs is not None else "record_stability_info",
                  "not supported by rltk serve-tinker")
    prompt: list[int] = []
    images: list[ImageIn] = []
    for j, chunk in enumerate(body.prompt.chunks):
        if isinstance(chunk, types.ImageChunk) and state.workspace.processor is not None:
            images.append(ImageIn(len(prompt), chunk.data, chunk.format, chunk.expected_tokens, f"prompt.chunks[{j}]"))
            continue
        if not isinstance(chunk, types.EncodedTextChunk):
            raise bad(f"prompt.chunks[{j}]", unsupported_chunk(getattr(chunk, "type", type(chunk).__name__)))
        prompt.extend(int(t) for t in chunk.tokens)
    prompt, vision = _with_images(state, prompt, images)
    if not prompt:
        raise bad("prompt", "no tokens")
    check_tokens("prompt", prompt, state.workspace.vocab_size)
    params, stop_strings = _sampling_params(state, body, len(prompt))
    last_n = body.prompt_logprobs_last_n
    if last_n is not None and not 1 <= last_n <= len(prompt) - 1:
        raise bad("prompt_logprobs_last_n", f"must be in [1, {len(prompt) - 1}], got {last_n}")

    def work():
        sequences, scored = state.workspace.sample(sampler.id, prompt, params, stop_strings,
                                                   prompt_logprobs=bool(body.prompt_logprobs), vision=vision)
        if scored is not None and last_n is not None:
            scored = [math.nan] * (len(scored) - last_n) + scored[-last_n:]
        return encode_sample_response(sequences, scored)

    reply = submit(state, sampler.owner, sampler.session, work, proto=True)
    reply["sample_sequence_ids"] = [f"{reply['request_id']}-{i}" for i in range(body.num_samples)]
    return reply


def add_future_routes(app, state: ServiceState) -> None:
    from rltk.tinker_service.wire import PROTO_CONTENT_TYPE

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        body = parse(types.FutureRetrieveRequest, await json_body(request, state.limits))
        entry = state.futures.get(body.request_id, state.owner(request))
        if entry is None:
            raise APIError(404, f"request_id: no operation {body.request_id!r} for this API key (results are kept "
                                f"{state.futures.result_ttl_s:.0f} s, and dropped when their session ends)",
                           code="not_found")
        if not await state.futures.wait(entry, RETRIEVE_WAIT_S):
            return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
        payload, proto = retrieve_payload(entry)
        if proto:
            return Response(content=payload, media_type=PROTO_CONTENT_TYPE)
        return JSONResponse(payload)


__all__ = ["add_service_routes", "add_training_routes", "add_sampling_routes", "add_future_routes"]
