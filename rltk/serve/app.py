"""The OpenAI-compatible ASGI app over a rollout engine, and uvicorn in a background thread.

Routes (JSON in, JSON out, as the official ``openai`` client speaks them):

* ``GET /v1/models``, ``GET /v1/models/{model}``: the one model served.
* ``POST /v1/chat/completions``: ``messages`` (roles system, developer, user,
  assistant, tool), ``tools`` and ``tool_choice``, ``n``, ``temperature`` (0 means
  greedy), ``top_p``, ``top_k`` (an extension, as vLLM's), ``max_tokens`` /
  ``max_completion_tokens``, ``stop``, ``seed``, ``logprobs`` and ``top_logprobs``.
  Messages are rendered with the tokenizer's chat template (``tools=`` passed
  through); when the request has tools, each completion is parsed with the
  configured tool-call parser (``hermes`` by default) into ``message.tool_calls``
  (``finish_reason: "tool_calls"``); text that does not parse stays content.
* ``POST /v1/completions``: ``prompt`` as text, a list of texts, token ids, or a
  list of token-id lists; ``n``, ``temperature``, ``top_p``, ``max_tokens``,
  ``stop``, ``seed``, ``logprobs``.
* ``GET /rltk/sessions/{session_id}``: every record of a session (exact token
  ids and log-probs), ``GET /health``.

``stream: true`` is answered as server-sent events once the completion is
done (the engine generates whole completions): one chunk per choice with the
whole text (and tool calls), one with its finish reason, a usage chunk when
``stream_options.include_usage`` asks for it, then ``[DONE]``; so clients and
agent frameworks that stream work unchanged.

Log-probs are those of the sampled tokens under the distribution they were
drawn from (see the engine). The engine reports no alternatives, so a
``top_logprobs`` list holds only the sampled token (empty when 0 are asked for).

Sessions. Every choice returned is recorded (:mod:`rltk.serve.sessions`) under
the request's session id: the ``X-Session-Id`` header, else the body's ``user``
field, else ``"default"``. An agent sets the header once on its client
(``openai.OpenAI(..., default_headers={"X-Session-Id": sid})``).

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``:
404 ``model_not_found`` for an unknown model; 400 ``invalid_request_error`` for
a malformed body, empty ``messages``, an unknown role, ``n < 1``,
``temperature < 0``, ``top_p`` outside (0, 1], ``max_tokens`` above the budget
(code ``max_tokens_exceeded``), a prompt that leaves no room in the model's
context (code ``context_length_exceeded``);
404/405 for unknown routes; 500 ``server_error`` when the engine fails.

Requests are coalesced into batched engine calls by :class:`~rltk.serve.batcher.Batcher`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from rltk.rollout.base import Completion, RolloutEngine, SamplingParams
from rltk.serve import require_serve_dependencies
from rltk.serve.batcher import Batcher
from rltk.serve.sessions import DEFAULT_SESSION, SessionStore, tool_results_sent
from rltk.serve.tool_calls import get_tool_parser

require_serve_dependencies()  # the clear error naming the extra, before fastapi's own ImportError
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.exceptions import RequestValidationError  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402
from starlette.exceptions import HTTPException as StarletteHTTPException  # noqa: E402

SESSION_HEADER = "X-Session-Id"
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 128  # more choices than this in one request is almost certainly a mistake


class APIError(Exception):
    """A request the endpoint refuses, answered as OpenAI's ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ServeState:
    """Everything the routes share; ``app.state.rltk``.

    ``sampling_override`` (a dict of :class:`SamplingParams` fields) is applied
    on top of every request's own sampling fields: the agentic workflow forces
    the training distribution (the trainer's log-prob recompute assumes it) and
    greedy decoding for evaluation this way. ``None`` serves requests as asked.
    """

    engine: RolloutEngine
    tokenizer: Any
    model_name: str
    defaults: SamplingParams
    max_tokens_limit: int
    max_model_len: int | None
    tool_parser: str
    batcher: Batcher
    store: SessionStore
    sampling_override: dict | None = None
    parse_tool_calls: Any = None
    max_requests_per_session: int | None = None
    counters: dict = field(default_factory=lambda: {"requests": 0, "errors": 0})
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
        store: where records go; a new unbounded store when ``None``.
        max_requests_per_session: refuse a session's next request (400, code
            ``max_turns_exceeded``) once it made this many; ``None``: no cap.
        window_s, max_batch, max_wait_s: the :class:`Batcher`'s gap between arrivals it waits
            for, its cap on sequences per engine call, and the longest it collects one round.

    The batcher thread is closed on the app's shutdown (``app.state.rltk.batcher.close()``).
    """
    defaults = defaults or SamplingParams()
    limit = max_tokens_limit if max_tokens_limit is not None else defaults.max_new_tokens
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ValueError(f"create_app: max_tokens_limit must be an integer >= 1, got {limit!r}")
    parse_tool_calls = get_tool_parser(tool_parser, tool_parser_args)  # an unknown name fails here, not mid-run
    batcher = Batcher(engine, window_s=window_s, max_batch=max_batch, max_wait_s=max_wait_s)
    state = ServeState(engine, tokenizer, model_name, defaults, limit, max_model_len, tool_parser, batcher,
                       store or SessionStore(), parse_tool_calls=parse_tool_calls,
                       max_requests_per_session=max_requests_per_session)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        state.batcher.close()  # under uvicorn's lifespan (rltk serve); BackgroundServer.stop closes it too

    app = FastAPI(title="rltk", description="OpenAI-compatible endpoint over an rltk rollout engine",
                  lifespan=lifespan)
    app.state.rltk = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        state.counters["errors"] += 1
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        state.counters["errors"] += 1
        error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                         code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(error.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        state.counters["errors"] += 1
        return JSONResponse(APIError(400, str(exc)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception):
        state.counters["errors"] += 1
        error = APIError(500, f"the rollout engine failed: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(error.body(), status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok", **state.batcher.stats()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        _check_model(state, model)
        return _model_card(state)

    @app.get("/rltk/sessions/{session_id}")
    async def session(session_id: str):
        return {"session_id": session_id, "records": [r.to_dict() for r in state.store.get(session_id)]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json_body(request)
        state.counters["requests"] += 1
        return _respond(await _chat(state, body, _session_id(request, body)), body)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json_body(request)
        state.counters["requests"] += 1
        return _respond(await _complete(state, body, _session_id(request, body)), body)

    return app


# ---------------------------------------------------------------------- request parsing


async def _json_body(request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _session_id(request, body: dict) -> str:
    header = request.headers.get(SESSION_HEADER)
    if header:
        return header
    user = body.get("user")
    return user if isinstance(user, str) and user else DEFAULT_SESSION


def _model_card(state: ServeState) -> dict:
    card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "rltk"}
    if state.max_model_len is not None:
        card["max_model_len"] = state.max_model_len
    return card


def _check_model(state: ServeState, model: Any) -> None:
    if model is None:
        raise APIError(400, "'model' is required; this endpoint serves " + repr(state.model_name), param="model")
    if model != state.model_name:
        raise APIError(404, f"The model {model!r} does not exist; this endpoint serves {state.model_name!r} "
                            "(GET /v1/models lists it)", param="model", code="model_not_found")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _sampling(state: ServeState, body: dict, prompt_lengths: list[int]) -> tuple[SamplingParams, list[str]]:
    """The request's :class:`SamplingParams` and stop strings, or a 400 naming the field."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise APIError(400, f"'stream' must be true or false, got {stream!r}", param="stream")
    n = body.get("n", 1)
    n = 1 if n is None else n
    if not _is_int(n) or n < 1 or n > MAX_N:
        raise APIError(400, f"'n' must be an integer in [1, {MAX_N}], got {n!r}", param="n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise APIError(400, f"'best_of' other than n is not supported (got best_of={best_of!r}, n={n})",
                       param="best_of")
    temperature = body.get("temperature")
    if temperature is not None and (not _is_number(temperature) or temperature < 0):
        raise APIError(400, f"'temperature' must be a number >= 0 (0 means greedy), got {temperature!r}",
                       param="temperature")
    top_p = body.get("top_p")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise APIError(400, f"'top_p' must be a number in (0, 1], got {top_p!r}", param="top_p")
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < -1):
        raise APIError(400, f"'top_k' must be an integer >= 0 (0 or -1 turn it off), got {top_k!r}", param="top_k")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise APIError(400, f"'seed' must be an integer, got {seed!r}", param="seed")

    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(key)
    longest = max(prompt_lengths)
    room = None if state.max_model_len is None else state.max_model_len - longest
    if room is not None and room < 1:
        raise APIError(400, f"the prompt is {longest} tokens, which leaves no room for a completion in the "
                            f"model's context of {state.max_model_len} tokens; shorten the conversation",
                       param="messages" if "messages" in body else "prompt", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(state.defaults.max_new_tokens, state.max_tokens_limit, room or state.max_tokens_limit)
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise APIError(400, f"'{key}' must be an integer >= 1, got {max_tokens!r}", param=key)
    elif max_tokens > state.max_tokens_limit:
        raise APIError(400, f"'{key}'={max_tokens} is more than this endpoint's budget of {state.max_tokens_limit} "
                            f"new tokens per request; ask for at most {state.max_tokens_limit}", param=key,
                       code="max_tokens_exceeded")
    elif room is not None and max_tokens > room:
        raise APIError(400, f"the prompt is {longest} tokens and '{key}' asks for {max_tokens} more, over the "
                            f"model's context of {state.max_model_len} tokens; ask for at most {room} or shorten "
                            "the prompt", param=key, code="context_length_exceeded")

    stop = body.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise APIError(400, f"'stop' must be a string or a list of strings, got {stop!r}", param="stop")
    stops = [s for s in stops if s]

    fields = {"n": n, "max_new_tokens": max_tokens, "seed": seed,
              "temperature": state.defaults.temperature, "top_p": state.defaults.top_p,
              "top_k": state.defaults.top_k, "greedy": False, "stop_token_ids": state.defaults.stop_token_ids}
    if temperature is not None:
        if temperature == 0:
            fields["greedy"] = True
        else:
            fields["temperature"] = float(temperature)
    if top_p is not None:
        fields["top_p"] = float(top_p)
    if top_k is not None:
        fields["top_k"] = max(top_k, 0)
    if state.sampling_override:
        fields.update(state.sampling_override)
    try:
        params = replace(state.defaults, **fields)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    return params, stops


def _text_of(content: Any, where: str) -> str | None:
    """A message's content as text: a string, ``None``, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for number, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"{where}[{number}]: only text parts ({{'type': 'text', 'text': ...}}) are "
                                    f"supported, got {part!r}", param=where)
            texts.append(part["text"])
        return "".join(texts)
    raise APIError(400, f"{where} must be a string or a list of text parts, got {type(content).__name__}", param=where)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, f"'messages' must be a non-empty list of messages, got {messages!r}", param="messages")
    out = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise APIError(400, f"{where} must be an object with 'role' and 'content', got {message!r}", param=where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise APIError(400, f"{where}.role={role!r} is not a valid role; valid roles: {list(CHAT_ROLES)}",
                           param=f"{where}.role")
        rendered = {key: value for key, value in message.items() if key not in ("content", "tool_calls")}
        rendered["content"] = _text_of(message.get("content"), f"{where}.content")
        if rendered["content"] is None and role != "assistant":
            raise APIError(400, f"{where} (role {role!r}) needs a 'content'", param=f"{where}.content")
        if rendered["content"] is None:
            rendered["content"] = ""
        if message.get("tool_calls"):
            rendered["tool_calls"] = _template_tool_calls(message["tool_calls"], f"{where}.tool_calls")
        out.append(rendered)
    return out


def _template_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's OpenAI ``tool_calls`` in the form chat templates read (arguments as a dict)."""
    if not isinstance(calls, list):
        raise APIError(400, f"{where} must be a list, got {type(calls).__name__}", param=where)
    out = []
    for number, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(400, f"{where}[{number}] must be {{'type': 'function', 'function': {{'name', "
                                f"'arguments'}}}}, got {call!r}", param=f"{where}[{number}]")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                raise APIError(400, f"{where}[{number}].function.arguments is not valid JSON: {exc}",
                               param=f"{where}[{number}].function.arguments") from None
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError(400, f"'tools' must be a list of function tools, got {type(tools).__name__}", param="tools")
    for number, item in enumerate(tools):
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise APIError(400, f"tools[{number}] must be {{'type': 'function', 'function': {{'name', "
                                f"'description', 'parameters'}}}}, got {item!r}", param=f"tools[{number}]")
    return tools or None


def _render_chat(state: ServeState, messages: list[dict], tools: list[dict] | None) -> list[int]:
    tokenizer = state.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "the served model's tokenizer has no chat template; use /v1/completions with a "
                            "prompt instead", param="messages")
    from rltk.workflows.chat import render_ids

    try:  # the rendering multi_turn opens its episodes with, so both give one prompt the same ids
        ids = render_ids(tokenizer, messages, tools=tools)
    except ValueError as exc:  # the template refused them (jinja's TemplateError or its own raise_exception)
        raise APIError(400, str(exc), param="messages") from None
    if not ids:
        raise APIError(400, "the messages render to no tokens", param="messages")
    return list(ids)


# ---------------------------------------------------------------------- generation and responses


def _check_turns(state: ServeState, session_id: str) -> None:
    cap = state.max_requests_per_session
    if cap is not None and state.store.requests(session_id) >= cap:
        raise APIError(400, f"session {session_id!r} already made {cap} requests, the most one episode may make "
                            "(env.max_turns)", param=None, code="max_turns_exceeded")


async def _generate(state: ServeState, prompts: list[list[int]], params: SamplingParams,
                    session_id: str | None = None) -> list[list[Completion]]:
    future = state.batcher.submit(prompts, params, order=session_id)
    return await asyncio.wrap_future(future)


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def _cut_at_stop_strings(tokenizer, completion: Completion, stops: list[str]) -> tuple[list[int], list[float], str, str]:
    """``(ids, logprobs, text, finish_reason)`` with the completion cut at its first stop string.

    The ids keep the shortest token prefix whose text contains the stop string
    (the tokens the model produced up to it); the text ends before it, as
    OpenAI returns it. Without a stop string in the text, nothing changes.
    """
    ids, logprobs = list(completion.token_ids), list(completion.logprobs)
    text = _decode(tokenizer, ids)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return ids, logprobs, text, completion.finish_reason
    position, stop = min(hits)
    for k in range(1, len(ids) + 1):
        if stop in _decode(tokenizer, ids[:k]):
            return ids[:k], logprobs[:k], text[:position], "stop"
    return ids, logprobs, text[:position], "stop"


def _token_strings(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([token]) for token in ids]


async def _chat(state: ServeState, body: dict, session_id: str) -> dict:
    _check_model(state, body.get("model"))
    messages = _messages(body)
    tools = _tools(body)
    tool_choice = body.get("tool_choice", "auto" if tools else "none")
    if not (tool_choice in ("none", "auto", "required") or isinstance(tool_choice, dict)):
        raise APIError(400, f"'tool_choice' must be 'none', 'auto', 'required' or a function, got {tool_choice!r}",
                       param="tool_choice")
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise APIError(400, f"'logprobs' must be true or false, got {logprobs!r}", param="logprobs")
    top_logprobs = body.get("top_logprobs") or 0
    if not _is_int(top_logprobs) or not 0 <= top_logprobs <= 20:
        raise APIError(400, f"'top_logprobs' must be an integer in [0, 20], got {top_logprobs!r}",
                       param="top_logprobs")
    prompt_ids = _render_chat(state, messages, tools)
    params, stops = _sampling(state, body, [len(prompt_ids)])
    _check_turns(state, session_id)
    completions = (await _generate(state, [prompt_ids], params, session_id))[0]

    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    parse = state.parse_tool_calls if tools and tool_choice != "none" else None
    choices, completion_tokens = [], 0
    results, result_errors = tool_results_sent(messages)
    for index, completion in enumerate(completions):
        ids, lps, text, finish = _cut_at_stop_strings(state.tokenizer, completion, stops)
        content, calls, error = parse(text) if parse is not None else (text, [], None)
        state.store.add(session_id, request_id, index, prompt_ids, ids, lps, finish, text, "chat",
                        tool_calls=len(calls) if error is None else 0, tool_parse_error=error is not None,
                        tool_results=results, tool_result_errors=result_errors)
        completion_tokens += len(ids)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if parse is not None:
            if calls and error is None:
                message["content"] = content or None
                message["tool_calls"] = [
                    {"id": call.id, "type": "function",
                     "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                    for call in calls
                ]
                finish = "tool_calls"
        choice = {"index": index, "message": message, "logprobs": None, "finish_reason": finish}
        if logprobs:
            choice["logprobs"] = {"content": [
                {"token": token, "logprob": lp, "bytes": list(token.encode("utf-8")),
                 "top_logprobs": [] if top_logprobs == 0 else
                 [{"token": token, "logprob": lp, "bytes": list(token.encode("utf-8"))}]}
                for token, lp in zip(_token_strings(state.tokenizer, ids), lps)
            ]}
        choices.append(choice)
    return {
        "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
        "choices": choices,
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                  "total_tokens": len(prompt_ids) + completion_tokens},
    }


def _prompts(state: ServeState, body: dict) -> list[list[int]]:
    """``prompt`` as token-id lists: a text, a list of texts, a token-id list, or a list of those."""
    prompt = body.get("prompt")

    def encode(text: str, where: str) -> list[int]:
        ids = state.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise APIError(400, f"{where} is empty; a prompt needs at least one token", param="prompt")
        return list(ids)

    def token_ids(ids: list, where: str) -> list[int]:
        vocab = len(state.tokenizer)
        if not ids or not all(_is_int(t) and 0 <= t < vocab for t in ids):
            raise APIError(400, f"{where} must be a non-empty list of token ids in [0, {vocab}), got {ids[:8]!r}",
                           param="prompt")
        return list(ids)

    if isinstance(prompt, str):
        return [encode(prompt, "prompt")]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [encode(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        if all(_is_int(t) for t in prompt):
            return [token_ids(prompt, "prompt")]
        if all(isinstance(p, list) for p in prompt):
            return [token_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    raise APIError(400, "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id "
                        f"lists, got {prompt!r}"[:400], param="prompt")


async def _complete(state: ServeState, body: dict, session_id: str) -> dict:
    _check_model(state, body.get("model"))
    if body.get("echo"):
        raise APIError(400, "echo=true is not supported by this endpoint", param="echo")
    if body.get("suffix"):
        raise APIError(400, "'suffix' is not supported by this endpoint", param="suffix")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= 5):
        raise APIError(400, f"'logprobs' must be an integer in [0, 5] or null, got {logprobs!r}", param="logprobs")
    prompts = _prompts(state, body)
    params, stops = _sampling(state, body, [len(p) for p in prompts])
    _check_turns(state, session_id)
    groups = await _generate(state, prompts, params, session_id)

    request_id = f"cmpl-{uuid.uuid4().hex}"
    choices, completion_tokens = [], 0
    for prompt_index, (prompt_ids, completions) in enumerate(zip(prompts, groups)):
        for sample, completion in enumerate(completions):
            index = prompt_index * params.n + sample
            ids, lps, text, finish = _cut_at_stop_strings(state.tokenizer, completion, stops)
            state.store.add(session_id, request_id, index, prompt_ids, ids, lps, finish, text, "completions")
            completion_tokens += len(ids)
            choice = {"text": text, "index": index, "logprobs": None, "finish_reason": finish}
            if logprobs is not None:
                tokens = _token_strings(state.tokenizer, ids)
                offsets, offset = [], 0
                for token_id in ids:  # offsets into `text`, which leaves special tokens out
                    offsets.append(offset)
                    offset += len(_decode(state.tokenizer, [token_id]))
                choice["logprobs"] = {
                    "tokens": tokens, "token_logprobs": lps, "text_offset": offsets,
                    "top_logprobs": None if logprobs == 0 else [{t: lp} for t, lp in zip(tokens, lps)],
                }
            choices.append(choice)
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "id": request_id, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def _respond(result: dict, body: dict):
    """``result`` as JSON, or as server-sent events when the request asked to stream."""
    if not body.get("stream"):
        # Already plain JSON types: a JSONResponse skips FastAPI's jsonable_encoder walk of every field (the same
        # bytes; it was a sizable share of the endpoint's time per request with log-probs in the body).
        return JSONResponse(result)
    from fastapi.responses import StreamingResponse

    options = body.get("stream_options") or {}
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    return StreamingResponse(_events(result, include_usage), media_type="text/event-stream")


def _events(result: dict, include_usage: bool):
    """The chunks of a finished ``result``: its content per choice, then each finish reason, usage, ``[DONE]``."""
    chat = result["object"] == "chat.completion"
    head = {"id": result["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": result["created"], "model": result["model"]}

    def event(choices: list, **extra) -> str:
        return f"data: {json.dumps({**head, 'choices': choices, **extra})}\n\n"

    for choice in result["choices"]:
        if chat:
            message = choice["message"]
            delta = {"role": "assistant", "content": message["content"]}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            yield event([{"index": choice["index"], "delta": delta, "logprobs": choice["logprobs"],
                          "finish_reason": None}])
        else:
            yield event([{"index": choice["index"], "text": choice["text"], "logprobs": choice["logprobs"],
                          "finish_reason": None}])
    for choice in result["choices"]:
        if chat:
            yield event([{"index": choice["index"], "delta": {}, "logprobs": None,
                          "finish_reason": choice["finish_reason"]}])
        else:
            yield event([{"index": choice["index"], "text": "", "logprobs": None,
                          "finish_reason": choice["finish_reason"]}])
    if include_usage:
        yield event([], usage=result["usage"])
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------- uvicorn in a thread


def free_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: the OS picks a free one); uvicorn serves on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it: uvicorn writes a response's headers and body separately, and with
    # Nagle's algorithm the body waits for the client's delayed ACK, ~40 ms on every request.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class BackgroundServer:
    """uvicorn serving ``app`` from a daemon thread of this process (what training uses).

    ``start()`` returns the base URL (``http://127.0.0.1:PORT/v1``) once the
    server accepts connections; ``stop()`` shuts it down and closes the app's
    batcher. Also a context manager.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.app, self.host, self.port, self.log_level = app, host, port, log_level
        self._server = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.base_url: str | None = None

    def start(self, timeout: float = 30.0) -> str:
        import uvicorn

        sock = free_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level=self.log_level, lifespan="off", access_log=False,
                                timeout_keep_alive=30)
        self._server = uvicorn.Server(config)

        def serve():
            try:
                asyncio.run(self._server.serve(sockets=[sock]))
            except BaseException as exc:  # reported by start(), which is waiting on it
                self._error = exc
            finally:
                sock.close()

        self._thread = threading.Thread(target=serve, name="rltk-serve-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"the endpoint failed to start on {self.host}:{self.port}: {self._error!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the endpoint did not start on {self.host}:{self.port} within {timeout} s")
            time.sleep(0.01)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.base_url = f"http://{host}:{self.port}/v1"
        return self.base_url

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.app.state.rltk.batcher.close()

    def __enter__(self) -> "BackgroundServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
