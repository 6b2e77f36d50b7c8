"""A minimal JSON-over-HTTP client for vLLM's server (stdlib ``http.client`` only).

Connections are kept alive per thread: a commit is several calls inside the engine's pause,
and a fresh TCP connection for each would add its setup to the pause. A connection idle for
longer than :data:`_IDLE_S` is replaced before use (uvicorn closes idle ones after 5 s), so a
request is never sent on a connection the server may be closing.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from typing import Any

from ...errors import EngineError

__all__ = ["Http"]

_MAX_BODY = 64 * 1024 * 1024  # a digest list of a very large model stays far below this
_IDLE_S = 2.0


class Http:
    """POST/GET JSON against one base URL; every failure is an :class:`EngineError`."""

    def __init__(self, base_url: str, timeout: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        url = urllib.parse.urlsplit(self.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise EngineError("the engine URL must be http(s)://host:port", url=base_url)
        self._url = url
        self._local = threading.local()

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

    def request(
        self, method: str, path: str, body: Any = None, *, timeout: float | None = None
    ) -> Any:
        """Send one request; returns the decoded JSON body (None when empty)."""
        data = None if body is None else json.dumps(body).encode()
        conn = self._connection(timeout or self.timeout)
        try:
            conn.request(
                method,
                self._url.path + path,
                body=data,
                headers={"Content-Type": "application/json"},
            )
            resp = conn.getresponse()
            raw = resp.read(_MAX_BODY + 1)
        except (http.client.HTTPException, OSError) as err:
            conn.close()
            self._local.conn = None
            raise EngineError(
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
