"""``status --trust`` after a planned rotation (docs/trust.md): versions signed only by keys
the rotation retired are listed as such, not as refusals.

Such a manifest no longer verifies under the current root (readers cannot use it: that is
what a rotation does), but it is no forgery: the keys of an earlier root in the chain the
reader verified signed it. Before, ``status --trust`` exited 2 on every run until gc removed
those versions, although followers were fine (an audit, session 41).
"""

from __future__ import annotations

from typing import Any

import blake3

from ..errors import ManifestError, TrustError

__all__ = ["retired_root"]


def retired_root(board: Any, run: str, n: int, error: ManifestError) -> int | None:
    """The version of the earlier root whose keys signed ``run``@``n`` when ``error`` is the
    current root refusing its signatures; None when that is not so (a forgery, an unsigned
    or malformed manifest, a root this reader did not verify)."""
    trust = board.trust
    if trust is None or not isinstance(error, TrustError):
        return None
    if error.reason != "bad_signature":
        return None
    from ..layout import version_key
    from ..manifest import MAX_ENVELOPE_BYTES, open_manifest
    from ..trust import MANIFEST_TYPE
    from ..trust.envelope import load_envelope, verify_threshold
    from ..trust.root import verify_initial_root

    try:
        raw = board.store.get(version_key(run, n))
        if len(raw) > MAX_ENVELOPE_BYTES:
            return None
        env = load_envelope(raw, expect=MANIFEST_TYPE, max_bytes=MAX_ENVELOPE_BYTES)
        open_manifest(raw, run, n, None)  # well formed, naming this run and version
        for v in range(trust.root.version - 1, 0, -1):
            root_raw = board.root_raw(v)
            # only a root this reader verified (its trust file, or a step of the walk)
            if root_raw is None or blake3.blake3(root_raw).hexdigest() != trust.verified_root(v):
                continue
            root = verify_initial_root(root_raw)
            try:
                verify_threshold(env, root.keys, root.threshold)
            except TrustError:
                continue
            return v
    except (ManifestError, OSError):  # unreadable now: it stays refused
        return None
    return None
