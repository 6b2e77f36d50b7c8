"""The relay's error answers, read by the relay client (:mod:`.http_client`): a corrupt origin
copy (:data:`CORRUPT_STATUS` with :data:`CORRUPT_CODE`), and the message, hint and type of
any other refusal, so that what the relay knows reaches the follower's error instead of a
bare "HTTP 502" (docs/store.md, "Errors")."""

from __future__ import annotations

from typing import NamedTuple

from .. import jsonsafe
from ..errors import ObjectIntegrityError, StoreError, TrustError
from ..serving.responses import error_message
from .http_pool import MAX_ERROR_BYTES, HttpStatusError

__all__ = [
    "CORRUPT_CODE",
    "CORRUPT_STATUS",
    "TRUST_REASONS",
    "RelaySaid",
    "raise_if_corrupt",
    "relay_refusal",
    "relay_said",
]

#: The relay's answer for an object whose origin copy is corrupt (docs/store.md, "Errors"):
#: this status with a JSON body whose ``code`` is :data:`CORRUPT_CODE` and ``key`` the key.
CORRUPT_STATUS = 409
CORRUPT_CODE = "object_corrupt"


class RelaySaid(NamedTuple):
    """What a relay's error body says (bounded)."""

    message: str
    hint: str | None
    kind: str | None
    #: A trust refusal's ``TrustError.reason`` (the relay's ``trust_reason``), else None.
    trust_reason: str | None = None
    #: The earlier root whose keys signed a manifest the relay refused as retired by a
    #: rotation (its ``retired_root``), else None.
    retired_root: int | None = None


#: ``TrustError.reason`` values a relay may pass on (docs/trust.md).
TRUST_REASONS = frozenset({"unsigned", "bad_signature", "expired", "rollback", "root", "malformed"})


def relay_said(e: HttpStatusError) -> RelaySaid | None:
    """A relay error body's message, hint, type and trust reason — its edge kit's
    ``{"error": {"message", "type"}, "hint", "trust_reason", "retired_root"}`` — bounded, for the messages of
    errors raised here; None for any other body (a proxy in front of the relay, say)."""
    body = e.body
    if not body or len(body) > MAX_ERROR_BYTES:
        return None
    try:
        doc = jsonsafe.loads(
            body, what="relay error body", error=StoreError, max_bytes=len(body), max_depth=3
        )
    except StoreError:
        return None
    message = error_message(doc)
    if message is None or not isinstance(doc, dict):
        return None
    err, hint, reason = doc.get("error"), doc.get("hint"), doc.get("trust_reason")
    kind = err.get("type") if isinstance(err, dict) else None
    retired = doc.get("retired_root")
    ok = isinstance(retired, int) and not isinstance(retired, bool) and 0 < retired < 2**31
    return RelaySaid(
        message[:300],
        hint[:300] if isinstance(hint, str) else None,
        kind if isinstance(kind, str) else None,
        reason if reason in TRUST_REASONS else None,
        retired if ok and reason == "bad_signature" else None,
    )


def relay_refusal(said: RelaySaid, key: str | None, uri: str) -> StoreError | TrustError:
    """The error for a relay's own refusal (its upstream misconfigured, bytes refused under
    its trust root): a trust refusal as the relay's verifier raised it, with its reason;
    else a StoreError, its message prefixed once through a chain of relays."""
    hint = said.hint or f"see the log of the relay at {uri}"
    if said.trust_reason is not None:
        extra = {} if said.retired_root is None else {"retired_root": said.retired_root}
        return TrustError(
            said.message, reason=said.trust_reason, key=key, store=uri, hint=hint, **extra
        )
    prefix = "" if said.message.startswith("relay refused: ") else "relay refused: "
    return StoreError(prefix + said.message, key=key, store=uri, hint=hint)


def raise_if_corrupt(e: HttpStatusError, key: str, uri: str) -> None:
    """Raise :class:`ObjectIntegrityError` when a 409's body says the object is corrupt at
    the origin; return for any other 409 (the caller maps it like other statuses)."""
    body = e.body
    if len(body) > MAX_ERROR_BYTES:
        return
    try:
        doc = jsonsafe.loads(
            body, what="relay error body", error=StoreError, max_bytes=len(body), max_depth=2
        )
    except StoreError:
        return
    if not isinstance(doc, dict) or doc.get("code") != CORRUPT_CODE:
        return
    if doc.get("key") != key:
        raise StoreError(
            "relay reported another object corrupt than the one asked for",
            key=key,
            store=uri,
        )
    error = error_message(doc)  # the edge kit's {"error": {"message"}} or a bare string
    raise ObjectIntegrityError(
        "relay found the origin's copy of the object corrupt",
        key=key,
        store=uri,
        relay_error=error[:200] if error is not None else None,  # repr'd: no raw text
        hint="the stored copy must be republished; a follower plans around it meanwhile",
    )
