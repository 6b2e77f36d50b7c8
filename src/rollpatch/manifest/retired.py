"""Manifests signed only by keys a planned rotation retired (docs/trust.md, "Rotation").

Such a manifest no longer verifies under the current root (readers cannot use it: that is
what a rotation does), but it is no forgery: the keys of an earlier root in the chain the
reader verified signed it, for this run and version. ``rollpatch status --trust`` lists it as
retired, not refused, and a trusting relay says so in its refusal (``retired_root``), so that
``status`` through the relay can tell too (audit I M2, session 43).
"""

from __future__ import annotations

from collections.abc import Callable

import blake3

from ..errors import ManifestError, TrustError
from ..trust import MANIFEST_TYPE, Trust
from ..trust.envelope import load_envelope, verify_threshold
from ..trust.root import verify_initial_root
from .document import MAX_ENVELOPE_BYTES
from .parse import open_manifest

__all__ = ["retired_by"]


def retired_by(
    raw: bytes,
    run: str,
    version: int,
    trust: Trust | None,
    error: ManifestError,
    root_raw: Callable[[int], bytes | None],
) -> int | None:
    """The version of the earlier root whose keys signed the manifest bytes ``raw`` of
    ``run``@``version``, when ``error`` is the current root refusing their signatures; None
    when that is not so (a forgery, an unsigned or malformed manifest, a root this reader did
    not verify). ``root_raw(v)`` reads root ``v``'s bytes as stored (None: not there)."""
    if trust is None or not isinstance(error, TrustError) or error.reason != "bad_signature":
        return None
    if len(raw) > MAX_ENVELOPE_BYTES:
        return None
    try:
        env = load_envelope(raw, expect=MANIFEST_TYPE, max_bytes=MAX_ENVELOPE_BYTES)
        open_manifest(raw, run, version, None)  # well formed, naming this run and version
        for v in range(trust.root.version - 1, 0, -1):
            stored = root_raw(v)
            # only a root this reader verified (its trust file, or a step of its walk)
            if stored is None or blake3.blake3(stored).hexdigest() != trust.verified_root(v):
                continue
            root = verify_initial_root(stored)
            try:
                verify_threshold(env, root.keys, root.threshold)
            except TrustError:
                continue
            return v
    except (ManifestError, OSError):  # unreadable now: it stays refused
        return None
    return None
