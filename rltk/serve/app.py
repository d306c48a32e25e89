"""The OpenAI-compatible ASGI app over a rollout engine: the routes and the state they share.

Routes (JSON in, JSON out, as the official ``openai`` client speaks them):

* ``GET /v1/models``, ``GET /v1/models/{model}``: the one model served.
* ``POST /v1/chat/completions``: ``messages`` (roles system, developer, user,
  assistant, tool), ``tools`` and ``tool_choice`` (``none``/``auto``), ``n``,
  ``temperature`` (0 means greedy), ``top_p``, ``top_k`` (an extension, as vLLM's),
  ``max_tokens`` / ``max_completion_tokens``, ``stop``, ``seed``, ``logprobs`` and
  ``top_logprobs``. Messages are rendered with the tokenizer's chat template
  (``tools=`` passed through); when the request has tools, each completion is parsed
  with the configured tool-call parser (``hermes`` by default) into
  ``message.tool_calls`` (``finish_reason: "tool_calls"``); text that does not parse
  stays content.
* ``POST /v1/completions``: ``prompt`` as text, a list of texts, token ids, or a
  list of token-id lists; ``n``, ``temperature``, ``top_p``, ``max_tokens``,
  ``stop``, ``seed``, ``logprobs``.
  ``return_token_ids`` (vLLM's extension) adds each choice's exact ``token_ids`` and the
  weight version of each token (``token_versions``); ``stop_token_ids`` (also vLLM's)
  replaces the tokenizer's end-of-text.
* ``GET /rltk/sessions/{session_id}``: the caller's own records of a session (exact
  token ids and log-probs), when the endpoint records; ``GET /health`` (no key needed).
* ``POST /rltk/weights`` ``{"path", "version", "aliases"}`` and ``GET /rltk/weights``, only when
  the app takes weights (``accept_weights``, ``rltk serve --accept-weights``): load a safetensors
  file of the model's weights between two engine calls and label later tokens ``version``
  (what a server engine's trainer does after each update; ``aliases``: ``{name: name in the file}``
  for tied tensors stored once); read the current label.
* ``/docs`` and ``/openapi.json`` only when asked for (``docs=True``).

The modules behind it: :mod:`~rltk.serve.auth` (API keys, session owners),
:mod:`~rltk.serve.limits` (body size, JSON depth, per-request counts),
:mod:`~rltk.serve.requests` (validation, rendering, tokenization),
:mod:`~rltk.serve.responses` (choices, tool calls, SSE), :mod:`~rltk.serve.batcher`
(engine calls, fairness, cancellation), :mod:`~rltk.serve.server` (uvicorn).

Sessions. When the app has a :class:`SessionStore` (the training endpoint; ``rltk serve
--record-sessions``), every choice returned is recorded under (the caller's key, the
``X-Session-Id`` header, else ``"default"``); without one nothing is kept. An agent sets
the header once on its client (``openai.OpenAI(..., default_headers={"X-Session-Id": sid})``).

Work happens off the event loop: the body is parsed, the prompt rendered and tokenized and
the response decoded in worker threads, and the engine runs in the batcher's thread, so
``/health`` and small requests are answered while a large one is being worked on. A
request whose client disconnects is withdrawn from the batcher.

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``: 401
``invalid_api_key``; 404 ``model_not_found``; 413 ``body_too_large``; 400
``invalid_request_error`` for a malformed body or a field out of range (codes
``max_tokens_exceeded``, ``context_length_exceeded``, ``prompt_too_long``,
``too_many_prompts``, ``too_many_choices``, ``request_too_large``, ``json_too_deep``,
``max_turns_exceeded``); 404/405 for unknown routes; 500 ``server_error`` when the
engine fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from rltk.rollout.base import Completion, RolloutEngine, SamplingParams
from rltk.serve import require_serve_dependencies
from rltk.serve.auth import APIKeyMiddleware
from rltk.serve.batcher import Batcher
from rltk.serve.errors import APIError, install_error_handlers
from rltk.serve.limits import Limits, json_body
from rltk.serve.requests import MAX_N, check_model, prepare_chat, prepare_completion
from rltk.serve.responses import chat_result, completion_result, respond
from rltk.serve.server import BackgroundServer, free_socket
from rltk.serve.sessions import DEFAULT_SESSION, SessionStore
from rltk.serve.tool_calls import get_tool_parser

require_serve_dependencies()  # the clear error naming the extra, before fastapi's own ImportError
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import Response, StreamingResponse  # noqa: E402
from starlette.concurrency import run_in_threadpool  # noqa: E402

__all__ = ["APIError", "BackgroundServer", "Limits", "MAX_N", "ServeState", "create_app", "free_socket"]

SESSION_HEADER = "X-Session-Id"
MAX_SESSION_ID = 256
DISCONNECT_POLL_S = 0.05


@dataclass
class ServeState:
    """Everything the routes share; ``app.state.rltk``.

    ``sampling_override`` (a dict of :class:`SamplingParams` fields) is applied
    on top of every request's own sampling fields: the agentic workflow forces
    the training distribution (the trainer's log-prob recompute assumes it) and
    greedy decoding for evaluation this way. ``None`` serves requests as asked.
    ``store`` is ``None`` when the endpoint does not record.
    """

    engine: RolloutEngine
    tokenizer: Any
    model_name: str
    defaults: SamplingParams
    max_tokens_limit: int
    max_model_len: int | None
    tool_parser: str
    batcher: Batcher
    store: SessionStore | None
    sampling_override: dict | None = None
    parse_tool_calls: Any = None
    max_requests_per_session: int | None = None
    limits: Limits = field(default_factory=Limits)
    api_keys: list = field(default_factory=list)
    counters: dict = field(default_factory=lambda: {"requests": 0, "errors": 0, "cancelled": 0})
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(
    engine: RolloutEngine,
    tokenizer: Any,
    *,
    model_name: str = "rltk",
    defaults: SamplingParams | None = None,
    max_tokens_limit: int | None = None,
    max_model_len: int | None = None,
    tool_parser: str = "hermes",
    tool_parser_args: dict | None = None,
    store: SessionStore | None = None,
    max_requests_per_session: int | None = None,
    window_s: float = 0.05,
    max_batch: int = 64,
    max_wait_s: float | None = None,
    api_keys: list[str] | None = None,
    limits: Limits | None = None,
    docs: bool = False,
    slice_tokens: int | None = None,
    max_batch_tokens: int | None = None,
    max_share_tokens: int | None = None,
    accept_weights: bool = False,
):
    """The FastAPI app serving ``engine`` under the model id ``model_name``.

    Args:
        engine: the rollout engine; from now on only the app's batcher thread calls it.
        tokenizer: renders chat messages (its chat template) and decodes completions.
        model_name: the id clients pass as ``model``; any other id is a 404.
        defaults: sampling for fields a request leaves out (``max_tokens`` defaults
            to ``defaults.max_new_tokens``, or what the context leaves when that is
            less); ``None`` means ``SamplingParams()``.
        max_tokens_limit: the most ``max_tokens`` a request may ask for (the
            training budget per turn); ``None`` means ``defaults.max_new_tokens``.
        max_model_len: prompt + completion tokens the model handles (its
            ``max_position_embeddings``); ``None`` skips the context check.
        tool_parser, tool_parser_args: the registered tool-call parser (kind ``tool_parser``)
            for requests with ``tools``, and its arguments.
        store: where records go; ``None`` records nothing (and ``GET /rltk/sessions`` is a 404).
        max_requests_per_session: refuse a session's next request (400, code
            ``max_turns_exceeded``) once it made this many; ``None``: no cap. Needs a ``store``.
        window_s, max_batch, max_wait_s: the :class:`Batcher`'s gap between arrivals it waits
            for, its cap on sequences per engine call, and the longest it collects one round.
        api_keys: keys one of which every route but ``/health`` needs (:mod:`rltk.serve.auth`);
            ``None`` or empty: none.
        limits: per-request bounds (:class:`~rltk.serve.limits.Limits`); ``None``: the defaults.
        docs: serve ``/docs`` and ``/openapi.json`` (off: they describe the API to anyone).
        slice_tokens: generate at most this many tokens per engine call, so requests share the engine
            fairly (:class:`~rltk.serve.batcher.Batcher`); ``None``: whole completions per call.
        max_batch_tokens: with ``slice_tokens``, the most work one engine call gets: the sum over its rows
            of the context re-read and the tokens it may make; ``None``: only ``max_batch`` rows.
        max_share_tokens: with ``slice_tokens``, the most of that work one session (one request without
            an ``X-Session-Id``) gets per call; ``None``: no cap beyond the call's.
        accept_weights: serve ``POST /rltk/weights``, which loads a weights file named by path on this
            machine into the engine (a trainer's server engine); off: the route does not exist.

    The batcher thread is closed on the app's shutdown (``app.state.rltk.batcher.close()``).
    """
    state = _serve_state(engine, tokenizer, model_name=model_name, defaults=defaults,
                         max_tokens_limit=max_tokens_limit, max_model_len=max_model_len, tool_parser=tool_parser,
                         tool_parser_args=tool_parser_args, store=store,
                         max_requests_per_session=max_requests_per_session, window_s=window_s, max_batch=max_batch,
                         max_wait_s=max_wait_s, api_keys=api_keys, limits=limits, slice_tokens=slice_tokens,
                         max_batch_tokens=max_batch_tokens, max_share_tokens=max_share_tokens)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        state.batcher.close()  # under uvicorn's lifespan (rltk serve); BackgroundServer.stop closes it too

    app = FastAPI(title="rltk", description="OpenAI-compatible endpoint over an rltk rollout engine",
                  lifespan=lifespan, docs_url="/docs" if docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if docs else None)
    app.state.rltk = state
    app.add_middleware(APIKeyMiddleware, keys=state.api_keys)
    install_error_handlers(app, state.counters)
    _add_routes(app, state)
    if accept_weights:
        _add_weight_routes(app, state)
    return app


def _serve_state(engine: RolloutEngine, tokenizer: Any, *, model_name: str, defaults: SamplingParams | None,
                 max_tokens_limit: int | None, max_model_len: int | None, tool_parser: str,
                 tool_parser_args: dict | None, store: SessionStore | None, max_requests_per_session: int | None,
                 window_s: float, max_batch: int, max_wait_s: float | None, api_keys: list[str] | None,
                 limits: Limits | None, slice_tokens: int | None, max_batch_tokens: int | None,
                 max_share_tokens: int | None) -> ServeState:
    """:func:`create_app`'s arguments checked and resolved into the routes' shared state (its batcher started)."""
    defaults = defaults or SamplingParams()
    limit = max_tokens_limit if max_tokens_limit is not None else defaults.max_new_tokens
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ValueError(f"create_app: max_tokens_limit must be an integer >= 1, got {limit!r}")
    if max_requests_per_session is not None and store is None:
        raise ValueError("create_app: max_requests_per_session counts recorded requests; pass a store")
    parse_tool_calls = get_tool_parser(tool_parser, tool_parser_args)  # an unknown name fails here, not mid-run
    batcher = Batcher(engine, window_s=window_s, max_batch=max_batch, max_wait_s=max_wait_s,
                      slice_tokens=slice_tokens, max_batch_tokens=max_batch_tokens,
                      max_share_tokens=max_share_tokens)
    keys = list(api_keys or [])
    return ServeState(engine, tokenizer, model_name, defaults, limit, max_model_len, tool_parser, batcher,
                      store, parse_tool_calls=parse_tool_calls, max_requests_per_session=max_requests_per_session,
                      limits=limits or Limits(), api_keys=keys)


def _add_routes(app: FastAPI, state: ServeState) -> None:
    """The routes, in the order FastAPI matches them; each reads ``state``."""

    @app.get("/health")
    async def health():
        return {"status": "ok", **state.batcher.stats()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        check_model(state, model)
        return _model_card(state)

    @app.get("/rltk/sessions/{session_id}")
    async def session(session_id: str, request: Request):
        if state.store is None:
            raise APIError(404, "this endpoint does not record sessions (start rltk serve with --record-sessions)",
                           code="not_found")
        records = state.store.get(session_id, request.state.owner)  # a copy of a bounded list: quick
        # Serialised a slice at a time in worker threads: one json.dumps of a whole large session would hold
        # the GIL (and with it the event loop) for as long as it runs.
        return StreamingResponse(_session_chunks(session_id, records), media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(state, request, prepare_chat, chat_result)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(state, request, prepare_completion, completion_result)


def _add_weight_routes(app: FastAPI, state: ServeState) -> None:
    """``POST /rltk/weights`` (load a file, label its version) and ``GET /rltk/weights`` (the label)."""

    @app.get("/rltk/weights")
    async def weight_version():
        return {"weight_version": state.batcher.weight_version}

    @app.post("/rltk/weights")
    async def load_weights(request: Request):
        body = await json_body(request, state.limits)
        path, version, aliases = body.get("path"), body.get("version"), body.get("aliases") or {}
        if not isinstance(path, str) or not path:
            raise APIError(400, f"'path' must name a safetensors file on this machine, got {str(path)[:80]}",
                           param="path")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise APIError(400, f"'version' must be an integer >= 0, got {str(version)[:40]}", param="version")
        if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                    for k, v in aliases.items()):
            raise APIError(400, "'aliases' must map weight names to names in the file", param="aliases")
        await asyncio.to_thread(state.batcher.load_weights,
                                lambda: _load_weights_file(state.engine, path, aliases), version)
        return {"weight_version": state.batcher.weight_version}


def _load_weights_file(engine: RolloutEngine, path: str, aliases: dict[str, str]) -> None:
    """Read the safetensors file ``path`` (a name the model needs may be an alias of one in the file) and give
    it to ``engine``; a file that is missing or does not hold the model's weights is a 400 naming it."""
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    except (OSError, ValueError, RuntimeError) as exc:  # safetensors raises its own errors as these
        raise APIError(400, f"cannot read the weights file {path}: {exc}", param="path") from None
    for name, source in aliases.items():
        if source not in tensors:
            raise APIError(400, f"alias {name!r} names {source!r}, which {path} does not hold", param="aliases")
        tensors.setdefault(name, tensors[source])
    try:
        engine.update_weights(tensors)
    except (KeyError, ValueError, RuntimeError) as exc:
        raise APIError(400, f"{path} does not hold this model's weights: {exc}", param="path") from None


def _session_chunks(session_id: str, records: list, per_chunk: int = 64):
    """``{"session_id": ..., "records": [...]}`` as byte chunks of ``per_chunk`` records (a sync generator:
    Starlette runs each step in a worker thread)."""
    yield f'{{"session_id": {json.dumps(session_id)}, "records": ['.encode()
    for start in range(0, len(records), per_chunk):
        part = ", ".join(json.dumps(r.to_dict()) for r in records[start:start + per_chunk])
        yield ((", " if start else "") + part).encode()
    yield b"]}"


def _model_card(state: ServeState) -> dict:
    card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "rltk"}
    if state.max_model_len is not None:
        card["max_model_len"] = state.max_model_len
    return card


def _session_of(request) -> tuple[str | None, str]:
    """``(owner, session id)``: the caller's key namespace and the ``X-Session-Id`` header, else ``default``.

    The body's ``user`` field is not a session id: it is free text an end user's client may set.
    """
    session_id = request.headers.get(SESSION_HEADER) or DEFAULT_SESSION
    if len(session_id) > MAX_SESSION_ID:
        raise APIError(400, f"the {SESSION_HEADER} header is {len(session_id)} characters; at most {MAX_SESSION_ID}",
                       param=SESSION_HEADER)
    return request.state.owner, session_id


def _check_turns(state: ServeState, owner: str | None, session_id: str) -> None:
    cap = state.max_requests_per_session
    if cap is not None and state.store.requests(session_id, owner) >= cap:
        raise APIError(400, f"session {session_id!r} already made {cap} requests, the most one episode may make "
                            "(env.max_turns)", param=None, code="max_turns_exceeded")


async def _serve(state: ServeState, request, prepare, build):
    """Read, validate and tokenize (worker thread), generate (batcher), build the response (worker thread)."""
    body = await json_body(request, state.limits)
    state.counters["requests"] += 1
    session = _session_of(request)
    prepared = await run_in_threadpool(prepare, state, body)
    if state.store is not None:
        _check_turns(state, *session)
    groups = await _generate(state, request, prepared.prompts, prepared.params, session)
    if groups is None:  # the client went away; nobody reads an answer
        return Response(status_code=499)
    result = await run_in_threadpool(build, state, prepared, groups, session if state.store is not None else None)
    return respond(result, body)


async def _generate(state: ServeState, request, prompts: list[list[int]], params: SamplingParams,
                    session: tuple[str | None, str]) -> list[list[Completion]] | None:
    """The engine's completions, or ``None`` when the client disconnected first (the job is withdrawn)."""
    owner, session_id = session
    # Engine time is shared fairly between sessions; requests without an X-Session-Id (all "default") each
    # count as their own requester, or one client's large request would stall every other client without one.
    requester = (owner, session_id) if request.headers.get(SESSION_HEADER) else object()
    future = state.batcher.submit(prompts, params, order=session_id, requester=requester)
    waiting = asyncio.wrap_future(future)
    try:
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
            if done:
                return waiting.result()
            if await request.is_disconnected():
                future.cancel()  # the batcher drops it before its next engine call
                state.counters["cancelled"] += 1
                return None
    finally:
        if not waiting.done():
            waiting.cancel()
