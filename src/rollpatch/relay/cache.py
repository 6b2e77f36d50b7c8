"""The relay's disk cache: verified immutable objects, bounded by bytes, LRU, restart-safe.

One file per key, at ``ROOT/{h[:2]}/{h}.blob`` where ``h = sha256(key)``. A file is::

    b"RPRELAY1" | u32 LE header length N | N bytes of JSON {"key", "size", "b3"} | the object

Files are written to ``ROOT/.tmp-*`` and renamed into place, so a reader never sees a partial
file. No fsync: the cache is a copy of upstream, and whatever a crash leaves behind is caught
on restart (wrong length: deleted while indexing; wrong bytes: refused by the lazy re-hash that
every entry found on disk passes before it is served). Whatever else is found there — a
malformed header, a folder, a link, a FIFO — is discarded and logged, never fatal: the cache is
only a copy, so the relay starts and fetches the object again. Cache files are opened without
following links and never when they are not regular files.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import stat
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

import blake3

from .. import jsonsafe
from ..errors import ConfigError, ObjectIntegrityError, RollpatchError
from ..store import validate_key
from .config import object_hash
from .metrics import Metrics

_now = time.monotonic  # the clock of the entries' checks (a test moves it)

__all__ = ["CacheEntry", "DiskCache"]

_MAGIC = b"RPRELAY1"
_PREFIX = struct.Struct("<8sI")
_MAX_HEADER = 16 * 1024
_HASH_CHUNK = 8 << 20
_TMP = ".tmp-"
_FULL = (errno.ENOSPC, errno.EDQUOT)  # a write the disk has no room for
Chunks = Callable[[], Iterator[bytes | memoryview]]  # an object's bytes, piece by piece

log = logging.getLogger("rollpatch.relay")


@dataclass(frozen=True)
class CacheEntry:
    """A cached object: where its bytes lie in which file, and their BLAKE3."""

    key: str
    path: Path
    offset: int
    size: int
    b3: str
    #: False for entries found on disk at start-up until their bytes are re-hashed.
    verified: bool = True
    #: When its bytes were last hashed (time.monotonic()): re-hashed before serving once
    #: that is ``DiskCache.recheck_s`` ago (a file that rots under a running relay).
    checked_at: float = field(default_factory=lambda: _now())

    @property
    def file_bytes(self) -> int:
        return self.offset + self.size

    @property
    def etag(self) -> str:
        return f'"{self.b3}"'


class DiskCache:
    """Thread-safe LRU of :class:`CacheEntry` by file bytes; renames and unlinks hold the lock,
    so the index and the directory always agree. Readers keep an open file: evicting a file
    that is being served unlinks it, and the bytes stay readable until the reader closes it.
    """

    def __init__(
        self,
        root: Path,
        max_bytes: int,
        metrics: Metrics | None = None,
        *,
        recheck_s: float = 600.0,
    ) -> None:
        if max_bytes < 1:
            raise ConfigError("cache max_bytes must be >= 1", max_bytes=max_bytes)
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.recheck_s = recheck_s
        self.metrics = metrics or Metrics()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, CacheEntry] = OrderedDict()
        self._bytes = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self._load()

    # -- queries ------------------------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        """Bytes of cache files currently indexed."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def peek(self, key: str) -> CacheEntry | None:
        """The entry for ``key``, verified or not, without touching its recency."""
        with self._lock:
            return self._index.get(key)

    def lookup(self, key: str) -> CacheEntry | None:
        """The entry for ``key`` if it is verified (ready to serve), and not so long ago that
        it is due for another check (:meth:`verify` then)."""
        entry = self.peek(key)
        return entry if entry is not None and self._fresh(entry) else None

    def _fresh(self, entry: CacheEntry) -> bool:
        return entry.verified and _now() - entry.checked_at < self.recheck_s

    def open(self, key: str) -> tuple[BinaryIO, CacheEntry] | None:
        """Open a verified entry for reading and mark it most recently used; None if absent."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None or not entry.verified:
                return None
            try:
                f = _open_regular(entry.path)
            except OSError:  # removed or replaced behind our back: forget it
                self._drop(key)
                return None
            self._index.move_to_end(key)
        try:
            os.utime(f.fileno())  # recency survives a restart (the index is ordered by mtime)
        except OSError:
            pass
        return f, entry

    # -- updates ------------------------------------------------------------------------------

    def insert(self, key: str, data: bytes | memoryview, b3: str) -> CacheEntry:
        """Write ``data`` (already verified against ``b3``) and index it; evicts LRU entries.
        A disk full before ``cache_bytes`` is made room on (LRU entries dropped) and written
        once more; the ``OSError`` when that fails too (the caller serves it uncached)."""
        return self.insert_chunks(key, len(data), b3, lambda: iter((data,)), check=False)

    def insert_chunks(
        self, key: str, size: int, b3: str, chunks: Chunks, *, check: bool = True
    ) -> CacheEntry:
        """:meth:`insert` of what ``chunks()`` yields, never whole in memory (a multi-GB
        keyframe streamed from upstream); with ``check``, indexed only when it is exactly
        ``size`` bytes whose BLAKE3 is ``b3``, else ``ObjectIntegrityError``, nothing kept.
        ``chunks`` is called again for the write after making room."""
        try:
            return self._insert(key, size, b3, chunks(), check)
        except OSError as e:
            if e.errno not in _FULL or not self._make_room(size + _MAX_HEADER):
                raise
        return self._insert(key, size, b3, chunks(), check)

    def _make_room(self, need: int) -> bool:
        """Drop least recently used entries until ``need`` bytes are freed (:meth:`_evict`
        under a lower bound); whether any was."""
        with self._lock:
            before = self._bytes
            dropped = self._evict(max(0, before - need), keep=0)
            freed = before - self._bytes
        if dropped:
            log.warning(
                "relay cache: the disk is full below --cache-bytes; dropped the %d least "
                "recently used entries (%d bytes) to make room",
                dropped,
                freed,
            )
        return dropped > 0

    def _insert(
        self, key: str, size: int, b3: str, chunks: Iterator[bytes | memoryview], check: bool
    ) -> CacheEntry:
        header = json.dumps({"key": key, "size": size, "b3": b3}).encode()
        path = self._path(key)
        fd, tmp = tempfile.mkstemp(prefix=_TMP, dir=self.root)
        try:
            hasher = blake3.blake3(max_threads=blake3.blake3.AUTO) if check else None
            written = 0
            with os.fdopen(fd, "wb") as f:
                f.write(_PREFIX.pack(_MAGIC, len(header)))
                f.write(header)
                for chunk in chunks:
                    written += len(chunk)
                    if written > size:
                        break
                    if hasher is not None:
                        hasher.update(chunk)
                    f.write(chunk)
            if hasher is not None and (written != size or hasher.hexdigest() != b3):
                raise ObjectIntegrityError(
                    "upstream object does not match the BLAKE3 in its key; refused, not cached",
                    key=key,
                    size=written,
                    expected=size,
                    hint="the upstream copy is corrupt or truncated: republish it",
                )
            entry = CacheEntry(key, path, _PREFIX.size + len(header), size, b3)
            with self._lock:
                path.parent.mkdir(exist_ok=True)
                os.replace(tmp, path)
                self._drop(key, unlink=False)
                self._index[key] = entry
                self._bytes += entry.file_bytes
                self._evict()
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return entry

    def verify(self, key: str) -> CacheEntry | None:
        """Re-hash an entry found on disk, or checked ``recheck_s`` ago; the verified entry,
        or None (and it is dropped)."""
        entry = self.peek(key)
        if entry is None or self._fresh(entry):
            return entry
        ok = False
        try:
            with _open_regular(entry.path) as f:
                f.seek(entry.offset)
                hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
                remaining = entry.size
                while remaining:
                    chunk = f.read(min(remaining, _HASH_CHUNK))
                    if not chunk:
                        break
                    hasher.update(chunk)
                    remaining -= len(chunk)
                ok = remaining == 0 and hasher.hexdigest() == entry.b3
        except OSError as e:
            log.warning(
                "relay cache: cannot re-read %s (%s); fetching %s again", entry.path, e, key
            )
        with self._lock:
            if self._index.get(key) is not entry:
                return None
            if not ok:  # disk rot, or a file edited under the relay: said, counted, refetched
                self._drop(key)
                log.warning(
                    "relay cache: %s does not match its BLAKE3 on disk; dropped, fetching "
                    "%s again from upstream",
                    entry.path,
                    key,
                )
                self.metrics.inc("rollpatch_relay_cache_discarded_total")
                return None
            entry = replace(entry, verified=True, checked_at=_now())
            self._index[key] = entry
            return entry

    def discard(self, key: str) -> None:
        """Forget ``key`` and delete its file."""
        with self._lock:
            self._drop(key)

    def discard_prefixes(self, *prefixes: str) -> list[str]:
        """Forget every key under one of ``prefixes`` and delete its file; the keys."""
        with self._lock:
            keys = [k for k in self._index if k.startswith(prefixes)]
            for k in keys:
                self._drop(k)
        return keys

    # -- internals ----------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        h = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
        return self.root / h[:2] / f"{h}.blob"

    def _drop(self, key: str, *, unlink: bool = True) -> None:
        entry = self._index.pop(key, None)
        if entry is None:
            return
        self._bytes -= entry.file_bytes
        if unlink:
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass

    def _evict(self, bound: int | None = None, keep: int = 1) -> int:
        """Drop least recently used entries until the files take at most ``bound`` bytes
        (default ``max_bytes``) or ``keep`` entries are left; how many were dropped. After an
        insertion the newest entry stays even when it alone exceeds the bound."""
        bound = self.max_bytes if bound is None else bound
        dropped = 0
        while self._bytes > bound and len(self._index) > keep:
            self._drop(next(iter(self._index)))
            self.metrics.inc("rollpatch_relay_evictions_total")
            dropped += 1
        return dropped

    def _load(self) -> None:
        """Index the files a previous run left (unverified), discard anything else."""
        for tmp in self.root.glob(f"{_TMP}*"):
            _discard(tmp, "a partial write")
        found: list[tuple[float, CacheEntry]] = []
        for path in self.root.glob("??/*.blob"):
            item, why = _read_entry(path)
            if item is not None and self._path(item[1].key) != path:
                item, why = None, "its key belongs to another file name"
            if item is None:
                _discard(path, why)
                self.metrics.inc("rollpatch_relay_cache_discarded_total")
                continue
            found.append(item)
        for _, entry in sorted(found, key=lambda item: item[0]):
            self._index[entry.key] = entry
            self._bytes += entry.file_bytes
        with self._lock:
            while self._bytes > self.max_bytes and self._index:  # the bound may have shrunk
                self._drop(next(iter(self._index)))


def _open_regular(path: Path) -> BinaryIO:
    """Open a cache file for reading: no link followed, never a FIFO or device (they block)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _discard(path: Path, why: str) -> None:
    """Remove something the cache cannot use; logged, never raised (start-up must go on)."""
    log.warning("relay cache: discarding %s (%s)", path, why)
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError as e:
        log.warning("relay cache: cannot remove %s: %s", path, e)


def _read_entry(path: Path) -> tuple[tuple[float, CacheEntry] | None, str]:
    """Parse a cache file's header (bounded): ``((mtime, entry), "")``, or ``(None, why)``
    for anything malformed, truncated, or not a regular file."""
    try:
        with _open_regular(path) as f:
            magic, n = _PREFIX.unpack(f.read(_PREFIX.size))
            if magic != _MAGIC or n > _MAX_HEADER:
                return None, "bad magic or header length"
            doc = jsonsafe.loads(
                f.read(n),
                what="cache header",
                error=ConfigError,
                max_bytes=_MAX_HEADER,
                max_depth=2,
            )
            st = os.fstat(f.fileno())
        if not isinstance(doc, dict):
            return None, "header is not an object"
        key, size, b3 = doc.get("key"), doc.get("size"), doc.get("b3")
        if not isinstance(key, str):
            return None, "header has no key"
        validate_key(key)
        if (
            not isinstance(size, int)
            or isinstance(size, bool)
            or not isinstance(b3, str)
            or len(b3) != 64
            or st.st_size != _PREFIX.size + n + size
        ):
            return None, "header does not match the file"
        expected = object_hash(key)
        if expected is not None and expected != b3:
            return None, "hash does not match the key"
        return (st.st_mtime, CacheEntry(key, path, _PREFIX.size + n, size, b3, verified=False)), ""
    except (OSError, struct.error, RollpatchError) as e:
        return None, f"{type(e).__name__}: {e}"
