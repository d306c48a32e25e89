"""The bounds every request is checked against before any work is done on it.

In the order they are checked:

* ``max_body_bytes`` (413, code ``body_too_large``): the ``Content-Length`` header, then the bytes
  actually received, read in chunks and abandoned as soon as they pass the limit;
* JSON nesting deeper than ``max_json_depth`` (400, code ``json_too_deep``); parsing runs in a
  worker thread, and Python's own recursion guard is answered as the same 400;
* ``max_prompt_chars`` (400, code ``prompt_too_long``): the characters of the prompts (every
  message's content and the tools' JSON for chat), counted before anything is tokenized;
* ``max_prompts`` (400, code ``too_many_prompts``): prompts in one ``/v1/completions`` request;
* ``max_choices`` (400, code ``too_many_choices``): prompts x ``n``;
* ``max_request_tokens`` (400, code ``request_too_large``): prompts x ``n`` x ``max_tokens``, the
  most new tokens one request may make the engine produce.

After tokenizing, the context check (prompt + ``max_tokens`` within the model's context) and the
``max_tokens`` budget follow, as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from rltk.serve.errors import APIError


@dataclass(frozen=True)
class Limits:
    """Per-request bounds (see the module docstring); every field must be an integer >= 1."""

    max_body_bytes: int = 4 << 20
    max_json_depth: int = 32
    max_prompt_chars: int = 200_000
    max_prompts: int = 64
    max_choices: int = 128
    max_request_tokens: int = 32_768

    def __post_init__(self):
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Limits: {name} must be an integer >= 1, got {value!r}")


def parse_json(raw: bytes, max_depth: int):
    """``raw`` parsed, or a 400: not JSON, a number too long to convert, or nested deeper than ``max_depth``."""
    try:
        body = json.loads(raw or b"null")
    except RecursionError:
        raise APIError(400, f"the request body nests JSON deeper than this endpoint's limit of {max_depth} "
                            "levels", code="json_too_deep") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, and Python's cap on digits of an int
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    depth = _depth(body)
    if depth > max_depth:
        raise APIError(400, f"the request body nests JSON {depth} levels deep, over this endpoint's limit of "
                            f"{max_depth} levels", code="json_too_deep")
    return body


def _depth(value) -> int:
    """Nesting depth of parsed JSON, without recursion (a scalar is 0, ``[]`` and ``{}`` are 1)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in item)
    return deepest


async def read_body(request, limits: Limits) -> bytes:
    """The request's bytes, refused (413) as soon as the header or the bytes received pass ``max_body_bytes``."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {int(declared)} bytes, over this endpoint's limit of {limit} "
                            "bytes (--max-body-bytes)", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over this endpoint's limit of {limit} bytes "
                                "(--max-body-bytes)", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def json_body(request, limits: Limits) -> dict:
    """The request's JSON object, parsed in a worker thread after the size check."""
    from starlette.concurrency import run_in_threadpool

    raw = await read_body(request, limits)
    body = await run_in_threadpool(parse_json, raw, limits.max_json_depth)
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body
