"""A minimal JSON-over-HTTP client for vLLM's server (stdlib ``http.client`` only).

Connections are kept alive per thread: a commit is several calls inside the engine's pause,
and a fresh TCP connection for each would add its setup to the pause. A connection idle for
longer than :data:`_IDLE_S` is replaced before use (uvicorn closes idle ones after 5 s). A
server also closes kept-alive connections on its own, e.g. with hundreds of streams connected
(``bench/vllm_queue.py`` hit it: ``Broken pipe`` on a connection idle for under 2 s): a
request that fails on a reused connection before any answer came back (the send fails, or
the server closed without answering) was not read by a server that closes only idle
connections (uvicorn), and is sent once more on a fresh connection. A failure on a fresh connection, or after part of an answer, is not retried.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
import urllib.parse
from typing import Any

from ...errors import EngineError, EngineUnreachableError
from .nudge import Nudger

__all__ = ["Http"]

_MAX_BODY = 64 * 1024 * 1024  # a digest list of a very large model stays far below this
_IDLE_S = 2.0
_JSON = {"Content-Type": "application/json"}


class Http:
    """POST/GET JSON against one base URL; every failure is an :class:`EngineError`."""

    def __init__(
        self,
        base_url: str,
        timeout: float,
        *,
        nudge: str | None = None,
        nudge_s: float = 0.05,
        token: str | None = None,
    ) -> None:
        """``nudge``: a cheap GET path sent every ``nudge_s`` while a request is in flight
        longer than that (:mod:`.nudge`: vLLM's API server misses wake-ups); ``token``: sent
        as ``Authorization: Bearer`` (vLLM's ``--api-key``)."""
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._headers = dict(_JSON, **({"Authorization": f"Bearer {token}"} if token else {}))
        url = urllib.parse.urlsplit(self.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise EngineError("the engine URL must be http(s)://host:port", url=base_url)
        self._url = url
        self._local = threading.local()
        self.nudger: Nudger | None = None
        if nudge is not None:
            side = Http(base_url, min(timeout, 5.0), token=token)  # its own connection, thread
            self.nudger = Nudger(lambda: side.get(nudge), period_s=nudge_s)

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        conn, used = getattr(self._local, "conn", None), getattr(self._local, "used", 0.0)
        if conn is not None and time.monotonic() - used > _IDLE_S:
            conn.close()
            conn = None
        if conn is None:
            cls = (
                http.client.HTTPSConnection
                if self._url.scheme == "https"
                else http.client.HTTPConnection
            )
            conn = cls(self._url.hostname or "", self._url.port, timeout=timeout)
            self._local.conn = conn
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def _exchange(
        self, method: str, path: str, data: bytes | None, timeout: float
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send and take the answer's head; once more on a fresh connection when a reused one
        had been closed by the server (module docstring)."""
        conn = self._connection(timeout)
        if conn.sock is not None:  # kept alive from an earlier request
            try:
                return conn, self._send(conn, method, path, data)
            except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
                conn.close()
                self._local.conn = None
                conn = self._connection(timeout)
        return conn, self._send(conn, method, path, data)

    def _send(
        self, conn: http.client.HTTPConnection, method: str, path: str, data: bytes | None
    ) -> http.client.HTTPResponse:
        conn.request(method, self._url.path + path, body=data, headers=self._headers)
        return conn.getresponse()

    def request(
        self, method: str, path: str, body: Any = None, *, timeout: float | None = None
    ) -> Any:
        """Send one request; returns the decoded JSON body (None when empty)."""
        data = None if body is None else json.dumps(body).encode()
        watch = self.nudger.watch() if self.nudger is not None else contextlib.nullcontext()
        try:
            with watch:
                conn, resp = self._exchange(method, path, data, timeout or self.timeout)
                raw = resp.read(_MAX_BODY + 1)
        except (http.client.HTTPException, OSError) as err:
            broken = getattr(self._local, "conn", None)
            if broken is not None:
                broken.close()
            self._local.conn = None
            raise EngineUnreachableError(
                f"vLLM is not reachable: {err}",
                engine="vllm",
                url=self.base_url,
                path=path,
                hint="is the server up? (GET /health)",
            ) from None
        self._local.used = time.monotonic()
        if resp.will_close or len(raw) > _MAX_BODY:
            conn.close()
            self._local.conn = None
        if resp.status >= 400:
            raise EngineError(
                f"vLLM answered {resp.status} to {method} {path}",
                engine="vllm",
                detail=raw[:2000].decode(errors="replace"),
            )
        if len(raw) > _MAX_BODY:
            raise EngineError("vLLM's answer is too large", engine="vllm", path=path)
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise EngineError("vLLM's answer is not JSON", engine="vllm", path=path) from None

    def post(self, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        return self.request("POST", path, {} if body is None else body, timeout=timeout)

    def get(self, path: str, *, timeout: float | None = None) -> Any:
        return self.request("GET", path, timeout=timeout)
