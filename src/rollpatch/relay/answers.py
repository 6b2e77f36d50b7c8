"""How the relay answers a failure: the status for an exception (:func:`status_of`), the
error body with the exception's hint (:func:`error_answer`: clients read its message, hint and
type, docs/store.md "Errors"), and one log line per kind of upstream failure
(:class:`RefusalLog`: the same status and message again after :data:`UPSTREAM_LOG_S`)."""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from ..errors import (
    NotFoundError,
    ObjectIntegrityError,
    RollpatchError,
    TransientStoreError,
    TrustError,
)
from ..logs import Throttle
from ..serving.responses import error_body
from ..store.http_client import CORRUPT_CODE, CORRUPT_STATUS

__all__ = ["UPSTREAM_LOG_S", "RefusalLog", "error_answer", "status_of"]

log = logging.getLogger("rollpatch.relay")
#: Seconds before the same upstream failure (status and message) is logged again.
UPSTREAM_LOG_S = 60.0


def status_of(exc: BaseException) -> int:
    """The status the relay answers ``exc`` with."""
    if isinstance(exc, NotFoundError):
        return 404
    if isinstance(exc, ObjectIntegrityError):  # corrupt at the origin: retrying cannot help
        return CORRUPT_STATUS
    if isinstance(exc, (TransientStoreError, OSError)):  # upstream flaky, or our cache disk
        return 503
    return 502  # refused bytes, upstream misconfigured: requests are validated before this


#: The ``type`` of the relay's error bodies, by status.
_KINDS = {400: "invalid_request_error", 404: "not_found", 502: "upstream_error", 503: "unavailable"}


def error_answer(status: int, exc: BaseException) -> JSONResponse:
    """The edge kit's error body (:func:`~rollpatch.serving.responses.error_body`) with the
    exception's ``hint``; a corrupt object adds the ``code`` and ``key`` clients act on."""
    hint = exc.hint if isinstance(exc, RollpatchError) else None
    message = exc.message if isinstance(exc, RollpatchError) else f"{type(exc).__name__}: {exc}"
    key = exc.context.get("key") if isinstance(exc, ObjectIntegrityError) else None
    if isinstance(key, str):
        body = error_body(
            CORRUPT_STATUS, message, CORRUPT_CODE, hint=hint, code=CORRUPT_CODE, key=key
        )
        return JSONResponse(body, status_code=CORRUPT_STATUS)
    extra: dict[str, object] = {}
    if isinstance(exc, TrustError):  # its reason, and the retired root of a rotated manifest
        extra["trust_reason"] = exc.reason
        retired = exc.context.get("retired_root")
        if isinstance(retired, int) and not isinstance(retired, bool):
            extra["retired_root"] = retired
    body = error_body(status, message, _KINDS.get(status, "error"), hint=hint, **extra)
    return JSONResponse(body, status_code=status)


class RefusalLog:
    """Logs each 5xx the relay answers (its upstream failed, or it refused what it read) as a
    WARNING event ``relay_error_answer`` (path, status, error), the same status and message
    at most once per :data:`UPSTREAM_LOG_S` (a :class:`~rollpatch.logs.Throttle`; the next
    line says how many it held back, ``repeated=N``): before, a relay in front of a missing
    bucket answered 502 to every read and logged nothing."""

    def __init__(self) -> None:
        self._said = Throttle(log, UPSTREAM_LOG_S)

    def said(self, path: str, status: int, exc: BaseException) -> None:
        if status < 500:
            return
        message = exc.message if isinstance(exc, RollpatchError) else f"{exc}"
        retired = isinstance(exc, TrustError) and "retired_root" in exc.context
        self._said.event(
            "relay_error_answer",
            f"{status} {message}",
            logging.INFO if retired else logging.WARNING,  # a rotation's, not an attack
            path=path,
            status=status,
            error=message,
        )
