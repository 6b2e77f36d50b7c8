"""``status --trust`` after a planned rotation (docs/trust.md): versions signed only by keys
the rotation retired are listed as such, not as refusals (the check:
:func:`rollpatch.manifest.retired.retired_by`). Before, ``status --trust`` exited 2 on every
run until gc removed those versions, although followers were fine (an audit, session 41).
Through a trusting relay, which refuses those manifests, the relay's own check says it
(``retired_root`` in its refusal; audit I M2, session 43).
"""

from __future__ import annotations

from typing import Any

from ..errors import ManifestError, TrustError

__all__ = ["retired_root"]


def retired_root(board: Any, run: str, n: int, error: ManifestError) -> tuple[int, str] | None:
    """``(root version, who checked)`` when ``error`` is the current root refusing the
    signatures of ``run``@``n`` and keys of that earlier root in the reader's verified chain
    signed it: checked here when the bytes can be read (``"reader"``), else as the trusting
    relay that refused them checked it (``"relay"``); None when that is not so (a forgery, an
    unsigned or malformed manifest, a root this reader did not verify)."""
    from ..layout import version_key
    from ..manifest.retired import retired_by

    if board.trust is None or not isinstance(error, TrustError) or error.reason != "bad_signature":
        return None
    try:
        raw = board.store.get(version_key(run, n))
    except ManifestError as e:  # a trusting relay refused the bytes themselves
        said = e.context.get("retired_root")
        if isinstance(said, bool) or not isinstance(said, int):
            return None
        return (said, "relay") if 0 < said < board.trust.root.version else None
    except OSError:
        return None
    by = retired_by(raw, run, n, board.trust, error, board.root_raw)
    return None if by is None else (by, "reader")
