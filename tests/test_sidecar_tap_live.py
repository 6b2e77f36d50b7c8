"""The sidecar's stream relay (rollpatch.sidecar.relay, issue 10) live: a sidecar in front
of a scripted engine over real sockets, and every way a stream ends — the engine failing, a
client that leaves, a client that reads slowly (the engine is held, not buffered). The
protocol alone: tests/test_sidecar_tap.py.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
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
from rollpatch.sidecar import SidecarConfig, relay
from rollpatch.sidecar.server import RunningSidecar, start_sidecar


def _event(i: int, pad: int = 0) -> bytes:
    obj = {"choices": [{"index": 0, "text": f" t{i}", "pad": "x" * pad}]}
    data = b"data: " + json.dumps(obj).encode() + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(data), data)


_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_END = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


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
    live: tuple[Engine, RunningSidecar], taps: list[int], request: pytest.FixtureRequest
) -> None:
    engine, sc = live
    before = _outcomes(sc)
    errors = _Records()
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(errors)
    request.addfinalizer(lambda: uvicorn_log.removeHandler(errors))
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
        # the events before the failure came through as they were (the held one too), then
        # an error event with the reason (an audit, session 40: only a cut connection)
        assert [json.loads(x[5:])["choices"][0]["text"] for x in seen[:-1]] == [" t0", " t1"]
        error = json.loads(seen[-1][5:])["error"]
        assert error["type"] == "engine_error" and "failed mid-stream" in error["message"]
        deadline = time.monotonic() + 10
        while sc.sidecar.gate.inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sc.sidecar.gate.inflight == 0
    assert taps[0] == 2
    assert _outcomes(sc, before) == {"engine_error": 2}  # not "proxied" (audit E, session 40)
    # the sidecar logs the broken stream (stream_failed); the server adds no ERROR of its own
    # per broken stream ("ASGI callable returned without completing response")
    assert [r.getMessage() for r in errors.records if r.levelno >= logging.WARNING] == []


def endless(engine: Engine, event: Callable[[int], bytes] = _event) -> None:
    """The stand-in engine answers every request with a stream of ``event`` (numbered), one
    every 5 ms, until the connection closes."""

    def script(n: int, t: Any) -> None:
        t.write(_HEAD)

        def tick(i: int = 0) -> None:
            if not t.is_closing():
                t.write(event(i))
                engine.later(0.005, lambda: tick(i + 1))

        tick()

    engine.script = script


def test_a_client_leaving_closes_the_engine_connection(
    live: tuple[Engine, RunningSidecar], taps: list[int]
) -> None:
    engine, sc = live

    endless(engine)
    lost, before = engine.lost, _outcomes(sc)
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
    deadline = time.monotonic() + 10
    while not _outcomes(sc, before) and time.monotonic() < deadline:  # counted at its end
        time.sleep(0.01)
    assert _outcomes(sc, before) == {"client_gone": 1}  # not "proxied" (audit E, session 40)


def _outcomes(sc: RunningSidecar, since: dict[str, int] | None = None) -> dict[str, int]:
    """The sidecar's ``rollpatch_requests_total`` by outcome, less ``since`` (those above 0)."""
    out: dict[str, int] = {}
    for metric in sc.sidecar.metrics.requests.collect():
        for s in metric.samples:
            n = int(s.value) - (since or {}).get(s.labels.get("outcome", ""), 0)
            if s.name.endswith("_total") and n:
                out[s.labels["outcome"]] = n
    return out


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
