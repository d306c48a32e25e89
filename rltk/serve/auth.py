"""API keys: who may call the endpoint, and whose sessions a caller may read.

With keys configured (``rltk serve --api-key KEY``, repeatable, or ``RLTK_API_KEY``,
several separated by commas) every route but ``GET /health`` needs
``Authorization: Bearer KEY`` (what the ``openai`` client sends as its ``api_key``);
anything else is a 401 in OpenAI's shape, code ``invalid_api_key``.

Sessions are private to the key that wrote them: a request's records are filed
under (the key's owner tag, its session id), and ``GET /rltk/sessions/{id}`` reads
only the caller's own. With one key everyone holding it is one principal; with
several, each key is its own namespace, so two keys using the same session id
never see each other's prompts. Without a key there is one namespace, open to
whoever can reach the port: hence loopback by default and a warning otherwise.
The training endpoint (the ``agentic`` workflow) starts with a random key only its
own client knows, and its workflow reads the records in-process.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os

API_KEY_ENV = "RLTK_API_KEY"
OPEN_PATHS = frozenset({"/health"})


def api_keys_from(flags: list[str] | None, environ=os.environ) -> list[str]:
    """The keys of ``--api-key`` flags, else of ``$RLTK_API_KEY`` (comma-separated), without blanks."""
    keys = [k for k in (flags or []) if k]
    if not keys:
        keys = [k.strip() for k in environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    return keys


def owner_tag(key: str | None, keys: list[str]) -> str | None:
    """A caller's session namespace: ``None`` with fewer than two keys (one principal), else its key's digest."""
    if key is None or len(keys) < 2:
        return None
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def exposure_warning(host: str, keys: list[str]) -> str | None:
    """The warning for listening beyond loopback without a key, or ``None``."""
    if keys or is_loopback(host):
        return None
    return (f"rltk serve: WARNING: listening on {host} without an API key: anyone who can reach this port can "
            f"generate with the model (and read recorded sessions). Set --api-key or ${API_KEY_ENV}, or listen "
            "on 127.0.0.1.")


def _unauthorized(message: str) -> tuple[int, list, bytes]:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "invalid_api_key"}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"www-authenticate", b"Bearer")]
    return 401, headers, body


class APIKeyMiddleware:
    """ASGI middleware: refuse HTTP requests without a valid Bearer key, and put the caller's owner tag on
    ``scope["state"]["owner"]`` (read by the routes as ``request.state.owner``).

    Pure ASGI rather than Starlette's ``BaseHTTPMiddleware``, which would wrap every response (and hide a
    client's disconnect from the route).
    """

    def __init__(self, app, keys: list[str], *, key_header: bytes | None = None,
                 open_paths: frozenset[str] = OPEN_PATHS):
        self.app = app
        self.keys = list(keys)
        self._encoded = [k.encode() for k in self.keys]
        # key_header: the key sent bare in that header (the Tinker SDK's X-API-Key), or else as a Bearer token
        self.key_header = key_header.lower() if key_header else None
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["owner"] = None
        if not self.keys or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.key_header is not None and self.key_header in headers:
            header = headers[self.key_header]
            scheme, token = b"bearer", header.strip()
        else:  # also with a key_header: what huggingface_hub sends (HF_TOKEN) to the Tinker service's /hub
            header = headers.get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            token = token.strip()
        # compare_digest against every key: the time taken says nothing about which prefix matched
        matches = [hmac.compare_digest(token, key) for key in self._encoded]
        if scheme.lower() != b"bearer" or not any(matches):
            how = (f"'{self.key_header.decode()}: <key>'" if self.key_header is not None
                   else "'Authorization: Bearer <key>' (the openai client's api_key)")
            message = f"no API key given: send {how}" if not header else "Incorrect API key provided"
            status, headers, body = _unauthorized(message)
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        scope["state"]["owner"] = owner_tag(self.keys[matches.index(True)], self.keys)
        return await self.app(scope, receive, send)
