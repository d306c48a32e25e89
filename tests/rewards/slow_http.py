"""A real HTTP server, on a plain socket, that answers as slowly as a test tells it: a byte at a time, or never.

For the tests of the rewards that call a server (``llm_judge``, ``reward_model`` by URL): a socket
timeout is met by every byte of a trickle, so only a deadline on the whole request ends such a call.
"""

from __future__ import annotations

import json
import socket
import threading
import time

from tests.waits import scaled


class SlowServer:
    """Accepts every connection, reads the request, then answers ``body`` (JSON) one byte every ``byte_every_s``
    seconds (``headers_too``: the status line and headers as well, else those at once), or with
    ``byte_every_s=None`` never answers, whatever the path. ``accepted`` counts the connections; ``url`` is
    its address (``http://127.0.0.1:PORT``)."""

    def __init__(self, body: object, *, byte_every_s: float | None, headers_too: bool = False):
        payload = json.dumps(body).encode()
        head = (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                f"Connection: close\r\n\r\n").encode()
        self.head, self.payload = head, payload
        self.byte_every_s, self.headers_too = byte_every_s, headers_too
        self.accepted = 0
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=16)
        self._listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads = [threading.Thread(target=self._accept, daemon=True)]

    def __enter__(self) -> "SlowServer":
        self._threads[0].start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in list(self._threads):
            thread.join(timeout=scaled(5))
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                continue
            self.accepted += 1
            thread = threading.Thread(target=self._answer, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            request = b""
            try:
                while b"\r\n\r\n" not in request:
                    request += conn.recv(65536)
                head, _, body = request.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(body) < length:
                    body += conn.recv(65536)
                if self.byte_every_s is None:
                    self._stop.wait()  # accepted, read, and never answered
                    return
                if not self.headers_too:
                    conn.sendall(self.head)
                for byte in (self.head if self.headers_too else b"") + self.payload:
                    if self._stop.wait(self.byte_every_s):
                        return
                    conn.sendall(bytes([byte]))
            except OSError:
                return  # the client gave up and closed: what the deadline is for


def chat_completion(text: str) -> dict:
    """An OpenAI chat completion whose reply is ``text``."""
    return {"choices": [{"message": {"role": "assistant", "content": text}}]}


def timed(call) -> tuple[object, float]:
    """``call()`` and the seconds it took."""
    start = time.monotonic()
    out = call()
    return out, time.monotonic() - start
