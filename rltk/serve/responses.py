"""Turning the engine's completions into OpenAI responses: stop strings, tool calls, log-probs, SSE.

:func:`chat_result` and :func:`completion_result` decode and record every choice (the
session store, when the endpoint records); the routes run them in a worker thread, as
decoding is per token. ``stream: true`` is answered as server-sent events once the
completion is done (the engine generates whole completions): one chunk per choice with
the whole text (and tool calls), one with its finish reason, a usage chunk when
``stream_options.include_usage`` asks for it, then ``[DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from rltk.rollout.base import Completion


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


def _record(state, session, request_id, index, prompt_ids, ids, lps, finish, text, endpoint, **tool_use) -> None:
    if state.store is not None and session is not None:
        owner, session_id = session
        state.store.add(session_id, request_id, index, prompt_ids, ids, lps, finish, text, endpoint, owner=owner,
                        **tool_use)


def chat_result(state, prepared, groups: list[list[Completion]], session) -> dict:
    """The ``chat.completion`` for ``prepared``'s one prompt; records each choice under ``session``."""
    [prompt_ids], [completions] = prepared.prompts, groups
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    parse = state.parse_tool_calls if prepared.tools and prepared.tool_choice != "none" else None
    choices, completion_tokens = [], 0
    for index, completion in enumerate(completions):
        ids, lps, text, finish = _cut_at_stop_strings(state.tokenizer, completion, prepared.stops)
        content, calls, error = parse(text) if parse is not None else (text, [], None)
        results, result_errors = prepared.tool_results
        _record(state, session, request_id, index, prompt_ids, ids, lps, finish, text, "chat",
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
        if prepared.logprobs:
            choice["logprobs"] = {"content": [
                {"token": token, "logprob": lp, "bytes": list(token.encode("utf-8")),
                 "top_logprobs": [] if prepared.top_logprobs == 0 else
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


def completion_result(state, prepared, groups: list[list[Completion]], session) -> dict:
    """The ``text_completion`` for ``prepared``'s prompts, choices numbered prompt-major."""
    request_id = f"cmpl-{uuid.uuid4().hex}"
    n, logprobs = prepared.params.n, prepared.logprobs
    choices, completion_tokens = [], 0
    for prompt_index, (prompt_ids, completions) in enumerate(zip(prepared.prompts, groups)):
        for sample, completion in enumerate(completions):
            index = prompt_index * n + sample
            ids, lps, text, finish = _cut_at_stop_strings(state.tokenizer, completion, prepared.stops)
            _record(state, session, request_id, index, prompt_ids, ids, lps, finish, text, "completions")
            completion_tokens += len(ids)
            choice = {"text": text, "index": index, "logprobs": None, "finish_reason": finish}
            if prepared.return_token_ids:  # token-in/token-out clients (a server engine): no re-tokenizing
                choice["token_ids"] = ids
                choice["token_versions"] = list(completion.versions or [])[: len(ids)]
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
    prompt_tokens = sum(len(p) for p in prepared.prompts)
    return {
        "id": request_id, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def respond(result: dict, body: dict):
    """``result`` as JSON, or as server-sent events when the request asked to stream."""
    from fastapi.responses import JSONResponse

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
