"""A minimal JSON-over-HTTP client for vLLM's server (stdlib ``urllib`` only)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from ...errors import EngineError

__all__ = ["Http"]

_MAX_BODY = 64 * 1024 * 1024  # a digest list of a very large model stays far below this


class Http:
    """POST/GET JSON against one base URL; every failure is an :class:`EngineError`."""

    def __init__(self, base_url: str, timeout: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def request(self, method: str, path: str, body: Any = None, *,
                timeout: float | None = None) -> Any:
        """Send one request; returns the decoded JSON body (None when empty)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                raw = resp.read(_MAX_BODY + 1)
        except urllib.error.HTTPError as err:
            detail = err.read(2000).decode(errors="replace")
            raise EngineError(f"vLLM answered {err.code} to {method} {path}", engine="vllm",
                              detail=detail) from None
        except (urllib.error.URLError, OSError) as err:
            raise EngineError(f"vLLM is not reachable: {err}", engine="vllm", url=self.base_url,
                              path=path, hint="is the server up? (GET /health)") from None
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
