"""The sidecar's hot path: the proxied OpenAI routes as a plain ASGI handler.

Profiled behind a real engine, the sidecar spent most of its CPU per request outside its own
logic: FastAPI's routing and middleware wrapped every request and every streamed chunk,
httpx + httpcore + anyio wrapped every upstream read, each chunk was decoded to ``str`` and
encoded back, and three worker-thread hops per request (LATEST twice, admission once) woke
the pool. Here a request costs: the bounded body read and its typed check (as before), the
version decision, admission without a thread when the gate is open, one write of the body
to the engine on a pooled connection (:class:`~rollpatch.serving.upstream.Upstream`), and
per streamed event one write from the engine connection's own protocol (:mod:`.relay`; the
request's task relays through :class:`~rollpatch.serving.streaming.SseRelay` where it cannot);
only the last data event is parsed, to add the versions. What a client sees is unchanged:
the same statuses, bodies, headers and events (docs/sidecar.md).

:class:`ProxyFront` puts the handler in front of the FastAPI app (which keeps the admin
routes and documents these two in its OpenAPI schema).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Literal

from starlette.responses import Response

from ..errors import ConfigError, NotReadyError, RollpatchError
from ..logs import event
from ..serving.admission import admit_async
from ..serving.app import config_refusal, internal_error
from ..serving.body import read_asgi_json
from ..serving.responses import error_response
from ..serving.schema import validate_body
from ..serving.streaming import SseRelay, sse_data
from ..serving.upstream import Upstream, UpstreamError, UpstreamResponse
from .gate import Admission
from .protocol import (
    HEADER_END,
    HEADER_START,
    annotate_sse_line,
    decide,
    label_body,
    parse_constraint,
)
from .relay import Ending, StreamTap, client_of, hang_up, tappable
from .satisfy import LatestReader, conflict, plain_proxy, satisfy
from .service import Sidecar

__all__ = ["PROXIED", "ProxyFront", "rollpatch_refusal"]

log = logging.getLogger("rollpatch.sidecar")

#: The routes proxied to the engine under version constraints.
PROXIED = ("/v1/completions", "/v1/chat/completions")
_JSON = ((b"content-type", b"application/json"),)
_SSE_TYPE = b"text/event-stream; charset=utf-8"
_HDR_START, _HDR_END = HEADER_START.lower().encode(), HEADER_END.lower().encode()

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def rollpatch_refusal(e: RollpatchError) -> Response:
    """A rollpatch error that is not the request's fault: 503 not ready, else 502."""
    if isinstance(e, NotReadyError):
        return error_response(503, str(e), "not_ready")
    return error_response(502, str(e), "rollpatch_error")


class ProxyFront:
    """ASGI: ``POST`` to :data:`PROXIED` runs :meth:`handle`; anything else goes to ``app``."""

    #: Relay streams in the engine connection's protocol when the server allows it
    #: (:mod:`.relay`); False: the request's task reads and sends every event.
    tap_streams = True

    def __init__(self, sc: Sidecar, app: Any, upstream: Upstream) -> None:
        self.sc, self.app, self.upstream = sc, app, upstream
        self._latest = LatestReader(sc)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in PROXIED:
            await self.handle(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One proxied request; every error becomes its status (never a bare 500 traceback)."""
        sent = _Sent(send)
        try:
            await self._proxy(scope, receive, sent, scope["path"])
        except Exception as e:  # mapped like the app's exception handlers
            if sent.started:
                raise  # mid-response: nothing better than closing the connection
            if isinstance(e, ConfigError):  # the request's own fault: counted, as the rest are
                resp = config_refusal(e)
                self.sc.metrics.request("client_error")
            elif isinstance(e, RollpatchError):
                resp = rollpatch_refusal(e)
            else:
                resp = internal_error(log, "sidecar", e)
            await resp(scope, receive, send)

    async def _proxy(self, scope: Scope, receive: Receive, send: _Sent, path: str) -> None:
        sc = self.sc
        raw, body = await read_asgi_json(scope, receive, sc.config.body)
        typed = validate_body(path, body)
        stripped = "rollpatch" in body
        constraint = parse_constraint(body, _rollpatch_headers(scope))
        refused = await satisfy(sc, self._latest, constraint)
        if refused is not None:
            await refused(scope, receive, send)
            return
        # the engine gets the body as the client sent it, less the rollpatch field
        payload = _dumps(body) if stripped else raw
        with await _admit(sc) as slot:
            d = plain_proxy(constraint, slot.start)
            if d is None:
                latest = await self._latest(needed=constraint.max_lag is not None)
                d = decide(constraint, slot.start, latest)
            if d.action != "proxy":  # moved on while we were admitted (exact_version raced)
                sc.metrics.request("conflict")
                await conflict(sc, slot.start, d.reason, final=d.final)(scope, receive, send)
                return
            if typed.stream:
                await self._stream(receive, send, path, payload, slot)
            else:
                await self._once(receive, send, path, payload, slot)

    async def _once(
        self, receive: Receive, send: Send, path: str, payload: bytes, slot: Admission
    ) -> None:
        """One non-streaming answer; the caller's ``with`` releases ``slot`` on every path.
        A client that hangs up ends the engine's request (its connection is closed, as for a
        stream), so an abandoned generation holds no drain, commit or slot."""
        sc, start, t0 = self.sc, slot.start, time.perf_counter()

        async def answer() -> tuple[UpstreamResponse, bytes]:
            resp = await self.upstream.request("POST", path, payload, _JSON)
            try:
                return resp, await resp.read()
            finally:
                resp.close()

        call = asyncio.ensure_future(answer())
        gone = asyncio.ensure_future(_disconnect(receive))
        try:
            await asyncio.wait((call, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not call.done():  # the client left first: the engine's request goes too
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError, UpstreamError):
                await call
            sc.metrics.request("client_gone", time.perf_counter() - t0)
            return
        try:
            resp, content = call.result()
        except UpstreamError as e:
            await _unreachable(sc, send, e)
            return
        end = slot.release()
        sc.metrics.request("proxied", time.perf_counter() - t0)
        if resp.status == 200:  # narrowed by what the engine says (rollpatch.protocol)
            content, start, end = label_body(content, start, end)
        ctype = resp.header(b"content-type") or b"application/json"
        await _send_raw(send, resp.status, _headers(ctype, start, end), content)

    async def _stream(
        self, receive: Receive, send: _Sent, path: str, payload: bytes, slot: Admission
    ) -> None:
        """A streamed answer, relayed as it arrives; the slot is released at ``[DONE]`` (the
        versions the stream ran under are known then) or, at the latest, by the caller."""
        sc, start, t0 = self.sc, slot.start, time.perf_counter()
        try:
            resp = await self.upstream.request("POST", path, payload, _JSON)
        except UpstreamError as e:
            await _unreachable(sc, send, e)
            return
        try:
            if resp.status != 200:
                try:
                    content = await resp.read()
                except UpstreamError as e:
                    sc.metrics.request("engine_error")
                    await _send_response(
                        send, error_response(502, f"engine failed: {e}", "engine_error")
                    )
                    return
                end = slot.release()
                sc.metrics.request("proxied", time.perf_counter() - t0)
                ctype = resp.header(b"content-type") or b"application/json"
                await _send_raw(send, resp.status, _headers(ctype, start, end), content)
                return
            outcome = await self._relay(receive, send, resp, slot)
            sc.metrics.request(outcome, time.perf_counter() - t0 if outcome == "proxied" else None)
        finally:
            resp.close()

    async def _relay(
        self, receive: Receive, sent: _Sent, resp: UpstreamResponse, slot: Admission
    ) -> Literal["proxied", "client_gone", "engine_error"]:
        """Relay the stream; how it ended: whole, the client gone, or broken by the engine
        (an error event, then the connection cut: never a clean end). Whole is what reached
        the client before it left (:class:`Ending`): an OpenAI client hangs up right after
        ``[DONE]``, often before the engine's own end is read."""
        start = slot.start

        def last_event(line: bytes, done: bool) -> bytes:
            if not done:
                return line + b"\n\n"
            return annotate_sse_line(line, start, slot.release()) + b"\n\n"

        def on_done() -> None:
            ending.reached()
            slot.release()

        relay = SseRelay(last_event, on_done=on_done)
        # in drain mode without a drain deadline no commit can land while the stream is
        # admitted (end == start is known); past a deadline the commit pauses instead, so it may
        gate = self.sc.gate
        end_hdr = start if gate.mode == "drain" and gate.drain_timeout_s is None else None
        await sent(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": _headers(_SSE_TYPE, start, end_hdr),
            }
        )
        send = sent.send  # started: the events go straight to the server
        cycle = client_of(send)
        tap = (
            StreamTap(resp, relay, cycle)
            if self.tap_streams and cycle is not None and tappable(resp)
            else None
        )
        # the client going away ends the engine's generation too (its connection closes)
        gone = asyncio.ensure_future(_disconnect(receive))
        ending = Ending(gone, cycle, tapped=tap is not None)

        def abort(_: object) -> None:
            resp.abort()

        gone.add_done_callback(abort)
        try:
            if tap is not None:  # relayed in the engine connection's protocol, to its end
                await tap.run()
            while piece := await resp.piece():  # every event one read brought: one write
                out = relay.feed(piece)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                    ending.sent()
            out = relay.finish()
            left = ending.left()  # no [DONE]: the whole body is the end (before the cancel)
        except UpstreamError as e:
            if gone.done():  # the client left, so the engine's connection was closed
                return "proxied" if ending.whole else "client_gone"
            event(log, "stream_failed", error=str(e))
            self.sc.follower.engine_unreachable(f"a stream from it broke: {e}")
            failed = sse_data(
                {
                    "error": {
                        "message": f"the engine failed mid-stream: {e}",
                        "type": "engine_error",
                        "code": 502,
                    }
                }
            )
            await send(
                {"type": "http.response.body", "body": relay.abandon() + failed, "more_body": True}
            )
            hang_up(send)
            return "engine_error"  # the response stays incomplete: its connection is closed
        finally:
            gone.remove_done_callback(abort)
            gone.cancel()
        await send({"type": "http.response.body", "body": out, "more_body": False})
        return "proxied" if ending.whole or not left else "client_gone"


class _Sent:
    """The server's ``send``, noting whether the answer has started (after that, an error can
    only close the connection). A stream's events bypass it (:attr:`send`)."""

    __slots__ = ("send", "started")

    def __init__(self, send: Send) -> None:
        self.send, self.started = send, False

    async def __call__(self, message: MutableMapping[str, Any]) -> None:
        self.started = True
        await self.send(message)


async def _disconnect(receive: Receive) -> None:
    """Return when the client has gone (other messages, such as an empty last body part the
    server hands out late, are not a disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unreachable(sc: Sidecar, send: Send, e: UpstreamError) -> None:
    """502 for a request the engine did not answer; until the audit re-checks the engine
    (a restarted one holds its boot checkpoint's words), no version is served."""
    sc.metrics.request("engine_error")
    sc.follower.engine_unreachable(f"a request could not reach it: {e}")
    await _send_response(send, error_response(502, f"engine unreachable: {e}", "engine_error"))


async def _admit(sc: Sidecar) -> Admission:
    """The gate's slot: at once when admission is open (no thread), else waited for in a
    worker thread (a drain-mode commit holds it closed)."""
    try:
        return sc.gate.admit(0)
    except NotReadyError:
        timeout = sc.config.admit_timeout_s
        return await admit_async(lambda: sc.gate.admit(timeout))


def _rollpatch_headers(scope: Scope) -> dict[str, str]:
    """The request's ``x-rollpatch-*`` headers (ASGI names are lower-case)."""
    return {
        k.decode("latin-1"): v.decode("latin-1")
        for k, v in scope["headers"]
        if k.startswith(b"x-rollpatch-")
    }


def _dumps(body: dict[str, Any]) -> bytes:
    # what httpx's json= wrote before: compact, UTF-8, no NaN
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _headers(ctype: bytes, start: int | None, end: int | None) -> list[tuple[bytes, bytes]]:
    out = [(b"content-type", ctype), (_HDR_START, str(start).encode())]
    if end is not None:
        out.append((_HDR_END, str(end).encode()))
    return out


async def _send_raw(
    send: Send, status: int, headers: list[tuple[bytes, bytes]], content: bytes
) -> None:
    headers.append((b"content-length", str(len(content)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": content, "more_body": False})


async def _send_response(send: Send, resp: Response) -> None:
    """A prepared starlette response (no background task, no body stream) sent as is."""
    await send(
        {"type": "http.response.start", "status": resp.status_code, "headers": resp.raw_headers}
    )
    await send({"type": "http.response.body", "body": resp.body, "more_body": False})
