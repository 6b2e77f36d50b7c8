"""The relay client's keep-alive connections (rollpatch.store.http_pool): one connection
serves many requests, error answers leave it reusable, a connection the server closed while
idle is replaced at once, and threads never share a connection mid-request."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rollpatch.errors import NotFoundError, TransientStoreError
from rollpatch.relay import RelayConfig, RelayServer
from rollpatch.store import MemoryStore, open_store
from rollpatch.store.http_client import HttpStore


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[tuple[MemoryStore, RelayServer]]:
    origin = MemoryStore("origin")
    server = RelayServer(origin, RelayConfig(cache_dir=tmp_path / "cache"))
    server.start()
    yield origin, server
    server.stop()


def _client(url: str) -> HttpStore:
    store = open_store(url, retries=0)
    assert isinstance(store, HttpStore)
    return store


def test_one_connection_serves_many_requests(relay: tuple[MemoryStore, RelayServer]) -> None:
    origin, server = relay
    for i in range(5):
        origin.put(f"runs/r/k{i}", bytes([i]) * 1000)
    c = _client(server.url)
    for _ in range(3):
        for i in range(5):
            assert c.get(f"runs/r/k{i}") == bytes([i]) * 1000
            assert c.get_range(f"runs/r/k{i}", 10, 20) == bytes([i]) * 10
            info = c.head(f"runs/r/k{i}")
            assert info is not None and info.size == 1000
        assert c.list("runs/r/") == [f"runs/r/k{i}" for i in range(5)]
        with pytest.raises(NotFoundError):  # an error answer: its body read, reusable
            c.get("runs/r/missing")
        assert c.head("runs/r/missing") is None
    assert c._pool.opened == 1


def test_threads_get_their_own_connections(relay: tuple[MemoryStore, RelayServer]) -> None:
    origin, server = relay
    blobs = {f"runs/r/t{i}": bytes([i % 251]) * (50_000 + i) for i in range(32)}
    for k, v in blobs.items():
        origin.put(k, v)
    c = _client(server.url)
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            got = dict(zip(blobs, pool.map(c.get, blobs)))
            assert got == blobs
    assert 1 <= c._pool.opened <= 4  # never more than the threads at once, then reused


def _request_head(conn: socket.socket) -> bytes:
    """A request's head as the server reads it (b"" when the client closed at once)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def _one_answer_then_close(listener: socket.socket, served: list[int]) -> None:
    """A keep-alive server that drops every connection, idle, after one answer (an idle
    timeout of zero): the client's pooled connection is stale on its next use."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            if not _request_head(conn):
                continue
            body = b"hello"
            served.append(1)  # before the answer: the client may check as soon as it has it
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: keep-alive\r\n\r\n" + body
            )


def test_a_connection_closed_while_idle_is_replaced_at_once() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    served: list[int] = []
    t = threading.Thread(target=_one_answer_then_close, args=(listener, served), daemon=True)
    t.start()
    try:
        c = _client(f"http://127.0.0.1:{listener.getsockname()[1]}")  # retries=0
        for _ in range(3):
            assert c.get("runs/r/x") == b"hello"
        assert len(served) == 3 and c._pool.opened == 3  # each stale one replaced, no error
    finally:
        listener.close()


def _record_one_request(listener: socket.socket, lines: list[bytes], answer: bytes) -> None:
    conn, _ = listener.accept()
    with conn:
        lines.append(_request_head(conn).split(b"\r\n", 1)[0])
        conn.sendall(answer)


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_proxies_from_the_environment(scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``http_proxy``/``https_proxy`` as urllib reads them: an http request goes to the proxy
    in absolute form, an https one asks the proxy for a CONNECT tunnel; ``no_proxy`` bypasses."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    lines: list[bytes] = []
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        if scheme == "http"
        else b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n"
    )
    t = threading.Thread(target=_record_one_request, args=(listener, lines, answer), daemon=True)
    t.start()
    monkeypatch.setenv(f"{scheme}_proxy", f"http://127.0.0.1:{listener.getsockname()[1]}")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    try:
        c = _client(f"{scheme}://relay.example:8443/base")
        if scheme == "http":
            assert c.get("runs/r/x") == b"ok"
            assert lines == [b"GET http://relay.example:8443/base/v1/objects/runs/r/x HTTP/1.1"]
        else:
            with pytest.raises(TransientStoreError):  # the proxy refused the tunnel
                c.get("runs/r/x")
            assert lines == [b"CONNECT relay.example:8443 HTTP/1.0"]
        monkeypatch.setenv("no_proxy", "relay.example")
        assert _client(f"{scheme}://relay.example:8443")._pool.proxy is None
    finally:
        listener.close()


def test_a_hung_relay_is_said_at_its_first_timeout(caplog: pytest.LogCaptureFixture) -> None:
    """A relay that accepts and never answers costs ``timeout`` per attempt, and the error
    comes only after every retry: each retried failure is logged when it happens (once a
    minute per kind), not minutes later with the final error."""
    import logging

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    try:
        store = open_store(
            f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=0.2, retries=2, backoff=0.01
        )
        with (
            caplog.at_level(logging.WARNING, "rollpatch.store"),
            pytest.raises(TransientStoreError) as failed,
        ):
            store.get("runs/r/LATEST")
        assert failed.value.context["attempts"] == 3
        said = [r for r in caplog.records if getattr(r, "rp_event", None) == "relay_retry"]
        assert len(said) == 1  # the second retry is held back: once a minute per kind
        fields = said[0].rp_fields  # type: ignore[attr-defined]  # rollpatch.logs.event's
        assert (fields["attempt"], fields["attempts"], fields["object"]) == (1, 3, "runs/r/LATEST")
        assert "timed out" in fields["error"]
    finally:
        listener.close()
