"""Run an ASGI app under uvicorn in a background thread (engines, sidecars, relays, tests)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Literal

from .errors import RollpatchError

__all__ = ["ServerHandle", "serve_app"]


class ServerHandle:
    """A running server: ``url`` (``http://host:port``) and :meth:`stop`."""

    def __init__(self, server: Any, thread: threading.Thread, url: str) -> None:
        self._server, self._thread, self.url = server, thread, url

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def stop(self, timeout: float = 10.0) -> None:
        """Ask uvicorn to exit and wait for its thread."""
        self._server.should_exit = True
        self._thread.join(timeout)


def serve_app(app: Any, host: str = "127.0.0.1", port: int = 0, *, name: str = "server",
              log_level: str = "warning", start_timeout: float = 30.0,
              lifespan: Literal["auto", "on", "off"] = "off") -> ServerHandle:
    """Serve ``app`` in a daemon thread; ``port=0`` picks a free port. Returns once listening."""
    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=log_level, lifespan=lifespan,
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name=f"rollpatch-{name}-{bound}", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RollpatchError(f"{name} server did not start", host=host, port=bound)
        time.sleep(0.01)
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    return ServerHandle(server, thread, f"http://{shown}:{bound}")
