"""The relay's HTTP face (protocol v1 of docs/store.md) and :class:`RelayServer`.

FastAPI on uvicorn: handlers are ``async`` and await the relay's futures, so clients waiting
on a coalesced fetch hold no thread; bodies stream from the cache file in ``chunk_bytes``
pieces. fastapi is imported here only, uvicorn by :mod:`rollpatch.serving` (the ``web``
extra).
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any, BinaryIO, TypeVar, cast

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from ..errors import (
    ConfigError,
    NotFoundError,
    RollpatchError,
    TransientStoreError,
)
from ..serving import ServeOptions, ServerHandle, serve_app
from ..serving.app import route_error
from ..store import Store, open_store, validate_key, validate_prefix
from ..store.http_client import HELD_HEADER
from ..store.push import MAX_HAVE, PUSH_HEADER, parse_have
from ..trust import Trust
from .answers import RefusalLog, error_answer, status_of
from .cache import CacheEntry
from .config import KeyKind, RelayConfig, classify
from .core import Blob, Relay
from .drain import DrainGate, Draining
from .metrics import CONTENT_TYPE, CountRequests
from .ranges import RangeNotSatisfiable, parse_range
from .watch import PREFETCH_HEADER

__all__ = ["RelayServer", "create_app", "parse_range"]

T = TypeVar("T")
_S = TypeVar("_S", bound="RelayServer")
_AFTER = re.compile(r"-1|\d{1,18}")
_PUSH = re.compile(r"\d{1,15}")
_IMMUTABLE = "public, max-age=31536000, immutable"
_OPEN_ATTEMPTS = 3


async def _wait(future: Future[T]) -> T:
    return await asyncio.wrap_future(future)


def create_app(relay: Relay, draining: Draining | None = None) -> FastAPI:
    """The ASGI app serving ``relay``: ``/v1/objects/{key}``, ``/v1/list``, ``/metrics``,
    ``/health``; ``draining``: its reads in flight, and its refusals once it drains."""
    app = FastAPI(title="rollpatch relay", docs_url=None, redoc_url=None)  # /openapi.json
    app.add_middleware(DrainGate, state=draining or Draining())  # inside the count: 503s counted
    app.add_middleware(CountRequests, metrics=relay.metrics)

    refusals = RefusalLog()

    async def on_error(request: Request, exc: Exception) -> Response:
        status = status_of(exc)
        refusals.said(request.url.path, status, exc)  # 5xx: the operator hears of it
        return error_answer(status, exc)

    app.add_exception_handler(RollpatchError, on_error)
    app.add_exception_handler(OSError, on_error)

    @app.exception_handler(HTTPException)
    async def no_route(request: Request, exc: HTTPException) -> Response:
        return cast(Response, route_error(app, "relay", request.method, request.url.path, exc))

    @app.api_route("/v1/objects/{key:path}", methods=["GET", "HEAD"])
    async def objects(key: str, request: Request) -> Response:
        try:
            kind = classify(validate_key(key))
        except ConfigError as e:
            return error_answer(400, e)
        if (
            request.method == "GET"
            and kind is KeyKind.POINTER
            and "after" in request.query_params
            and relay.config.hold_s > 0
        ):
            return await _held(relay, key, request)
        if request.method == "HEAD" and kind.immutable:
            info = await _wait(relay.stat(key))
            if info is None:
                raise NotFoundError("no such object", key=key)
            return Response(headers=_headers(kind, info.size, info.etag, relay))
        blob = await _wait(relay.resolve(key))
        if request.method == "HEAD":  # volatile: small, and held in memory
            return Response(headers=_headers(kind, blob.size, blob.etag, relay))
        if blob.data is not None:
            return _serve(relay, blob, blob.data, request.headers.get("range"))
        for _ in range(_OPEN_ATTEMPTS):
            opened = relay.open(blob)
            if opened is not None:
                return _serve(relay, blob, opened, request.headers.get("range"))
            blob = await _wait(relay.resolve(key))  # evicted meanwhile: fetch it again
        raise TransientStoreError(
            "cache entry kept being evicted before it could be served",
            key=key,
            hint="raise --cache-bytes",
        )

    @app.get("/v1/list")
    async def listing(prefix: str = "", start_after: str | None = None) -> Response:
        try:
            validate_prefix(prefix)
        except ConfigError as e:
            return error_answer(400, e)
        keys = await _wait(relay.list(prefix))
        return JSONResponse(_page(keys, start_after, relay.config.list_page))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(relay.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "upstream": relay.upstream.uri,
            "cache_bytes": relay.cache.total_bytes,
            "cache_entries": len(relay.cache),
        }

    return app


async def _held(relay: Relay, key: str, request: Request) -> Response:
    """A long-poll of LATEST: answered once the relay knows a version above ``after``, or
    after ``wait`` seconds (at most ``hold_s``) with the LATEST it has; marked held."""
    q = request.query_params
    after_s, wait_s, push_s = q.get("after", ""), q.get("wait"), q.get("push", "0")
    try:
        if not _AFTER.fullmatch(after_s) or not _PUSH.fullmatch(push_s):
            raise ValueError(after_s)
        have = parse_have(q.get("have", ""))
        wait = relay.config.hold_s if wait_s is None else float(wait_s)
        if not 0 <= wait < float("inf"):
            raise ValueError(wait_s)
    except ValueError:
        return error_answer(
            400,
            ConfigError(
                "a long-poll of LATEST takes ?after=N (an integer >= -1), &wait=S seconds "
                "and optionally &push=B (bytes, an integer >= 0) and &have=T,... (at most "
                f"{MAX_HAVE} version numbers or BLAKE3 hashes of objects held)",
                key=key,
            ),
        )
    after, wait = int(after_s), min(wait, relay.config.hold_s)
    blob: Blob | None = None
    future = relay.watch.wait(key, after) if wait > 0 else None
    if future is not None:
        try:
            blob = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), wait)
        except TimeoutError:
            relay.watch.forget(key, future)
        except asyncio.CancelledError:
            if not future.cancelled():  # this request was cancelled, not the wait
                raise
    if blob is None and future is not None and relay.config.prefetch:
        blob = relay.watch.announced(key)  # never a version whose prefetch failed
    if blob is None:
        blob = await _wait(relay.resolve(key))
    assert blob.data is not None  # LATEST is held in memory
    push = int(push_s)
    framed = (
        await asyncio.to_thread(relay.watch.push, key, blob, after, push, have) if push else None
    )
    if framed is not None:
        response = _pushed(relay, *framed)
    else:
        response = _serve(relay, blob, blob.data, None)
    response.headers[HELD_HEADER] = "1"
    if hint := relay.watch.hint(key, blob):
        response.headers[PREFETCH_HEADER] = hint
    return response


def _pushed(relay: Relay, header: str, pieces: list[bytes]) -> Response:
    """A held answer carrying the announced version's objects (:mod:`rollpatch.store.push`)."""
    body = b"".join(pieces)
    relay.metrics.inc("rollpatch_relay_served_bytes_total", len(body))
    return Response(
        body,
        headers={
            "Content-Type": "application/octet-stream",
            "Cache-Control": "no-store",
            PUSH_HEADER: header,
        },
    )


def _page(keys: list[str], start_after: str | None, limit: int) -> dict[str, Any]:
    import bisect

    lo = 0 if start_after is None else bisect.bisect_right(keys, start_after)
    page = keys[lo : lo + limit]
    return {"keys": page, "next": page[-1] if lo + limit < len(keys) else None}


def _headers(kind: KeyKind, size: int, etag: str | None, relay: Relay) -> dict[str, str]:
    headers = {
        "Content-Length": str(size),
        "Accept-Ranges": "bytes",
        "Content-Type": "application/octet-stream",
        "Cache-Control": _IMMUTABLE
        if kind.immutable
        else f"max-age={int(relay.config.pointer_ttl)}",
    }
    if etag is not None:
        headers["ETag"] = etag
    return headers


def _serve(
    relay: Relay, blob: Blob, source: bytes | tuple[BinaryIO, CacheEntry], range_header: str | None
) -> Response:
    """The answer to a GET from memory or an open cache file: whole, one range (206) or 416.
    A file body of at most ``chunk_bytes`` is read at once and sent as one body; larger ones
    are streamed chunk by chunk (each chunk read on a worker thread). Why: a step patch is
    about 1 MB at 100M parameters, and each hop to a thread and back waits for a core when
    the readers decode on the same cores: 1 MiB served 90 times alternating, 3 CPU burners
    on 2 cores (load ~9), took p50 12.5 / p90 25 / max 286 ms streamed, 6.1 / 19 / 48 ms read
    at once (a page-cache read of 1 MiB holds the event loop ~0.1 ms)."""
    headers = _headers(blob.kind, blob.size, blob.etag, relay)
    try:
        span = parse_range(range_header, blob.size)
    except RangeNotSatisfiable:
        if not isinstance(source, bytes):
            source[0].close()
        return Response(status_code=416, headers={"Content-Range": f"bytes */{blob.size}"})
    first, last = (0, blob.size - 1) if span is None else span
    status = 200 if span is None else 206
    if span is not None:
        headers["Content-Range"] = f"bytes {first}-{last}/{blob.size}"
    headers["Content-Length"] = str(last - first + 1)
    if isinstance(source, bytes):
        body = source[first : last + 1]
        relay.metrics.inc("rollpatch_relay_served_bytes_total", len(body))
        # an object the cache disk refused holds its memory (.uncached) until it is sent
        kept = BackgroundTask(_sent, blob) if blob.kind.immutable else None
        return Response(body, status_code=status, headers=headers, background=kept)
    f, entry = source
    length = last - first + 1
    if length <= relay.config.chunk_bytes:
        with f:
            f.seek(entry.offset + first)
            body = f.read(length)
        if len(body) != length:  # before any byte is sent: a clean error answer
            raise OSError("cache file is shorter than its index says")
        relay.metrics.inc("rollpatch_relay_served_bytes_total", length)
        return Response(body, status_code=status, headers=headers)
    f.seek(entry.offset + first)
    return StreamingResponse(_stream(relay, f, length), status_code=status, headers=headers)


async def _sent(blob: Blob) -> None:
    """Nothing: the answer's background task holds ``blob`` until the answer is sent."""


def _stream(relay: Relay, f: BinaryIO, length: int) -> Iterator[bytes]:
    """Read ``length`` bytes from the open cache file; closes it however the stream ends."""
    with f:
        remaining = length
        while remaining:
            chunk = f.read(min(remaining, relay.config.chunk_bytes))
            if not chunk:
                raise OSError("cache file is shorter than its index says")
            remaining -= len(chunk)
            relay.metrics.inc("rollpatch_relay_served_bytes_total", len(chunk))
            yield chunk


class RelayServer:
    """A relay of the board at ``board`` served over HTTP from a background thread::

        server = RelayServer("file:///srv/board", RelayConfig(cache_dir=Path("/var/cache/rp")))
        url = server.start()        # http://127.0.0.1:PORT
        ...
        server.stop()

    ``options`` adds TLS (``https://`` URL), a bearer token on reads (``/v1/``) and the
    slow-client bounds (:class:`~rollpatch.serving.ServeOptions`). ``trust`` makes the relay
    verify manifests, LATEST and roots before it caches or serves them (docs/trust.md).
    """

    def __init__(
        self,
        board: Store | str,
        config: RelayConfig,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        access_log: bool = False,
        options: ServeOptions | None = None,
        trust: Trust | None = None,
    ) -> None:
        self._owns_store = isinstance(board, str)
        upstream = open_store(board) if isinstance(board, str) else board
        self.relay = Relay(upstream, config, trust=trust)
        self.host = host
        self.port = port
        self.options = options or ServeOptions()
        self._log = (log_level, access_log)
        self._handle: ServerHandle | None = None
        #: Board reads in flight, and the refusal of new ones once :meth:`drain` is called.
        self.draining = Draining()

    @property
    def url(self) -> str:
        """``http(s)://HOST:PORT`` once started (the real port when ``port=0``)."""
        if self._handle is not None:
            return self._handle.url
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.options.scheme}://{host}:{self.port}"

    def start(self, timeout: float = 10.0) -> str:
        """Start serving in a daemon thread; returns :attr:`url` once the socket listens."""
        if self._handle is not None:
            raise ConfigError("relay server already started", url=self.url)
        try:
            self._handle = serve_app(
                create_app(self.relay, self.draining),
                self.host,
                self.port,
                name="relay",
                log_level=self._log[0],
                access_log=self._log[1],
                start_timeout=timeout,
                options=self.options,
            )
        except ConfigError:
            raise
        except RollpatchError:
            raise OSError(
                f"relay could not listen on {self.host}:{self.port} (see the log above)"
            ) from None
        self.port = self._handle.port
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving, wait for the thread, release the pools (and the store, if opened here)."""
        if "watch" in self.relay.__dict__:  # held long-polls answer now, not after the grace
            self.relay.watch.close()
        if self._handle is not None:
            self._handle.stop(timeout)
        self.relay.close()
        if self._owns_store:
            self.relay.upstream.close()

    def wait(self) -> None:
        """Block until the server stops (its thread ends)."""
        if self._handle is not None:
            self._handle.wait()

    def alive(self) -> bool:
        """Whether the server runs (started, and its thread not ended)."""
        return self._handle is not None and self._handle.alive()

    def inflight(self) -> int:
        """Board reads being answered now (bodies until their last byte)."""
        return self.draining.inflight()

    def drain(self, grace_s: float, stop: threading.Event | None = None) -> bool:
        """Shutting down: new reads get 503 (their clients retry), held long-polls answer now,
        and the reads in flight get up to ``grace_s`` to end (``stop`` set cuts it short);
        True when none is left. :meth:`stop` afterwards."""
        self.draining.start()
        if "watch" in self.relay.__dict__:
            self.relay.watch.close()
        return self.draining.wait(grace_s, stop)

    def request_stop(self) -> None:
        """Ask the server to stop (safe from a signal handler)."""
        if "watch" in self.relay.__dict__:  # held long-polls answer now, not after the grace;
            # from a thread: a signal handler must not wait on the watch's lock
            threading.Thread(target=self.relay.watch.close, daemon=True).start()
        if self._handle is not None:
            self._handle.request_stop()

    def __enter__(self: _S) -> _S:  # noqa: PYI019 (typing.Self needs 3.11)
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
