"""The sidecar's stream relay in the engine connection's protocol (rollpatch.sidecar.relay,
issue 10): the same events as the task's relay for any framing and split, the connection back
to the pool after the last chunk, and every way a stream ends — the engine failing, a bad
chunk, a client that leaves, a client that reads slowly (the engine is held, not buffered).
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from rollpatch.engines.base import EngineAdapter
from rollpatch.follower import FollowerConfig
from rollpatch.formats import cast_view
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.serving.streaming import SseRelay
from rollpatch.serving.upstream import UpstreamError
from rollpatch.sidecar import SidecarConfig, relay
from rollpatch.sidecar.server import RunningSidecar, start_sidecar

# -- the protocol alone, against the task's relay ------------------------------------------------


class _Transport:
    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.protocol: Any = None
        self.reading = True

    def write(self, b: bytes) -> None:
        self.out.append(b)

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def set_protocol(self, p: Any) -> None:
        self.protocol = p

    def get_protocol(self) -> Any:
        return self.protocol


class _Flow:
    write_paused = False


class _Cycle:
    def __init__(self) -> None:
        self.disconnected = False
        self.flow = _Flow()
        self.transport = _Transport()


class _Conn:
    def __init__(self) -> None:
        self.transport = _Transport()
        self.buf = bytearray()
        self.eof = False
        self.paused = False


class _Resp:
    def __init__(self) -> None:
        self._conn = _Conn()


EVENTS = [
    b'data: {"a": 1}\n\n',
    b'data: {"t": "line\\nbreak"}\n\n',
    b'data:{"b":2}\n\n',
    b'data: {"d": "[DONE]"}\n\n',
    b": ping\n\n",
    b'event: x\ndata: {"c":3}\n\n',
    b"data: crlf\r\n\r\n",
    b"data: e\ndata: f\n\n",
]


def _last(line: bytes, done: bool) -> bytes:
    return b"LAST[" + line + (b"]done" if done else b"]open") + b"\n\n"


def _dechunk(raw: bytes) -> bytes:
    """The body of a chunked message (asserting it is well framed and complete)."""
    out: list[bytes] = []
    pos = 0
    while True:
        nl = raw.index(b"\r\n", pos)
        size = int(raw[pos:nl], 16)
        if size == 0:
            assert raw[nl:] == b"\r\n\r\n", raw[nl:]
            return b"".join(out)
        out.append(raw[nl + 2 : nl + 2 + size])
        assert raw[nl + 2 + size : nl + 4 + size] == b"\r\n"
        pos = nl + 4 + size


def _chunked(rng: random.Random, body: bytes) -> tuple[bytes, list[int]]:
    """``body`` in chunks as engines write them (one per event) or cut anywhere, with size
    lines in either case, zero-padded or with an extension now and then; then the end.
    Also: where each chunk ends."""
    parts: list[bytes] = []
    if rng.random() < 0.5:
        rest = body
        while rest:
            i = rest.find(b"\n\n")
            n = len(rest) if i < 0 else i + 2
            parts.append(rest[:n])
            rest = rest[n:]
    else:
        cuts = sorted(rng.sample(range(1, len(body)), min(len(body) - 1, 4))) if body else []
        parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    out, ends = b"", []
    for p in parts:
        size = rng.choice([b"%x" % len(p), b"%X" % len(p), b"00%x" % len(p), b"%x;ext=1" % len(p)])
        out += size + b"\r\n" + p + b"\r\n"
        ends.append(len(out))
    return out + rng.choice([b"0\r\n\r\n", b"0\r\nx-trailer: 1\r\n\r\n"]), ends


def _through_tap(reads: list[bytes]) -> tuple[bytes, relay.StreamTap, _Resp]:
    resp, cycle = _Resp(), _Cycle()
    done: list[bytes] = []
    tap = relay.StreamTap(resp, SseRelay(_last, on_done=lambda: done.append(b"")), cycle)  # type: ignore[arg-type]
    for r in reads:
        tap.data_received(r)
    tap._flush_held()  # as StreamTap.run does on its way out; then the task ends the relay
    end = tap._relay.finish()
    if end:
        cycle.transport.out.append(b"%x\r\n%b\r\n" % (len(end), end))
    body = b"".join(cycle.transport.out)
    return body, tap, resp


def test_the_tap_sends_the_events_of_the_task_relay_for_any_framing_and_split() -> None:
    rng = random.Random(10)
    for _ in range(3000):
        events = [rng.choice(EVENTS) for _ in range(rng.randint(0, 6))]
        if rng.random() < 0.7:
            events.append(b"data: [DONE]\n\n")
        body = b"".join(events)
        raw, ends = _chunked(rng, body)
        if rng.random() < 0.5:  # reads cut anywhere
            cuts = sorted(rng.sample(range(1, len(raw)), min(len(raw) - 1, rng.randint(0, 6))))
        else:  # reads of whole chunks (the common case: one or more events per read)
            cuts = [e for e in ends if rng.random() < 0.7]
        reads = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
        # the reference: the task's relay over the de-chunked body
        ref = SseRelay(_last, on_done=lambda: None)
        want = ref.feed(body) + ref.finish()
        got, tap, resp = _through_tap(reads)
        # what the client gets is chunked: its body is the reference's bytes exactly
        assert tap._ended
        client = got if not got else _dechunk(got + b"0\r\n\r\n")
        assert client == want, (reads, client, want)
        # the engine's last chunk and trailers go back to the pool's reader
        assert bytes(resp._conn.buf).startswith(b"0")


def test_events_keep_their_order_when_the_general_path_held_one() -> None:
    """A read of two chunks leaves the relay holding the second event; the single-chunk reads
    after it must not overtake it."""

    def chunk(e: bytes) -> bytes:
        return b"%x\r\n%b\r\n" % (len(e), e)

    ev = [b'data: {"a": %d}\n\n' % i for i in range(4)]
    reads = [chunk(ev[0]) + chunk(ev[1]), chunk(ev[2]), chunk(ev[3]), _END]
    got, _, _ = _through_tap(reads)
    assert _dechunk(got + b"0\r\n\r\n") == (
        ev[0] + ev[1] + ev[2] + b'LAST[data: {"a": 3}]done\n\ndata: [DONE]\n\n'
    )


def test_a_whole_plain_chunk_goes_out_as_it_came() -> None:
    ev = b'data: {"x": 1}\n\n'
    chunk = b"%x\r\n%b\r\n" % (len(ev), ev)
    assert relay._whole_plain_chunk(chunk)
    assert not relay._whole_plain_chunk(chunk[:-1])
    assert not relay._whole_plain_chunk(b"0x" + chunk)  # not digits alone
    assert not relay._whole_plain_chunk(b"e\r\ndata: [DONE]\n\n\r\n")
    got, _, _ = _through_tap([chunk, chunk, chunk + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"])
    assert got.startswith(chunk + b"38\r\n")  # the first as it came; the held one re-framed


def test_a_bad_chunk_is_an_upstream_error() -> None:
    for bad in (b"zz\r\ndata: x\n\n\r\n", b"3\r\nabcd\r\n", b"1" * 5000):
        resp, cycle = _Resp(), _Cycle()
        tap = relay.StreamTap(resp, SseRelay(_last), cycle)  # type: ignore[arg-type]
        tap.data_received(bad)
        assert isinstance(tap._error, UpstreamError), bad


def test_a_stream_ending_while_the_client_is_slow_hands_back_a_reading_connection() -> None:
    """The read that brings the end may also find the client's buffer full (reading paused):
    the connection goes back to the pool reading again, or its next answer would hang."""
    resp, cycle = _Resp(), _Cycle()
    cycle.flow.write_paused = True
    tap = relay.StreamTap(resp, SseRelay(_last), cycle)  # type: ignore[arg-type]
    ev = b'data: {"x": 1}\n\n'
    resp._conn.buf += b"%x\r\n%b\r\n" % (len(ev), ev) + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
    asyncio.run(tap.run())
    assert resp._conn.transport.protocol is resp._conn
    assert resp._conn.transport.reading
    assert bytes(resp._conn.buf) == b"0\r\n\r\n"
    assert _dechunk(b"".join(cycle.transport.out) + b"0\r\n\r\n").endswith(b"[DONE]\n\n")


def test_a_whole_answer_that_came_before_the_tap_with_the_close_is_served_whole() -> None:
    """An engine may send its whole answer and close before the tap takes over: the buffered
    body is the answer, not a break; closed before the body ended, it is a break."""
    ev = b'data: {"x": 1}\n\n'
    whole = b"%x\r\n%b\r\n" % (len(ev), ev) + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
    resp, cycle = _Resp(), _Cycle()
    tap = relay.StreamTap(resp, SseRelay(_last), cycle)  # type: ignore[arg-type]
    resp._conn.buf += whole
    resp._conn.eof = True
    asyncio.run(tap.run())
    assert tap._error is None
    assert _dechunk(b"".join(cycle.transport.out) + b"0\r\n\r\n").endswith(b"[DONE]\n\n")
    resp, cycle = _Resp(), _Cycle()
    tap = relay.StreamTap(resp, SseRelay(_last), cycle)  # type: ignore[arg-type]
    resp._conn.buf += whole[: len(whole) // 2]
    resp._conn.eof = True
    with pytest.raises(UpstreamError, match="mid-answer"):
        asyncio.run(tap.run())


# -- live: a sidecar in front of a scripted engine ---------------------------------------------------


def _event(i: int, pad: int = 0) -> bytes:
    obj = {"choices": [{"index": 0, "text": f" t{i}", "pad": "x" * pad}]}
    data = b"data: " + json.dumps(obj).encode() + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(data), data)


_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_END = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"


class Engine:
    """An engine that answers each POST with ``script(n, transport)`` (n: requests so far) and
    records connections: opened, and closed by the peer."""

    def __init__(self, digest: str) -> None:
        self.digest = digest
        self.script: Callable[[int, Any], Any] = lambda n, t: None
        self.connections = 0
        self.lost = 0
        self.requests = 0
        self.loop = asyncio.new_event_loop()
        self._server: Any = None
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        engine = self

        class Proto(asyncio.Protocol):
            def connection_made(self, transport: Any) -> None:
                self.t, self.buf = transport, b""
                engine.connections += 1

            def connection_lost(self, exc: Exception | None) -> None:
                engine.lost += 1

            def data_received(self, data: bytes) -> None:
                self.buf += data
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = self.buf[:end].lower()
                i = head.find(b"content-length:")
                n = int(head[i + 15 :].split(b"\r\n", 1)[0]) if i >= 0 else 0
                if len(self.buf) < end + 4 + n:
                    return
                self.buf = self.buf[end + 4 + n :]
                if head.startswith(b"get /rollpatch/state"):
                    body = json.dumps({"version": 0, "digest": engine.digest}).encode()
                elif head.startswith(b"get"):
                    body = b"{}"
                else:
                    engine.requests += 1
                    engine.script(engine.requests, self.t)
                    return
                self.t.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%b" % (len(body), body)
                )

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._server = self.loop.run_until_complete(self.loop.create_server(Proto, sock=sock))
        ready.set()
        self.loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def later(self, delay: float, fn: Callable[[], Any]) -> None:
        self.loop.call_later(delay, fn)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class _Pinned(EngineAdapter):
    name = "scripted"

    def __init__(self, digest: str) -> None:
        self._digest = digest

    @property
    def version(self) -> int | None:
        return 0

    @property
    def digest(self) -> str | None:
        return self._digest

    def load(self, view: Any, version: int) -> None:
        raise AssertionError("no commits here")

    def words(self) -> Any:
        raise AssertionError("no commits here")

    def apply(self, patch: Any, version: int) -> None:
        raise AssertionError("no commits here")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, RunningSidecar]]:
    root: Path = tmp_path_factory.mktemp("tap")
    rng = np.random.default_rng(0)
    masters = {f"w{i}": rng.standard_normal((16, 16)).astype(np.float32) for i in range(2)}
    board = f"file://{root / 'board'}"
    Publisher(board, "r", PublisherConfig(keyframe_every=0), asynchronous=False).publish(masters)
    digest = cast_view(masters, "bf16").digest()
    engine = Engine(digest)
    sc = start_sidecar(
        board,
        "r",
        _Pinned(digest),
        engine.url,
        config=SidecarConfig(follower=FollowerConfig(poll_s=0.2, audit_bytes_per_s=None)),
    )
    assert sc.sidecar.follower.wait_for(0, 60)
    yield engine, sc
    sc.stop()
    engine.stop()


@pytest.fixture
def taps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many streams ran through the tap (the live tests must not pass on the fallback)."""
    count = [0]
    run = relay.StreamTap.run

    async def counted(self: relay.StreamTap) -> None:
        count[0] += 1
        await run(self)

    monkeypatch.setattr(relay.StreamTap, "run", counted)
    return count


def _stream(sc: RunningSidecar, client: httpx.Client) -> list[str]:
    body = {"model": "m", "prompt": "p", "max_tokens": 4, "stream": True}
    with client.stream("POST", f"{sc.url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["x-rollpatch-version-start"] == "0"
        return [line for line in r.iter_lines() if line]


def test_streams_are_relayed_by_the_tap_and_reuse_the_engine_connection(
    live: tuple[Engine, RunningSidecar], taps: list[int]
) -> None:
    engine, sc = live

    def script(n: int, t: Any) -> None:
        t.write(_HEAD + _event(0))  # the head and a first event in one read
        for i in range(1, 5):
            engine.later(0.002 * i, functools.partial(t.write, _event(i) + _event(i + 10)))
        engine.later(0.012, lambda: t.write(_END))

    engine.script = script
    with httpx.Client(timeout=10) as client:
        _stream(sc, client)  # the pool's first connection
        before, taps[0] = engine.connections, 0
        for _ in range(5):
            lines = _stream(sc, client)
            texts = [json.loads(x[5:])["choices"][0]["text"] for x in lines[:-1]]
            assert texts == [" t0", " t1", " t11", " t2", " t12", " t3", " t13", " t4", " t14"]
            assert json.loads(lines[-2][5:])["rollpatch"] == {"version_start": 0, "version_end": 0}
            assert lines[-1] == "data: [DONE]"
    assert taps[0] == 5
    assert engine.connections == before  # the last chunk handed the connection back
    assert sc.sidecar.gate.inflight == 0


def test_an_engine_failing_mid_stream_ends_the_answer_and_frees_the_slot(
    live: tuple[Engine, RunningSidecar], taps: list[int]
) -> None:
    engine, sc = live
    for breakage in (b"", b"zz\r\nnot a chunk\r\n"):

        def script(n: int, t: Any, breakage: bytes = breakage) -> None:
            t.write(_HEAD + _event(0))
            engine.later(0.005, lambda: t.write(_event(1)))

            def end() -> None:
                if breakage:
                    t.write(breakage)
                else:
                    t.close()

            engine.later(0.01, end)

        engine.script = script
        seen: list[str] = []
        with (
            httpx.Client(timeout=10) as client,
            pytest.raises(httpx.RemoteProtocolError),
        ):
            body = {"model": "m", "prompt": "p", "stream": True}
            with client.stream("POST", f"{sc.url}/v1/completions", json=body) as r:
                seen.extend(line for line in r.iter_lines() if line)
        # the events before the failure came through as they were (the held one too)
        assert [json.loads(x[5:])["choices"][0]["text"] for x in seen] == [" t0", " t1"]
        deadline = time.monotonic() + 10
        while sc.sidecar.gate.inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sc.sidecar.gate.inflight == 0
    assert taps[0] == 2


def test_a_client_leaving_closes_the_engine_connection(
    live: tuple[Engine, RunningSidecar], taps: list[int]
) -> None:
    engine, sc = live

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
            got = [next(lines) for _ in range(6)]
            assert sum(x.startswith("data:") for x in got) == 3
    deadline = time.monotonic() + 10
    while engine.lost == lost and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.lost > lost, "the engine connection stayed open after the client left"
    while sc.sidecar.gate.inflight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sc.sidecar.gate.inflight == 0
    assert taps[0] == 1


def test_a_slow_client_holds_the_engine_not_the_sidecars_memory(
    live: tuple[Engine, RunningSidecar], taps: list[int]
) -> None:
    """64 MiB of events for a client that reads nothing for a while: the sidecar stops
    reading the engine (whose own buffer then holds them) instead of buffering them;
    once the client reads, every event arrives in order."""
    engine, sc = live
    n_events, pad = 512, 128 * 1024
    ev = [_event(i, pad) for i in range(n_events)]

    used: list[Any] = []

    def script(n: int, t: Any) -> None:
        used.append(t)
        t.write(_HEAD)
        for e in ev:
            t.write(e)
        t.write(_END)

    engine.script = script
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST", f"{sc.url}/v1/completions", json={"model": "m", "prompt": "p", "stream": True}
        ) as r,
    ):
        assert r.status_code == 200
        time.sleep(3.0)  # time enough for a sidecar that does not hold back to read it all
        # most of the stream still waits in the engine's own buffer: the sidecar holds
        # a few socket buffers' worth, not the 64 MiB
        assert used[0].get_write_buffer_size() > 32 << 20
        lines = [line for line in r.iter_lines() if line]
    texts = [json.loads(x[5:])["choices"][0]["text"] for x in lines[:-1]]
    assert texts == [f" t{i}" for i in range(n_events)]
    assert lines[-1] == "data: [DONE]"
    assert taps[0] == 1
