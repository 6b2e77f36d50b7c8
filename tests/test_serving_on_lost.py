"""The guarded protocols' ``on_lost`` hook (rollpatch.serving.protocols), on both parsers: a
handler that set it mid-answer is called once when its client goes away, after uvicorn has
marked the request disconnected; a hook cleared before the loss is not called."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import pytest

pytest.importorskip("uvicorn", reason="the web extra installs uvicorn")

from rollpatch.serving import serve_app

KINDS = ["h11", "fast"]


class _App:
    """Answers with a head and one chunk, sets (or sets and clears) the connection's hook,
    then waits for ``http.disconnect``."""

    def __init__(self) -> None:
        self.calls: list[bool] = []  # per call: the request was marked disconnected
        self.done = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        cycle = send.__self__
        proto = cycle.transport.get_protocol()
        assert proto.on_lost is None
        proto.on_lost = lambda: self.calls.append(cycle.disconnected)
        if scope["path"] == "/cleared":
            proto.on_lost = None
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x", "more_body": True})
        while (await receive())["type"] != "http.disconnect":
            pass
        await asyncio.sleep(0.05)  # a hook called late would show up by now
        self.done.set()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", ["/set", "/cleared"])
def test_on_lost_is_called_once_when_the_client_leaves(kind: str, path: str) -> None:
    app = _App()
    handle = serve_app(app, name="on-lost", http=kind, loop="fast")  # type: ignore[arg-type]
    try:
        port = int(handle.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
            got = b""
            while not got.endswith(b"1\r\nx\r\n"):
                got += s.recv(4096)
        assert app.done.wait(10)
        deadline = time.monotonic() + 2
        while path == "/set" and not app.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert app.calls == ([True] if path == "/set" else [])
    finally:
        handle.stop()
