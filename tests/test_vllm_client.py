"""The vLLM adapter's HTTP client (rollpatch.engines.vllm.client.Http) against a raw socket
server that closes kept-alive connections the way a loaded server does: a request that met a
reused connection the server had closed is sent once more on a fresh one; a fresh connection
that fails, or a server that is gone, is an EngineError (never a second send)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rollpatch.engines.vllm.client import Http
from rollpatch.errors import EngineError

#: What the server does with each request it reads, by order across all connections:
#: "answer" (keep-alive), "close" (read it, close without answering: not processed).
Script = list[str]


def _read_request(conn: socket.socket) -> bytes | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v)
    while len(rest) < length:
        rest += conn.recv(65536)
    return rest


class _Server:
    """One thread; ``close_after``: the connection is closed after that many answers (the
    server dropping a kept-alive connection between two requests)."""

    def __init__(self, script: Script, close_after: int) -> None:
        self.script, self.close_after = list(script), close_after
        self.bodies: list[bytes] = []
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.script:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                answered = 0
                while self.script and answered < self.close_after:
                    body = _read_request(conn)
                    if body is None:
                        break
                    self.bodies.append(body)
                    if self.script.pop(0) == "close":
                        break
                    out = json.dumps({"n": len(self.bodies)}).encode()
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        b"Content-Length: " + str(len(out)).encode() + b"\r\n\r\n" + out
                    )
                    answered += 1

    def close(self) -> None:
        self.sock.close()


Serve = Callable[..., Any]  # (script, close_after=...) -> _Server


@pytest.fixture
def serve() -> Iterator[Serve]:
    made: list[_Server] = []

    def make(script: Script, close_after: int = 1000) -> _Server:
        made.append(_Server(script, close_after))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_a_connection_the_server_dropped_is_replaced_once(serve: Serve) -> None:
    srv = serve(["answer", "answer", "answer"], close_after=1)  # every connection: one answer
    http = Http(srv.url, timeout=10)
    assert http.post("/a", {"i": 1}) == {"n": 1}
    # the kept-alive connection is closed by now: the next request is sent again, fresh
    assert http.post("/b", {"i": 2}) == {"n": 2}
    assert http.post("/c", {"i": 3}) == {"n": 3}
    assert srv.connections == 3 and len(srv.bodies) == 3  # no request read twice


def test_a_request_the_server_read_and_dropped_on_a_reused_connection_is_sent_again(
    serve: Serve,
) -> None:
    srv = serve(["answer", "close", "answer"])
    http = Http(srv.url, timeout=10)
    assert http.post("/a", {"i": 1}) == {"n": 1}
    assert http.post("/b", {"i": 2}) == {"n": 3}  # closed without an answer: sent again
    assert [json.loads(b)["i"] for b in srv.bodies] == [1, 2, 2]


def test_a_fresh_connection_that_fails_is_not_retried(serve: Serve) -> None:
    srv = serve(["close", "answer"])
    http = Http(srv.url, timeout=10)
    with pytest.raises(EngineError, match="not reachable"):
        http.post("/a", {"i": 1})
    assert len(srv.bodies) == 1  # sent once: a fresh connection's failure is the server's
    assert http.post("/b", {"i": 2}) == {"n": 2}  # and the client goes on


def test_a_server_that_is_gone_is_an_engine_error(serve: Serve) -> None:
    srv = serve(["answer"])
    http = Http(srv.url, timeout=10)
    assert http.post("/a", {}) == {"n": 1}
    srv.close()
    srv.thread.join(10)
    with pytest.raises(EngineError, match="not reachable"):
        http.post("/b", {})
