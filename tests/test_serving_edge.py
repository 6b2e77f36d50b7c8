"""The HTTP edge kit (rollpatch.serving): the server lifecycle and the shared error bodies.

Servers are real (uvicorn on loopback via ``serve_app``); the client is httpx.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi", reason="the web extra installs fastapi")

from fastapi import FastAPI

from rollpatch.serving import serve_app
from rollpatch.serving.responses import error_response


def test_the_apps_lifespan_runs_start_and_stop() -> None:
    """What an app opens at build time (the sidecar's and the gateway's upstream clients) is
    closed in its lifespan; the server must run it (it used to be off by default)."""
    events: list[str] = []

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        events.append("startup")
        yield
        events.append("shutdown")

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    server = serve_app(app, name="lifespan-test")
    try:
        assert events == ["startup"]  # before serve_app returned, i.e. before any request
        assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
    finally:
        server.stop()
    assert events == ["startup", "shutdown"]


async def _plain_asgi(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app that knows only HTTP (no lifespan support), like a bare engine stub."""
    if scope["type"] != "http":
        raise RuntimeError(f"unsupported scope {scope['type']}")
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"plain"})


def test_an_app_without_lifespan_support_is_still_served() -> None:
    server = serve_app(_plain_asgi, name="plain-test")
    try:
        r = httpx.get(f"{server.url}/", timeout=10)
        assert (r.status_code, r.content) == (200, b"plain")
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("status", "retry"), [(400, None), (409, "1"), (500, None), (502, None), (503, "1")]
)
def test_error_bodies_are_openai_style(status: int, retry: str | None) -> None:
    r = error_response(status, "why", "some_kind", served=3, latest=5)
    assert r.status_code == status
    assert r.headers.get("retry-after") == retry
    assert json.loads(bytes(r.body)) == {
        "error": {"message": "why", "type": "some_kind", "code": status},
        "served": 3,
        "latest": 5,
    }


def test_metric_shapes_are_shared_by_sidecar_and_gateway() -> None:
    """One owner of the served/latest/lag triple and the outcome labels: an unknown version
    is -1 on both; the sidecar's lag is never left at an old value (latest + 1 with nothing
    served, NaN with LATEST unknown: audit G-F3); cumulative values are counters, and no
    ``*_created`` series is rendered (audit G-F6); both render their own registry only."""
    from rollpatch.gateway.metrics import GatewayMetrics
    from rollpatch.gateway.routing import IslandView
    from rollpatch.serving.metrics import OUTCOMES, outcome
    from rollpatch.sidecar.metrics import SidecarMetrics

    assert [outcome(s) for s in (200, 409, 503, None, 502, 404, 500)] == list(OUTCOMES)

    sc = SidecarMetrics()
    fields = {"version": 3, "latest": 5, "lag": 2, "bytes_fetched": 7, "commits": 1}
    status = type(
        "S",
        (),
        {**fields, "failures": 2, "adoptions": 1, "last_error": None, "served_created": 7.5},
    )
    sc.update(status, status.latest, 1.25, ready=True)
    sc.request("proxied", 0.01)
    text = sc.render().decode()
    for line in (
        "rollpatch_served_version 3.0",
        "rollpatch_latest_version 5.0",
        "rollpatch_lag_versions 2.0",
        "rollpatch_sync_failures_total 2.0",
        "rollpatch_sync_failing 0.0",
        "rollpatch_ready 1.0",
        "rollpatch_served_published_timestamp_seconds 7.5",
        "rollpatch_adoptions_total 1.0",
        "rollpatch_commits_total 1.0",
        "rollpatch_bytes_fetched_total 7.0",
        "# TYPE rollpatch_commits_total counter",
        "# TYPE rollpatch_drain_timeouts_total counter",
        "# TYPE rollpatch_engine_connections_opened_total counter",
        "rollpatch_latest_age_seconds 1.25",
        'rollpatch_requests_total{outcome="proxied"} 1.0',
        "rollpatch_proxy_seconds_count 1.0",
    ):
        assert line in text.splitlines()
    assert "_created" not in text
    # the version lost, LATEST still known: every version is missing (a lag alert fires)
    status.version, status.lag = None, None
    sc.update(status, status.latest, 1.25, ready=False)
    lines = sc.render().decode().splitlines()
    assert "rollpatch_served_version -1.0" in lines and "rollpatch_lag_versions 6.0" in lines
    status.latest = None
    status.last_error = "EngineError: x"
    # none verified: -1, as the gateway says it; LATEST never read: -1, and the lag unknown
    sc.update(status, status.latest, float("inf"), ready=False)
    text = sc.render().decode()
    for line in (
        "rollpatch_served_version -1.0",
        "rollpatch_latest_version -1.0",
        "rollpatch_lag_versions NaN",
        "rollpatch_sync_failing 1.0",
        "rollpatch_latest_age_seconds -1.0",
    ):
        assert line in text.splitlines()

    gw = GatewayMetrics()
    islands = [
        IslandView("a", "http://a", served=4, latest=6, reachable=True, inflight=1),
        IslandView("b", "http://b", served=None, latest=None, reachable=False, inflight=0),
    ]
    gw.attempt("a", 409)
    text = gw.render(islands).decode()
    for line in (
        'rollpatch_gateway_island_served_version{island="a"} 4.0',
        'rollpatch_gateway_island_lag_versions{island="a"} 2.0',
        'rollpatch_gateway_island_served_version{island="b"} -1.0',
        'rollpatch_gateway_island_latest_version{island="b"} -1.0',
        'rollpatch_gateway_requests_total{island="a",outcome="conflict"} 1.0',
        # an island with no version lags by every version of the fleet (6 + 1): an alert
        # on the lag fires for it (before session 41 it had no lag series at all)
        'rollpatch_gateway_island_lag_versions{island="b"} 7.0',
    ):
        assert line in text.splitlines()
    text = gw.render(islands, other_run={"b"}).decode()  # b follows another run: no lag here
    assert 'rollpatch_gateway_island_lag_versions{island="b"} NaN' in text.splitlines()
    assert "_created" not in text
    assert "rollpatch_served_version" not in text  # registries stay apart


# -- admission and streaming: one owner each (issue 13) -------------------------------------


def test_a_slot_is_released_once_on_every_way_out() -> None:
    from rollpatch.serving.admission import Slot

    calls: list[int] = []
    with Slot(lambda: calls.append(1) or len(calls)) as slot:
        assert slot.release() == 1 and slot.release() == 1  # idempotent, same answer
    assert calls == [1]
    with pytest.raises(RuntimeError), Slot(lambda: calls.append(2)):
        raise RuntimeError("handler failed")
    assert calls == [1, 2]
    with Slot(lambda: calls.append(3)) as slot:
        handed = slot.hand_off()  # a stream owns it now: leaving the block keeps it
    assert calls == [1, 2] and not handed.released
    handed.release()
    assert calls == [1, 2, 3]
    with pytest.raises(ValueError), Slot(lambda: calls.append(4)) as slot:
        slot.hand_off()
        raise ValueError("the hand-off never happened")  # an exception releases regardless
    assert calls == [1, 2, 3, 4]


def test_admission_released_when_the_caller_is_cancelled_while_waiting() -> None:
    import asyncio
    import threading

    from rollpatch.serving.admission import Slot, admit_async

    gate = threading.Event()
    released = threading.Event()

    def admit() -> Slot:
        gate.wait(10)  # a slow admission (a drain in progress)
        return Slot(released.set)

    async def main() -> None:
        task = asyncio.create_task(admit_async(admit))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()  # admission lands after the caller went away
        assert await asyncio.to_thread(released.wait, 10)

    asyncio.run(main())


def _relay(lines: list[str], **kw: Any) -> list[bytes]:
    import asyncio

    from rollpatch.serving.streaming import relay_sse

    async def source() -> AsyncIterator[str]:
        for line in lines:
            if line == "FAIL":
                raise ConnectionError("upstream went away")
            yield line

    async def collect() -> list[bytes]:
        out = []
        async for event in relay_sse(source(), lambda line, done: b"LAST%d:" % done + line, **kw):
            out.append(event)
        return out

    return asyncio.run(collect())


def test_sse_relay_holds_and_annotates_the_last_event() -> None:
    from rollpatch.serving.streaming import DONE, sse_data

    done: list[str] = []
    lines = ['data: {"a":1}', "", ": keep-alive", 'data: {"a":2}', "data: [DONE]"]
    assert _relay(lines, on_done=lambda: done.append("done")) == [
        b'data: {"a":1}\n\n',
        b'LAST1:data: {"a":2}',
        DONE,
    ]
    assert done == ["done"]
    assert _relay(['data: {"a":1}', 'data: {"a":2}']) == [  # no [DONE]: the end is the last
        b'data: {"a":1}\n\n',
        b'LAST0:data: {"a":2}',
    ]
    failed = _relay(
        ['data: {"a":1}', 'data: {"a":2}', "FAIL"],
        failures=(ConnectionError,),
        on_failure=lambda e: sse_data({"error": str(e)}),
    )
    assert failed == [
        b'data: {"a":1}\n\n',
        b'data: {"a":2}\n\n',  # held, sent as it came: the stream did not finish
        b'data: {"error": "upstream went away"}\n\n',
    ]
    with pytest.raises(ConnectionError):  # not a declared failure: it propagates
        _relay(['data: {"a":1}', "FAIL"])


def test_an_owned_stream_closes_when_the_client_leaves_before_the_first_byte() -> None:
    """The slot a stream holds comes back even if the client never reads a byte (the path
    the gateway's hand-counted release did not cover)."""
    import asyncio
    import threading

    from rollpatch.serving.admission import Slot
    from rollpatch.serving.streaming import OwnedStream

    closed = threading.Event()
    slot = Slot(closed.set)
    app = FastAPI()

    @app.get("/stream")
    async def stream() -> OwnedStream:
        async def events() -> AsyncIterator[bytes]:
            await asyncio.sleep(60)  # the client is gone long before this
            yield b"data: late\n\n"

        async def close() -> None:
            slot.release()

        return OwnedStream(events(), close)

    server = serve_app(app, name="owned-stream-test")
    try:
        with httpx.Client(timeout=10) as client, client.stream("GET", f"{server.url}/stream") as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith(
                "text/event-stream"
            )
        assert closed.wait(20), "the stream's slot was never released"
    finally:
        server.stop()
