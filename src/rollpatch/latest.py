"""The LATEST pointer document: signed (an envelope with an expiry) or, on old boards, bare.

Signed payload (``application/vnd.rollpatch.latest+json``; docs/board.md)::

    {"schema": "rollpatch.latest/1", "run": R, "version": n, "manifest": KEY,
     "target": DIGEST, "issued": ts, "expires": ts}

Bare (unsigned boards, read only without a trust root)::

    {"run": R, "version": n, "manifest": KEY, "target": DIGEST}

Parsing is strict and bounded; with a :class:`~rollpatch.trust.Trust`, a bare pointer, a bad
signature, an expired one or one older than the highest verified is refused
(:class:`~rollpatch.errors.TrustError`). The board checks that ``manifest`` is its key of
``version``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from . import jsonsafe
from .errors import ManifestError, TrustError
from .trust import LATEST_TYPE, Signer, Trust, looks_like_envelope, parse_envelope
from .types import MAX_VERSION, Pointer

__all__ = ["LATEST_SCHEMA", "MAX_POINTER_BYTES", "encode_latest", "read_latest"]

LATEST_SCHEMA = "rollpatch.latest/1"
#: A LATEST pointer is a few hundred bytes (an envelope about twice that); more is not one.
MAX_POINTER_BYTES = 64 * 1024
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HINT = "repair it: LATEST must name a published version"


def encode_latest(p: Pointer, signer: Signer | None, now: float) -> bytes:
    """LATEST's bytes: an envelope valid for ``signer.latest_ttl_s``, or the bare pointer."""
    if signer is None:
        return json.dumps(
            {"run": p.run, "version": p.version, "manifest": p.manifest, "target": p.target},
            sort_keys=True,
        ).encode()
    payload = {
        "schema": LATEST_SCHEMA,
        "run": p.run,
        "version": p.version,
        "manifest": p.manifest,
        "target": p.target,
        "issued": round(now, 3),
        "expires": round(now + signer.latest_ttl_s, 3),
    }
    return signer.seal(
        LATEST_TYPE, json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    )


def read_latest(
    raw: bytes, run: str, trust: Trust | None, refresh_root: Callable[[], object] | None = None
) -> tuple[Pointer, float | None]:
    """The pointer in ``raw`` and its expiry (None: bare), verified under ``trust`` if given.

    ``refresh_root`` is called once when no trusted key signed it (the root may have rotated).
    """
    doc = jsonsafe.loads(
        raw,
        what="LATEST pointer",
        error=ManifestError,
        max_bytes=MAX_POINTER_BYTES,
        max_depth=4,
        run=run,
        hint=_HINT,
    )
    if not looks_like_envelope(doc):
        if trust is not None:
            raise TrustError(
                "LATEST is not signed",
                reason="unsigned",
                run=run,
                hint="the trust root requires signed boards: publish with --signing-key",
            )
        return _pointer(doc, run), None
    env = parse_envelope(
        doc, expect=LATEST_TYPE, max_payload=MAX_POINTER_BYTES, run=run, what_doc="LATEST"
    )
    if trust is not None:
        try:
            trust.verify(env, run=run, what_doc="LATEST")
        except TrustError as e:
            if e.reason != "bad_signature" or refresh_root is None:
                raise
            refresh_root()
            trust.verify(env, run=run, what_doc="LATEST")
    payload = jsonsafe.loads(
        env.payload,
        what="LATEST payload",
        error=ManifestError,
        max_bytes=MAX_POINTER_BYTES,
        max_depth=2,
        run=run,
        hint=_HINT,
    )
    if not isinstance(payload, dict) or payload.get("schema") != LATEST_SCHEMA:
        raise ManifestError("LATEST payload is malformed: schema", run=run)
    pointer = _pointer(payload, run)
    expires = payload.get("expires")
    if (
        isinstance(expires, bool)
        or not isinstance(expires, (int, float))
        or not math.isfinite(expires)
    ):
        raise ManifestError("LATEST payload is malformed: expires", run=run)
    if trust is not None:
        trust.check_latest(run, pointer.version, float(expires))
    return pointer, float(expires)


def _pointer(d: Any, run: str) -> Pointer:
    if not isinstance(d, dict):
        raise ManifestError("LATEST pointer is malformed: not a JSON object", run=run)
    version, manifest, target = d.get("version"), d.get("manifest"), d.get("target")
    if d.get("run") != run:
        raise ManifestError("LATEST pointer names another run", run=run)
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise ManifestError(
            "LATEST pointer is malformed: version is not a version number",
            run=run,
            version=_short(version),
            hint=_HINT,
        )
    if not isinstance(manifest, str) or len(manifest) > 1024:
        raise ManifestError("LATEST pointer is malformed: manifest", run=run)
    if not isinstance(target, str) or not _HEX64.fullmatch(target):
        raise ManifestError(
            "LATEST pointer is malformed: target is not a digest", run=run, version=version
        )
    return Pointer(run, version, manifest, target)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
