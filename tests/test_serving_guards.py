"""The slow-client guards of rollpatch.serving.protocols on both HTTP parsers (h11, httptools).

Each test runs a real server (``serve_app`` on loopback, uvicorn) with a small ASGI app and
talks to it over raw sockets, as a hostile or careless client would: heads trickled or never
sent, heads too large, bodies that trickle after a refusal, pipelined requests, idle
keep-alive, more connections than allowed. The sidecar's own behaviour on the fast parser (a
client leaving mid-stream frees its slot) is tested in test_sidecar.py, which runs it there.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("uvicorn", reason="the web extra installs uvicorn")

from rollpatch.errors import ConfigError, LimitError
from rollpatch.serving import ServeOptions, ServerHandle, serve_app
from rollpatch.serving.body import BodyLimits, read_body
from rollpatch.serving.protocols import LINGER_S, http_name

KINDS = ["h11", "fast"]


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """/refuse answers 413 without reading the body; /echo reads it (1 s to arrive) and
    answers its length; anything else answers its path."""
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    from starlette.requests import Request

    status, body = 200, scope["path"].encode()
    if scope["path"] == "/refuse":
        status, body = 413, b"too large"
    elif scope["path"] == "/echo":
        try:
            got = await read_body(Request(scope, receive), BodyLimits(timeout_s=1.0))
            body = str(len(got)).encode()
        except LimitError as e:
            status, body = 408, str(e).encode()
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(params=KINDS)
def server(request: pytest.FixtureRequest) -> Iterator[ServerHandle]:
    opts = ServeOptions(header_timeout_s=1.0, keep_alive_s=1.0, max_header_bytes=8192)
    handle = serve_app(_app, name="guards", options=opts, http=request.param, loop="fast")
    yield handle
    handle.stop()


def _connect(server: ServerHandle) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=30)


def _until_closed(sock: socket.socket) -> bytes:
    got = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return got + b"<reset>"
        if not chunk:
            return got
        got += chunk


def _served(server: ServerHandle) -> bool:
    return httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_the_fast_parser_is_httptools_here() -> None:
    pytest.importorskip("httptools", reason="the web extra installs httptools")
    assert http_name("fast") == "httptools"
    assert http_name("h11") == "h11"
    with pytest.raises(ConfigError, match="http"):
        serve_app(_app, http="nginx")  # type: ignore[arg-type]


def test_silent_and_trickling_heads_get_408_and_are_closed(server: ServerHandle) -> None:
    silent, trickle, blank = _connect(server), _connect(server), _connect(server)
    try:
        trickle.sendall(b"GET /x HTTP/1.1\r\nX-Slow: ")
        for _ in range(4):  # one byte at a time, never a whole head
            time.sleep(0.3)
            for s, byte in ((trickle, b"a"), (blank, b"\r\n")):
                try:
                    s.sendall(byte)
                except OSError:
                    pass  # already cut
            assert _served(server)  # others are served meanwhile
        said = [_until_closed(s) for s in (silent, trickle, blank)]
    finally:
        for s in (silent, trickle, blank):
            s.close()
    assert said[0].startswith(b"HTTP/1.1 408") and said[1].startswith(b"HTTP/1.1 408"), said
    # empty lines before a head: refused at once (h11) or cut at the deadline (httptools)
    assert said[2][:12] in (b"HTTP/1.1 408", b"HTTP/1.1 400"), said
    assert _served(server)


def test_a_head_after_a_keep_alive_pause_gets_its_own_deadline(server: ServerHandle) -> None:
    s = _connect(server)
    try:
        for i in range(3):  # each head complete: served, however long the connection lives
            s.sendall(f"GET /k{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert s.recv(65536).endswith(f"/k{i}".encode())
            time.sleep(0.6)  # under keep-alive (1 s); total well over the head deadline
        s.sendall(b"GET /late HTTP/1.1\r\n")  # then a head that never ends
        said = _until_closed(s)
    finally:
        s.close()
    assert said.startswith(b"HTTP/1.1 408"), said


def test_an_idle_keep_alive_connection_is_closed(server: ServerHandle) -> None:
    s = _connect(server)
    try:
        s.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        t0 = time.monotonic()
        said = _until_closed(s)
    finally:
        s.close()
    assert said.startswith(b"HTTP/1.1 200") and said.endswith(b"/a"), said
    assert time.monotonic() - t0 < 20  # closed by the server (keep-alive 1 s), not by us


@pytest.mark.parametrize("split", [False, True])
def test_an_oversized_head_gets_400_and_is_not_buffered(server: ServerHandle, split: bool) -> None:
    s = _connect(server)
    head = b"GET /big HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n"
    try:
        try:
            if split:  # in small pieces: the bound holds across reads
                for i in range(0, len(head), 4096):
                    s.sendall(head[i : i + 4096])
            else:
                s.sendall(head)
        except OSError:
            pass  # the server may cut us off mid-send
        said = _until_closed(s)
    finally:
        s.close()
    assert said.startswith(b"HTTP/1.1 400"), said[:100]  # not a reset, however it was sent
    assert _served(server)


def test_a_large_body_behind_a_small_head_is_not_taken_for_a_head(server: ServerHandle) -> None:
    """One send of a small head and a body 8x the head bound: the body is read in full."""
    body = b"x" * 65536
    s = _connect(server)
    try:
        s.sendall(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        got = s.recv(65536)
    finally:
        s.close()
    assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"65536"), got


def test_an_answer_before_the_body_closes_a_trickling_body(server: ServerHandle) -> None:
    s = _connect(server)
    try:
        s.sendall(b"POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nab")
        time.sleep(0.2)
        try:
            s.sendall(b"cd")
        except OSError:
            pass
        said = _until_closed(s)
    finally:
        s.close()
    assert said.startswith(b"HTTP/1.1 413"), said


def test_a_refused_upload_reads_its_answer_not_a_reset(server: ServerHandle) -> None:
    """A client still sending a large body when it is refused reads the refusal: the server
    closed with that body unread, and the kernel's reset lost the 413 (a lingering close
    drains it instead)."""
    s = _connect(server)
    sent: list[BaseException] = []

    def upload() -> None:
        try:
            s.sendall(b" " * (32 << 20))
        except OSError as e:
            sent.append(e)

    try:
        s.sendall(b"POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (32 << 20))
        pump = threading.Thread(target=upload)
        pump.start()
        said = _until_closed(s)
        pump.join(timeout=30)
    finally:
        s.close()
    assert said.startswith(b"HTTP/1.1 413") and said.endswith(b"too large"), said[:200]
    assert not sent, sent  # the whole body was taken (and dropped) while lingering
    assert _served(server)


def test_lingering_after_a_refusal_is_bounded(server: ServerHandle) -> None:
    """A client that keeps sending after its answer is cut off after LINGER_S (longer than
    this server's keep-alive, which no longer applies)."""
    s = _connect(server)
    try:
        s.sendall(b"POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n")
        t0 = time.monotonic()
        cut = None
        while time.monotonic() - t0 < LINGER_S + 20:
            try:
                s.sendall(b"x" * 1024)
            except OSError:
                cut = time.monotonic() - t0
                break
            time.sleep(0.05)
        said = _until_closed(s)
    finally:
        s.close()
    assert said.startswith(b"HTTP/1.1 413"), said[:200]
    assert cut is not None and cut >= LINGER_S - 0.5, cut


def test_a_slow_body_gets_408_and_the_connection_is_closed(server: ServerHandle) -> None:
    s = _connect(server)
    try:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        said = _until_closed(s)
    finally:
        s.close()
    assert said.startswith(b"HTTP/1.1 408") and b"not received within" in said, said


def test_pipelined_requests_are_answered_in_order(server: ServerHandle) -> None:
    s = _connect(server)
    try:
        s.sendall(
            b"GET /one HTTP/1.1\r\nHost: x\r\n\r\n"
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
            b"GET /three HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        said = _until_closed(s)
    finally:
        s.close()
    answers = said.split(b"HTTP/1.1 200")
    assert len(answers) == 4, said
    assert answers[1].endswith(b"/one") and answers[2].endswith(b"3")
    assert answers[3].endswith(b"/three")


def test_a_pipelined_body_still_arriving_is_not_cut_by_the_answer_before_it(
    server: ServerHandle,
) -> None:
    s = _connect(server)
    try:
        s.sendall(
            b"GET /one HTTP/1.1\r\nHost: x\r\n\r\n"
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\nConnection: close\r\n\r\nabc"
        )
        time.sleep(0.3)  # /one is answered meanwhile; the second body is half there
        s.sendall(b"def")
        said = _until_closed(s)
    finally:
        s.close()
    answers = said.split(b"HTTP/1.1 200")
    assert len(answers) == 3 and answers[1].endswith(b"/one") and answers[2].endswith(b"6"), said


@pytest.mark.parametrize("kind", KINDS)
def test_connections_over_the_bound_get_503(kind: str) -> None:
    handle = serve_app(_app, options=ServeOptions(max_connections=2), http=kind)  # type: ignore[arg-type]
    held = [_connect(handle) for _ in range(2)]
    try:
        time.sleep(0.2)
        r = httpx.get(f"{handle.url}/x", timeout=10)
        assert r.status_code == 503
    finally:
        for s in held:
            s.close()
        handle.stop()


def test_idle_connections_outlive_the_clients_keep_alive() -> None:
    """A server that closes an idle connection just as a client reuses it fails that request
    (a read error): the default keep-alive must outlast the idle expiry of the clients in
    front of rollpatch's servers (httpx, hence the openai client; rollpatch's own pool)."""
    import inspect

    from rollpatch.serving.upstream import Upstream

    ours = inspect.signature(Upstream).parameters["keepalive_expiry_s"].default
    assert ServeOptions().keep_alive_s > max(httpx.Limits().keepalive_expiry or 0.0, ours)
