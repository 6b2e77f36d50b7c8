"""Upstream objects larger than ``stream_chunk_bytes`` are fetched in ranges of that size
straight into the cache file, hashed as they arrive (:meth:`.cache.DiskCache.insert_chunks`):
a relay never holds a whole multi-GB keyframe in memory (before session 43 every miss was
one ``Store.get`` of the whole object, so a fetch held the object in memory, up to
``upstream_workers`` at once). The object is served only once it is all on disk and matches
the BLAKE3 in its key; a short, long or different one is corrupt and nothing of it is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ..errors import ConfigError, ObjectIntegrityError, TransientStoreError

__all__ = ["upstream_ranges"]


def upstream_ranges(
    read: Callable[[int, int], bytes],
    key: str,
    size: int,
    chunk_bytes: int,
    on_bytes: Callable[[int], None],
) -> Iterator[bytes]:
    """``key``'s ``size`` bytes as ``read(start, end)`` returns them, ``chunk_bytes`` at a
    time (``on_bytes`` told each chunk's length). An upstream object shorter than ``size``
    is corrupt (``ObjectIntegrityError``): its manifest names more than is stored. An
    ``OSError`` of ``read`` is raised as ``TransientStoreError``: the caller takes an
    ``OSError`` for its cache disk refusing the object (``Relay._fetch_immutable``)."""
    for start in range(0, size, chunk_bytes):
        end = min(size, start + chunk_bytes)
        try:
            data = read(start, end)
        except ConfigError as e:  # the range reaches past the stored object's end
            raise ObjectIntegrityError(
                "upstream object is shorter than its manifest names; refused, not cached",
                key=key,
                expected=size,
                cause=e.message,
                hint="the upstream copy is truncated: republish it",
            ) from None
        except OSError as e:  # the upstream's (a reset socket): not the cache disk refusing
            raise TransientStoreError(f"upstream read failed: {e}", key=key) from e
        on_bytes(len(data))
        if len(data) != end - start:
            raise ObjectIntegrityError(
                "upstream answered a range of another length; refused, not cached",
                key=key,
                start=start,
                end=end,
                got=len(data),
            )
        yield data
