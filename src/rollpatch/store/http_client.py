"""``http(s)://HOST[:PORT][/PREFIX]``: a read-only client of a rollpatch relay.

The protocol is specified in ``docs/store.md`` ("Relay protocol"); in short::

    GET  {base}/v1/objects/{key}            200 body | 206 with Range | 404 | 416
    HEAD {base}/v1/objects/{key}            200 Content-Length, ETag | 404
    GET  {base}/v1/list?prefix=P[&start_after=K]   200 {"keys": [...], "next": K | null}
    any object request                      409 {"error": {...}, "code": "object_corrupt", "key": K}

409 with ``"code": "object_corrupt"`` means the relay found the origin's copy of an object
corrupt (its bytes do not match the BLAKE3 in its key): :class:`ObjectIntegrityError` naming
the key, never retried, so a follower plans around the object instead of waiting on it. A
relay is untrusted: the answer can only send a follower on a detour (every byte it uses is
still verified against the signed manifest), never make it serve other bits.

Stdlib only (``http.client`` through :mod:`.http_pool`: keep-alive connections, one TCP and
TLS handshake per connection, not per request). Every size read from the wire is checked:
bodies must match ``Content-Length``/``Content-Range``, list bodies and error bodies are
capped, and listed keys are validated.
"""

from __future__ import annotations

import functools
import http.client
import logging
import re
import socket
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import TypeVar

from .. import jsonsafe
from ..errors import (
    ConfigError,
    NotFoundError,
    StoreError,
    TransientStoreError,
)
from ..logs import Throttle
from .base import ObjectInfo, Store, check_bounds, too_large, validate_key
from .config import HttpConfig
from .http_errors import (
    CORRUPT_CODE,
    CORRUPT_STATUS,
    raise_if_corrupt,
    relay_refusal,
    relay_said,
)
from .http_pool import Held, HttpStatusError, Pool, Response
from .push import MAX_HAVE, PUSH_HEADER, PushedBytes, split_push

__all__ = ["CORRUPT_CODE", "CORRUPT_STATUS", "HELD_HEADER", "HttpStore"]

#: The header a relay sets on its answer to a long-poll of LATEST (``?after=N&wait=S``).
HELD_HEADER = "X-Rollpatch-Held"

T = TypeVar("T")
log = logging.getLogger("rollpatch.store")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
_UNSATISFIED_RANGE = re.compile(r"bytes \*/(\d+)")
_NETWORK_ERRORS = (
    OSError,
    socket.timeout,
    ConnectionError,
    http.client.HTTPException,
    TimeoutError,
)


class _Transient(Exception):
    """Internal: a failure worth another attempt."""


class HttpStore(Store):
    """Reads objects from a relay; ``put``, ``delete`` and ``cas`` raise :class:`StoreError`."""

    writable = False

    def __init__(self, base_url: str, config: HttpConfig | None = None) -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError("relay URL must be http(s)://host[:port][/prefix]", uri=base_url)
        if parts.query or parts.fragment:
            raise ConfigError("relay URL must not have a query or fragment", uri=base_url)
        self.base = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
        self.uri = self.base
        self.config = config or HttpConfig()
        self._prefix = parts.path.rstrip("/")
        self._pool = Pool(self.base, self.config.timeout)
        #: Bytes a long-poll answer pushed (:meth:`hold_pushed`), each served to one read.
        self._pushed = PushedBytes()
        #: Retried failures, said once a minute per kind: a hung relay costs ``timeout`` per
        #: attempt, and the final error comes only after every retry.
        self._said = Throttle(log, every_s=60.0)

    # -- transport ----------------------------------------------------------------------------

    def _object_target(self, key: str) -> str:
        return f"{self._prefix}/v1/objects/{urllib.parse.quote(key, safe='/')}"

    def close(self) -> None:
        """Close the idle keep-alive connections (reads open new ones as needed)."""
        self._pool.close()

    def _attempts(self, fn: Callable[[], T], key: str | None) -> T:
        """Run ``fn`` with retries on network errors, 429 and 5xx; map what remains."""
        delay = self.config.backoff
        for attempt in range(self.config.retries + 1):
            try:
                return fn()
            except _Transient as e:
                if attempt == self.config.retries:
                    raise TransientStoreError(
                        f"relay request failed: {e}", key=key, store=self.uri, attempts=attempt + 1
                    ) from None
                self._said.event(
                    "relay_retry",
                    f"{self.uri} {e}",
                    logging.WARNING,
                    store=self.uri,
                    object=key,
                    error=str(e),
                    attempt=attempt + 1,
                    attempts=self.config.retries + 1,
                    retry_in_s=round(delay, 3),
                )
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    def _open(
        self,
        target: str,
        *,
        method: str = "GET",
        headers: dict[str, str] | None = None,
        key: str | None = None,
    ) -> Response:
        try:
            return self._pool.request(method, target, {**self.config.headers, **(headers or {})})
        except HttpStatusError as e:
            said = relay_said(e)
            if e.code == 502 and said is not None and said.kind == "upstream_error":
                raise relay_refusal(said, key, self.uri) from None  # no retry changes it
            if e.code == 429 or e.code >= 500:
                raise _Transient(f"HTTP {e.code}" + (f": {said[0]}" if said else "")) from None
            if e.code == CORRUPT_STATUS and key is not None and method == "GET":
                raise_if_corrupt(e, key, self.uri)
            raise
        except _NETWORK_ERRORS as e:
            raise _Transient(str(e) or type(e).__name__) from None

    def _read_body(self, response: Response, expected: int | None, key: str | None) -> bytes:
        try:
            body = response.read() if expected is None else response.read(expected + 1)
        except _NETWORK_ERRORS as e:
            raise _Transient(f"body read failed: {e}") from None
        if expected is not None and len(body) != expected:
            raise _Transient(f"body has {len(body)} bytes, header said {expected}")
        return body

    # -- reads --------------------------------------------------------------------------------

    def hold_pushed(self, latest_key: str, latest: bytes, pushed: list[tuple[str, bytes]]) -> None:
        """Keep what a long-poll answer carried (:meth:`wait_newer`): LATEST's bytes and the
        pushed manifest and objects, each for the next read of its key (:class:`.push.PushedBytes`).
        Unverified, as any answer: the reader checks them as it checks fetched bytes."""
        self._pushed.hold({latest_key: latest, **dict(pushed)})

    def _get(self, key: str) -> bytes:
        return self._get_bounded(key, None)

    def _get_bounded(self, key: str, max_bytes: int | None) -> bytes:
        """The answer's ``Content-Length`` over ``max_bytes``: refused before its body."""
        held = self._pushed.take(key)
        if held is not None:
            return held  # bounded by the long-poll answer that carried it; get() checks

        def attempt() -> bytes:
            with self._request(key) as r:
                size = _content_length(r, key)
                if max_bytes is not None and size > max_bytes:
                    raise too_large(key, self.uri, size, max_bytes)
                return self._read_body(r, size, key)

        return self._attempts(attempt, key)

    def _request(
        self, key: str, *, method: str = "GET", headers: dict[str, str] | None = None
    ) -> Response:
        try:
            return self._open(self._object_target(key), method=method, headers=headers, key=key)
        except HttpStatusError as e:
            if e.code == 404:
                raise NotFoundError(
                    "no such object on the relay", key=key, store=self.uri
                ) from None
            if e.code == 416:
                match = _UNSATISFIED_RANGE.fullmatch(e.headers.get("Content-Range") or "")
                raise ConfigError(
                    "byte range is outside the object",
                    key=key,
                    size=int(match.group(1)) if match else None,
                ) from None
            raise StoreError(f"relay answered HTTP {e.code}", key=key, store=self.uri) from None

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        if start == end:
            info = self._head(key)
            if info is None:
                raise NotFoundError("no such object on the relay", key=key, store=self.uri)
            check_bounds(key, start, end, info.size)
            return b""

        def attempt() -> bytes:
            with self._request(key, headers={"Range": f"bytes={start}-{end - 1}"}) as r:
                if r.status == 200:  # the relay ignored Range: take the slice we asked for
                    body = self._read_body(r, _content_length(r, key), key)
                    check_bounds(key, start, end, len(body))
                    return body[start:end]
                match = _CONTENT_RANGE.fullmatch(r.headers.get("Content-Range") or "")
                if r.status != 206 or match is None:
                    raise StoreError(
                        "relay sent a bad ranged answer", key=key, status=r.status, store=self.uri
                    )
                check_bounds(key, start, end, int(match.group(3)))
                if (int(match.group(1)), int(match.group(2))) != (start, end - 1):
                    raise StoreError(
                        "relay answered another range",
                        key=key,
                        store=self.uri,
                        content_range=match.group(0),
                    )
                return self._read_body(r, end - start, key)

        return self._attempts(attempt, key)

    def _head(self, key: str) -> ObjectInfo | None:
        def attempt() -> ObjectInfo | None:
            try:
                with self._request(key, method="HEAD") as r:
                    return ObjectInfo(
                        key=key, size=_content_length(r, key), etag=r.headers.get("ETag")
                    )
            except NotFoundError:
                return None

        return self._attempts(attempt, key)

    def _list(self, prefix: str) -> list[str]:
        keys: list[str] = []
        after: str | None = None
        while True:
            page, after = self._attempts(functools.partial(self._list_page, prefix, after), None)
            keys.extend(page)
            if after is None:
                return sorted(keys)

    def _list_page(self, prefix: str, after: str | None) -> tuple[list[str], str | None]:
        query = {"prefix": prefix} | ({} if after is None else {"start_after": after})
        target = f"{self._prefix}/v1/list?{urllib.parse.urlencode(query)}"
        try:
            with self._open(target) as r:
                body = r.read(self.config.max_list_bytes + 1)
        except HttpStatusError as e:
            raise StoreError(
                f"relay list answered HTTP {e.code}", store=self.uri, prefix=prefix
            ) from None
        if len(body) > self.config.max_list_bytes:
            raise StoreError(
                "relay list answer exceeds max_list_bytes",
                store=self.uri,
                max_list_bytes=self.config.max_list_bytes,
            )
        return _parse_list(body, prefix, after, self.uri)

    # -- the long-poll of LATEST (docs/store.md, "Long-poll") ---------------------------------

    def held(self) -> Held:
        """A connection of its own for :meth:`wait_newer` (one per waiting thread)."""
        return Held(self._pool)

    def wait_newer(
        self,
        key: str,
        after: int,
        wait_s: float,
        held: Held,
        headers_out: dict[str, str] | None = None,
        *,
        push_bytes: int = 0,
        pushed_out: list[tuple[str, bytes]] | None = None,
        have: Sequence[str] = (),
    ) -> bytes | None:
        """GET the LATEST ``key``, held by the relay until it knows a version newer than
        ``after`` or ``wait_s`` passed: the body (a hint only: read and verify LATEST as
        usual), None when ``held`` was cancelled. Raises :class:`NotImplementedError` when the
        relay answered at once without holding (it predates long-polls: poll instead).
        ``headers_out`` receives the answer's headers (a relay's prefetch hint).
        ``push_bytes`` > 0 accepts up to that many bytes of the announced version's manifest
        and step patch objects in the answer (:mod:`.push`); they go to ``pushed_out`` as
        ``(key, bytes)``, unverified: the caller checks them as any fetched object. ``have``:
        tokens (:func:`.push.have_token`) of objects the caller holds, which the relay then
        leaves out of the push (at most :data:`.push.MAX_HAVE` are sent)."""
        params: dict[str, object] = {"after": after, "wait": f"{wait_s:g}"}
        if push_bytes > 0:
            params["push"] = push_bytes
            if have:
                params["have"] = ",".join(list(have)[:MAX_HAVE])
        target = f"{self._object_target(key)}?{urllib.parse.urlencode(params)}"
        limit = (1 << 20) + max(0, push_bytes)
        try:
            got = held.get(target, self.config.headers, wait_s + self.config.timeout, limit)
        except HttpStatusError as e:
            if e.code == 404:
                raise NotFoundError(
                    "no such object on the relay", key=key, store=self.uri
                ) from None
            raise StoreError(f"relay answered HTTP {e.code}", key=key, store=self.uri) from None
        except _NETWORK_ERRORS as e:
            raise TransientStoreError(
                f"relay long-poll failed: {e or type(e).__name__}", key=key, store=self.uri
            ) from None
        if got is None:
            return None
        headers, body = got
        if headers.get(HELD_HEADER) is None:
            raise NotImplementedError("the relay does not hold long-polls")
        if len(body) > limit:
            raise StoreError("relay long-poll answer is too large", key=key, store=self.uri)
        if headers_out is not None:
            headers_out.update(headers.items())
        framing = headers.get(PUSH_HEADER)
        if framing is None:
            return body
        if push_bytes <= 0:
            raise StoreError("relay pushed objects nobody asked for", key=key, store=self.uri)
        body, pushed = split_push(framing, body, self.uri)
        if pushed_out is not None:
            pushed_out.extend(pushed)
        return body

    # -- writes: refused ----------------------------------------------------------------------

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        self._require_writable("put", key)

    def _delete(self, key: str) -> None:
        self._require_writable("delete", key)

    def _cas(self, key: str, data: bytes, *, expected: bytes | None) -> None:
        self._require_writable("cas", key)


def _content_length(r: Response, key: str) -> int:
    value = r.headers.get("Content-Length")
    if value is None or not value.isdigit():
        raise StoreError("relay answer lacks a valid Content-Length", key=key)
    return int(value)


def _parse_list(
    body: bytes, prefix: str, after: str | None, uri: str
) -> tuple[list[str], str | None]:
    doc = jsonsafe.loads(
        body,
        what="relay list answer",
        error=StoreError,
        max_bytes=len(body),
        max_depth=4,
        store=uri,
    )
    keys, nxt = (doc.get("keys"), doc.get("next")) if isinstance(doc, dict) else (None, None)
    if not isinstance(keys, list) or not (nxt is None or isinstance(nxt, str)):
        raise StoreError('relay list answer must be {"keys": [str], "next": str|null}', store=uri)
    for key in keys:
        if (
            not isinstance(key, str)
            or not key.startswith(prefix)
            or (after is not None and key <= after)
        ):
            raise StoreError("relay listed a key outside the request", store=uri, key=key)
        try:
            validate_key(key)
        except ConfigError:
            raise StoreError("relay listed an invalid key", store=uri, key=key) from None
    if nxt is not None and (after is not None and nxt <= after):
        raise StoreError("relay list cursor does not advance", store=uri, next=nxt)
    return keys, nxt
