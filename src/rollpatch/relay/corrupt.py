"""Objects the relay found corrupt upstream, remembered by the upstream copy's ETag: while
upstream still holds that copy (a HEAD says the same ETag), a request is refused without
pulling the bad bytes across the WAN again, so N followers asking for a corrupt multi-GB
keyframe cost one transfer per ``corrupt_ttl``, not N. A repaired copy has a new ETag and is
fetched at once."""

from __future__ import annotations

import time
from collections.abc import Callable

from ..errors import ObjectIntegrityError, StoreError
from ..store import ObjectInfo
from .ttl import TtlTable
from .verify import Verifier

__all__ = ["CorruptCopies"]


class CorruptCopies:
    """``head(key)``: the upstream's size and ETag of ``key`` (a counted upstream call)."""

    def __init__(
        self, head: Callable[[str], ObjectInfo | None], verifier: Verifier, ttl_s: float
    ) -> None:
        self._head, self._verifier, self._ttl_s = head, verifier, ttl_s
        self._etags: TtlTable[str] = TtlTable()  # key -> upstream ETag of the bad copy

    def refuse_known(self, key: str) -> None:
        """Raise without a GET if ``key`` was found corrupt and upstream still holds that
        copy (same ETag, by a HEAD)."""
        etag = self._etags.get(key)
        if etag is None:
            return
        info = self._head(key)
        if info is None or info.etag != etag:  # gone or replaced: fetch and check again
            return
        self._verifier.refuse("known_corrupt", key=key, etag=etag)
        raise ObjectIntegrityError(
            "upstream object does not match the BLAKE3 in its key (found before, and not "
            "replaced since); refused, not cached",
            key=key,
            hint="the upstream copy is corrupt or truncated: republish it",
        )

    def remember(self, key: str) -> None:
        """Remember the ETag of the corrupt copy ``key`` holds upstream (a HEAD right after
        the GET: a repair in between is refused for at most ``corrupt_ttl``)."""
        if self._ttl_s <= 0:
            return
        try:
            info = self._head(key)
        except StoreError:
            return  # not remembered: the next request fetches again
        if info is not None and info.etag:
            self._etags.put(key, info.etag, time.monotonic() + self._ttl_s)
