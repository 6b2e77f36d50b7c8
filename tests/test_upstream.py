"""The sidecar's upstream client (rollpatch.serving.upstream) against real sockets: framing
(Content-Length, chunked split anywhere, until close), keep-alive reuse, a pooled connection
closed by the server is retried once, and every malformed or oversized answer is an
UpstreamError (never a hang, never a partial body taken for a whole one)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from rollpatch.errors import ConfigError
from rollpatch.serving.streaming import DONE, SseRelay
from rollpatch.serving.upstream import MAX_HEAD, Upstream, UpstreamError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


#: The event loops the client runs on: asyncio's, and uvloop (the sidecar's, when installed;
#: its transports are not asyncio.Transport subclasses, and it may report a connection made
#: after create_connection returns).
LOOPS = ["asyncio", "uvloop"]


def _run(
    handler: Handler, client: Callable[[Upstream], Awaitable[object]], loop: str = "asyncio"
) -> object:
    async def main() -> object:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        up = Upstream(
            f"http://127.0.0.1:{port}", connect_s=5, max_connections=4, keepalive_expiry_s=5
        )
        try:
            return await asyncio.wait_for(client(up), 20)
        finally:
            await up.aclose()
            server.close()
            await server.wait_closed()

    if loop == "asyncio":
        return asyncio.run(main())
    uvloop = pytest.importorskip("uvloop", reason="the web extra installs uvloop")
    ev = uvloop.new_event_loop()
    try:
        return ev.run_until_complete(main())
    finally:
        ev.close()


def _answers(*answers: list[bytes], close: bool = False) -> tuple[Handler, list[bytes]]:
    """A server that answers its n-th request on a connection with ``answers[n]`` (written
    piece by piece, each on its own after a pause), then closes if ``close``."""
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for pieces in answers:
            try:
                seen.append(await _read_request(reader))
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.005)
        if close:
            writer.close()
        else:
            await reader.read()  # until the client closes
            writer.close()

    return handler, seen


@pytest.mark.parametrize("loop", LOOPS)
def test_content_length_and_keep_alive_reuse_one_connection(loop: str) -> None:
    connections = []
    ok = [b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n", b"content-length: 8\r\n\r\n"]
    ok += [b'{"a":', b"1}\n"]
    inner, seen = _answers(ok, ok)

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        connections.append(1)
        await inner(r, w)

    async def client(up: Upstream) -> list[tuple[int, bytes, bytes | None]]:
        out = []
        for _ in range(2):
            resp = await up.request("POST", "/v1/completions", b'{"x":1}', ((b"x-a", b"b"),))
            try:
                out.append((resp.status, await resp.read(), resp.header(b"content-type")))
            finally:
                resp.close()
        return out

    assert _run(handler, client, loop) == [(200, b'{"a":1}\n', b"application/json")] * 2
    assert len(connections) == 1  # the second request reused the first connection
    assert seen[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"\r\ncontent-length: 7\r\n" in seen[0] and b"\r\nx-a: b\r\n" in seen[0]
    assert seen[0].endswith(b'\r\n\r\n{"x":1}')


@pytest.mark.parametrize("loop", LOOPS)
def test_many_sequential_and_concurrent_requests_reuse_bounded_connections(loop: str) -> None:
    """Keep-alive reuse, counted: 40 requests one after another open one connection, then
    10 rounds of 8 at once (``max_connections`` 4) open at most 4 in all, as the server sees
    and as :attr:`Upstream.opened` (the sidecar's engine_connections_opened) reports."""
    connections = []
    answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\ndata\r\n0\r\n\r\n"

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        connections.append(1)
        while True:
            try:
                await _read_request(r)
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            w.write(answer)
            await w.drain()
        w.close()

    async def one(up: Upstream) -> bytes:
        resp = await up.request("POST", "/v1/completions", b"{}")
        try:
            return await resp.read()
        finally:
            resp.close()

    async def client(up: Upstream) -> tuple[int, int]:
        assert [await one(up) for _ in range(40)] == [b"data"] * 40
        after_sequential = up.opened
        for _ in range(10):
            assert await asyncio.gather(*(one(up) for _ in range(8))) == [b"data"] * 8
        return after_sequential, up.opened

    assert _run(handler, client, loop) == (1, len(connections))
    assert len(connections) <= 4


@pytest.mark.parametrize("loop", LOOPS)
def test_chunked_split_anywhere_and_the_sse_relay_on_top(loop: str) -> None:
    events = b'data: {"n":1}\n\ndata: {"n":2}\n\n: keep-alive\n\ndata: [DONE]\n\n'
    body = b""
    for i in range(0, len(events), 9):  # chunks of 9 bytes, each written in 3 pieces
        part = events[i : i + 9]
        body += f"{len(part):x};ext=1\r\n".encode() + part + b"\r\n"
    body += b"0\r\nx-trailer: t\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    pieces = [head] + [body[i : i + 5] for i in range(0, len(body), 5)]
    handler, _ = _answers(pieces)

    async def client(up: Upstream) -> tuple[bytes, list[bytes]]:
        resp = await up.request("POST", "/s", b"{}")
        relay = SseRelay(lambda line, done: b"LAST" + line + b"\n\n" if done else line)
        out, raw = [], b""
        try:
            async for piece in resp.chunks():
                raw += piece
                out.append(relay.feed(piece))
            out.append(relay.finish())
        finally:
            resp.close()
        return raw, [o for o in out if o]

    raw, out = _run(handler, client, loop)  # type: ignore[misc]
    assert raw == events
    assert b"".join(out) == b'data: {"n":1}\n\nLASTdata: {"n":2}\n\n' + DONE


@pytest.mark.parametrize("size", ["{:x}", "{:X}", "00{:x}", "{:x} ", " {:x};a=b"])
def test_chunk_size_lines_read_by_piece(size: str) -> None:
    """piece() reads a chunk-size line of hex digits alone without a split (the common
    line); padded, upper-case or extended lines give the same bytes by the general parse."""
    events = b'data: {"n":1}\n\ndata: {"n":22}\n\ndata: [DONE]\n\n'
    parts = [events[:7], events[7:40], events[40:]]
    body = b"".join(size.format(len(p)).encode() + b"\r\n" + p + b"\r\n" for p in parts)
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    handler, _ = _answers([head, body[:11], body[11:30], body[30:] + b"0\r\n\r\n"])

    async def client(up: Upstream) -> bytes:
        resp = await up.request("POST", "/s", b"{}")
        raw = b""
        try:
            while piece := await resp.piece():
                raw += piece
        finally:
            resp.close()
        return raw

    assert _run(handler, client) == events


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("pause_s", [0.0, 0.05])  # 0: the close is seen only on reuse
def test_a_pooled_connection_closed_by_the_server_is_retried_once(
    pause_s: float, loop: str
) -> None:
    ok = [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]
    handler, seen = _answers(ok, close=True)  # one answer per connection, then closed

    async def client(up: Upstream) -> list[bytes]:
        out = []
        for _ in range(3):
            resp = await up.request("POST", "/", b"{}")
            try:
                out.append(await resp.read())
            finally:
                resp.close()
            await asyncio.sleep(pause_s)  # 0.05: the close reaches the pooled connection
        return out

    assert _run(handler, client, loop) == [b"ok"] * 3
    assert len(seen) == 3


@pytest.mark.parametrize(
    "answer, match",
    [
        ([b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort"], "closed the connection"),
        ([b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"], "bad chunk size"),
        ([b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabcXY"], "CRLF"),
        ([b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"1" * 5000], "too long"),
        ([b"SPDY 200 OK\r\n\r\n"], "bad status line"),
        ([b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"], "bad header line"),
        ([b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n"], "Content-Length"),
        ([b"HTTP/1.1 200 OK\r\nx: " + b"a" * MAX_HEAD], "over"),
    ],
)
def test_malformed_answers_are_upstream_errors(answer: list[bytes], match: str) -> None:
    handler, _ = _answers(answer, close=True)

    async def client(up: Upstream) -> None:
        resp = await up.request("POST", "/", b"{}")
        try:
            await resp.read()
        finally:
            resp.close()

    with pytest.raises(UpstreamError, match=match):
        _run(handler, client)


def test_a_body_until_close_and_a_1xx_before_the_answer() -> None:
    handler, _ = _answers(
        [b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 404 Not Found\r\n\r\n", b"no", b" route"],
        close=True,
    )

    async def client(up: Upstream) -> tuple[int, bytes]:
        resp = await up.request("POST", "/", b"{}")
        try:
            return resp.status, await resp.read()
        finally:
            resp.close()

    assert _run(handler, client) == (404, b"no route")


def test_unreachable_and_bad_urls() -> None:
    async def main() -> None:
        sock_server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = sock_server.sockets[0].getsockname()[1]
        sock_server.close()
        await sock_server.wait_closed()
        up = Upstream(f"http://127.0.0.1:{port}", connect_s=2, max_connections=1)
        with pytest.raises(UpstreamError, match="cannot connect"):
            await up.request("POST", "/", b"{}")
        with pytest.raises(UpstreamError, match="cannot connect"):  # the slot came back
            await asyncio.wait_for(up.request("POST", "/", b"{}"), 5)

    asyncio.run(main())
    with pytest.raises(ConfigError):
        Upstream("unix:///tmp/x", connect_s=1, max_connections=1)
