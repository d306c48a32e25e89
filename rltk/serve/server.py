"""uvicorn serving the app: on a socket of its own (``rltk serve``) or in a thread of this process (training)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time


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
