"""Fewer writes per relayed stream (rollpatch.sidecar.relay, issue 10): the answer's head goes
out with the first events, the last events with the client's last chunk when the engine's end
came in their read, and a client that leaves is told by the server's protocol (no task per
stream). The protocol alone against a scripted transport, then live (tests/test_sidecar_tap_live.py's
scripted engine and sidecar).
"""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import time
from typing import Any

import httpx

from rollpatch.serving.streaming import SseRelay
from rollpatch.sidecar import proxy, relay
from rollpatch.sidecar.server import RunningSidecar
from tests.test_sidecar_tap import _Cycle, _dechunk, _last, _Resp
from tests.test_sidecar_tap_live import _END, _HEAD, Engine, _event, live, taps

__all__ = ["live", "taps"]  # the live module's fixtures, used here too

HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


def _tap(chunked: bool = True) -> tuple[relay.StreamTap, _Cycle, _Resp, Any]:
    """A tap on a scripted client whose ``send`` writes the head as uvicorn's does."""
    resp, cycle = _Resp(), _Cycle()
    cycle.chunked_encoding = None  # type: ignore[attr-defined]
    tap = relay.StreamTap(resp, SseRelay(_last), cycle)  # type: ignore[arg-type]

    async def send(message: Any) -> None:
        assert message["type"] == "http.response.start"
        cycle.transport.write(HEAD)
        cycle.chunked_encoding = chunked  # type: ignore[attr-defined]

    return tap, cycle, resp, send


def _chunk(i: int) -> bytes:
    data = b'data: {"i": %d}\n\n' % i
    return b"%x\r\n%b\r\n" % (len(data), data)


def test_the_head_goes_out_with_the_first_events() -> None:
    tap, cycle, _, send = _tap()
    assert asyncio.run(tap.begin(send, {"type": "http.response.start"}))
    assert cycle.transport.out == []  # held, and the client's transport is its own again
    tap.data_received(_chunk(0))
    assert cycle.transport.out == []  # the event waits for the next read (the last is held)
    tap.data_received(_chunk(1))
    assert cycle.transport.out == [HEAD + _chunk(0)]  # one write
    tap.data_received(_chunk(2))
    assert cycle.transport.out[1:] == [_chunk(1)]


def test_the_head_is_sent_at_once_when_the_client_is_paused_or_not_chunked() -> None:
    tap, cycle, _, send = _tap()
    cycle.flow.write_paused = True
    assert asyncio.run(tap.begin(send, {"type": "http.response.start"}))
    assert cycle.transport.out == [HEAD]
    tap, cycle, _, send = _tap(chunked=False)
    assert not asyncio.run(tap.begin(send, {"type": "http.response.start"}))
    assert cycle.transport.out == [HEAD]  # out; the task relays this answer


def test_a_head_with_nothing_after_it_goes_out_when_the_tap_ends() -> None:
    tap, cycle, resp, send = _tap()
    asyncio.run(tap.begin(send, {"type": "http.response.start"}))
    resp._conn.buf += b"0\r\n\r\n"  # an empty body
    asyncio.run(tap.run())
    assert cycle.transport.out == [HEAD]  # before anything the task sends


def test_the_last_events_wait_for_the_task_when_the_end_came_with_them() -> None:
    """The events of the read that brought the engine's end (here the whole answer at once)
    are the task's, with the client's last chunk; what went before is out, the head first."""
    tap, cycle, resp, send = _tap()
    asyncio.run(tap.begin(send, {"type": "http.response.start"}))
    tap.keep_tail = True
    tap.data_received(_chunk(0))
    tap.data_received(_chunk(1))
    resp._conn.buf += _chunk(2) + _chunk(3) + _END
    asyncio.run(tap.run())
    tail = tap.tail
    assert (
        tail == b'data: {"i": 1}\n\ndata: {"i": 2}\n\nLAST[data: {"i": 3}]done\n\ndata: [DONE]\n\n'
    )
    assert tap.tail == b""  # taken once
    assert cycle.transport.out == [HEAD + _chunk(0)]
    assert bytes(resp._conn.buf) == b"0\r\n\r\n"  # the end is the pool reader's
    # the whole answer in one read: the head alone, then the task's one write
    tap, cycle, resp, send = _tap()
    asyncio.run(tap.begin(send, {"type": "http.response.start"}))
    tap.keep_tail = True
    resp._conn.buf += _chunk(0) + _END
    asyncio.run(tap.run())
    assert tap.tail == b'LAST[data: {"i": 0}]done\n\ndata: [DONE]\n\n'
    assert cycle.transport.out == [HEAD]


def test_an_end_in_a_later_read_holds_nothing_back() -> None:
    """[DONE] in a read of its own: out at once, not held for the engine's end."""
    tap, cycle, _, _ = _tap()
    tap.keep_tail = True
    tap.data_received(_chunk(0))
    tap.data_received(b"e\r\ndata: [DONE]\n\n\r\n")
    assert _dechunk(b"".join(cycle.transport.out) + b"0\r\n\r\n").endswith(b"data: [DONE]\n\n")
    tap.data_received(b"0\r\n\r\n")
    assert tap.tail == b""


def test_without_keep_tail_the_tap_writes_every_event() -> None:
    tap, cycle, resp, _ = _tap()
    resp._conn.buf += _chunk(0) + _END
    asyncio.run(tap.run())
    assert tap.tail == b""
    assert _dechunk(b"".join(cycle.transport.out) + b"0\r\n\r\n").endswith(b"data: [DONE]\n\n")


def _raw_stream(sc: RunningSidecar) -> list[bytes]:
    """One streamed completion on a raw socket: what each ``recv`` brought, to the end."""
    body = json.dumps({"model": "m", "prompt": "p", "stream": True}).encode()
    port = int(sc.url.rsplit(":", 1)[1])
    reads: list[bytes] = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(body), body)
        )
        while not b"".join(reads).endswith(b"\r\n0\r\n\r\n"):
            data = s.recv(65536)
            assert data, b"".join(reads)
            reads.append(data)
    return reads


def test_live_the_head_never_goes_out_alone(
    live: tuple[Engine, RunningSidecar], taps: list[int]
) -> None:
    engine, sc = live

    def script(n: int, t: Any) -> None:
        t.write(_HEAD)  # the head alone, events well after it
        for i in range(3):
            engine.later(0.05 * (i + 1), functools.partial(t.write, _event(i)))
        engine.later(0.2, lambda: t.write(_END))

    engine.script = script
    reads = _raw_stream(sc)
    head, _, rest = reads[0].partition(b"\r\n\r\n")
    assert b"x-rollpatch-version-start: 0" in head
    assert b"t0" in rest, reads  # the first event came in the head's write
    body = _dechunk(b"".join(reads).partition(b"\r\n\r\n")[2])
    texts = [json.loads(x[6:])["choices"][0]["text"] for x in body.split(b"\n\n")[:-2]]
    assert texts == [" t0", " t1", " t2"]
    assert body.endswith(b"data: [DONE]\n\n")
    assert taps[0] == 1


def test_live_a_whole_answer_in_one_read(
    live: tuple[Engine, RunningSidecar], taps: list[int]
) -> None:
    engine, sc = live
    engine.script = lambda n, t: t.write(_HEAD + _event(0) + _event(1) + _event(2) + _END)
    with httpx.Client(timeout=10) as client:
        for _ in range(3):
            body = {"model": "m", "prompt": "p", "stream": True}
            with client.stream("POST", f"{sc.url}/v1/completions", json=body) as r:
                lines = [line for line in r.iter_lines() if line]
            assert [json.loads(x[5:])["choices"][0]["text"] for x in lines[:-1]] == [
                " t0",
                " t1",
                " t2",
            ]
            assert json.loads(lines[-2][5:])["rollpatch"] == {"version_start": 0, "version_end": 0}
            assert lines[-1] == "data: [DONE]"
    assert taps[0] == 3
    assert sc.sidecar.gate.inflight == 0


def test_live_a_client_leaving_is_told_by_the_protocol(
    live: tuple[Engine, RunningSidecar], taps: list[int], monkeypatch: Any
) -> None:
    """No task waits for ``http.disconnect`` on the tap's streams: the server's protocol
    calls the stream's hook, which closes the engine connection."""
    engine, sc = live
    watchers: list[int] = []
    real = proxy._disconnect

    async def counted(receive: Any) -> None:
        watchers.append(1)
        await real(receive)

    monkeypatch.setattr(proxy, "_disconnect", counted)

    def script(n: int, t: Any) -> None:
        t.write(_HEAD)

        def tick(i: int = 0) -> None:
            if not t.is_closing():
                t.write(_event(i))
                engine.later(0.005, lambda: tick(i + 1))

        tick()

    engine.script = script
    lost = engine.lost
    with httpx.Client(timeout=10) as client:
        body = {"model": "m", "prompt": "p", "stream": True}
        with client.stream("POST", f"{sc.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert sum(next(lines).startswith("data:") for _ in range(6)) == 3
    deadline = time.monotonic() + 10
    while engine.lost == lost and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.lost > lost, "the engine connection stayed open after the client left"
    while sc.sidecar.gate.inflight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sc.sidecar.gate.inflight == 0
    assert taps[0] == 1
    assert watchers == []
