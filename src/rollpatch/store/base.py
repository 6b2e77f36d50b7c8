"""The storage interface: bytes by key, the rules for keys, and the contract every backend keeps.

A key is a ``/``-separated relative string (``runs/r1/v/00000042/manifest.json``). The same key
is valid in every backend, so a board can move between a directory, S3 and a relay unchanged.
Public methods here validate their arguments and delegate to the ``_``-prefixed hooks that a
backend implements, so the key and range rules cannot drift between backends.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar

from ..errors import ConfigError, ConflictError, StoreError, TooLargeError

__all__ = [
    "MAX_KEY_BYTES",
    "RESERVED_SEGMENT_PREFIX",
    "BytesLike",
    "Keys",
    "ObjectInfo",
    "Store",
    "cas_lost",
    "check_bounds",
    "too_large",
    "validate_key",
    "validate_prefix",
]

_S = TypeVar("_S", bound="Store")
#: A list of keys (an alias: inside ``Store`` the name ``list`` is the method).
Keys = list[str]
#: What ``put`` and ``cas`` accept.
BytesLike = bytes | bytearray | memoryview

#: S3's limit on key length, in UTF-8 bytes; every backend enforces it.
MAX_KEY_BYTES = 1024
#: Path segments starting with this are kept for backend bookkeeping (temp and lock files).
RESERVED_SEGMENT_PREFIX = ".rp-"


@dataclass(frozen=True)
class ObjectInfo:
    """What ``head`` knows about an object without reading it.

    ``etag`` is an opaque token that changes whenever the content is replaced (an S3 ETag, a
    file's inode and mtime, a counter in memory); ``None`` when the backend has none.
    ``modified`` is the last write time (Unix seconds) where the backend knows it; garbage
    collection uses it to leave young unreferenced objects (an in-flight publish) alone.
    """

    key: str
    size: int
    etag: str | None = None
    modified: float | None = None


def validate_key(key: str) -> str:
    """Return ``key`` if it is a valid object key, else raise :class:`ConfigError`.

    Valid: a non-empty ``str`` of at most 1024 UTF-8 bytes, printable characters only (no NUL,
    no lone surrogates), no backslash, no leading ``/``, no empty, ``.`` or ``..`` segments, no
    segment starting with ``.rp-``.
    """
    if not isinstance(key, str):
        raise ConfigError("object key must be a str", key=key)
    if not key:
        raise ConfigError("object key must not be empty")
    _check_text(key, "object key")
    for segment in key.split("/"):
        _check_segment(segment, key, "object key")
    return key


def validate_prefix(prefix: str) -> str:
    """Return ``prefix`` if it can start a key (``""`` lists everything), else ConfigError.

    The same rules as keys (:func:`validate_key`), except that the last segment may be partial
    (``runs/r1/ver``) or empty (``runs/r1/``); ``.`` and ``..`` are refused there too.
    """
    if not isinstance(prefix, str):
        raise ConfigError("list prefix must be a str", prefix=prefix)
    if prefix:
        _check_text(prefix, "list prefix")
        *segments, last = prefix.split("/")
        for segment in segments:
            _check_segment(segment, prefix, "list prefix")
        if last in (".", ".."):
            raise ConfigError("list prefix has a '.' or '..' segment", prefix=prefix)
    return prefix


def _check_segment(segment: str, text: str, what: str) -> None:
    if segment in ("", ".", ".."):
        raise ConfigError(
            f"{what} has an empty, '.' or '..' segment",
            key=text,
            hint="keys are relative: 'a/b/c', no leading, trailing or doubled '/'",
        )
    if segment.startswith(RESERVED_SEGMENT_PREFIX):
        raise ConfigError(
            f"{what} segments starting with {RESERVED_SEGMENT_PREFIX!r} "
            "are reserved for backend bookkeeping",
            key=text,
        )


def _check_text(text: str, what: str) -> None:
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise ConfigError(
            f"{what} is not valid Unicode (a lone surrogate)",
            key=text.encode("utf-8", "backslashreplace").decode(),
        ) from None
    if size > MAX_KEY_BYTES:
        raise ConfigError(f"{what} is longer than {MAX_KEY_BYTES} UTF-8 bytes", length=size)
    if not text.isprintable():
        raise ConfigError(f"{what} has non-printable characters", key=text)
    if "\\" in text:
        raise ConfigError(f"{what} has a backslash", key=text, hint="separate segments with '/'")
    if text.startswith("/"):
        raise ConfigError(f"{what} must not start with '/'", key=text)


def check_bounds(key: str, start: int, end: int, size: int) -> None:
    """Raise :class:`ConfigError` unless ``[start, end)`` lies inside an object of ``size``."""
    if end > size:
        raise ConfigError(
            "byte range reaches past the end of the object",
            key=key,
            start=start,
            end=end,
            size=size,
            hint="ranges are [start, end) with end <= size; see head()",
        )


def cas_lost(key: str, uri: str, current: bytes | None) -> ConflictError:
    """The refusal of a compare-and-swap that found ``current`` (None: absent), not what it
    expected."""
    return ConflictError(
        "compare-and-swap lost: the content is not the expected one",
        key=key,
        store=uri,
        absent=current is None,
        hint="re-read the pointer and retry",
    )


def too_large(key: str, uri: str, size: int, max_bytes: int) -> TooLargeError:
    """The refusal of an object of ``size`` bytes where the reader takes ``max_bytes``."""
    return TooLargeError(
        "object is larger than its reader accepts: refused before reading it",
        key=key,
        store=uri,
        size=size,
        max_bytes=max_bytes,
    )


def _check_range_args(key: str, start: int, end: int) -> None:
    for name, value in (("start", start), ("end", end)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"range {name} must be an int", key=key, value=value)
    if start < 0 or end < start:
        raise ConfigError(
            "byte range must satisfy 0 <= start <= end", key=key, start=start, end=end
        )


class Store(ABC):
    """Bytes by key. Backends: ``file://`` (default), ``s3://``, ``http(s)://`` (read-only),
    ``memory://`` (tests); build one with :func:`rollpatch.store.open_store`.

    Guarantees every backend keeps:

    - ``put`` is durable before it returns and atomic: readers see all of the old content, or
      none, or all of the new; with ``if_absent=True`` (the default) it never overwrites, even
      with many processes racing: exactly one writer wins, the rest get ``AlreadyExistsError``.
    - ``cas`` is a real compare-and-swap (no lost updates) for small pointer objects.
    - ``list`` returns keys sorted by code point (the same as S3's UTF-8 byte order).
    - ``delete`` is idempotent.
    """

    uri: str
    #: False for stores that only read (the HTTP relay client).
    writable: bool = True

    # -- public API: validates, then delegates -------------------------------------------------

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """Return the whole object; :class:`NotFoundError` when absent. ``max_bytes``: what
        the reader expects at most (a manifest entry's size, a document's bound); a larger
        object is refused with :class:`TooLargeError`, by the backends of this package
        before its body is read, so whoever can write to the store cannot make a reader
        allocate what it likes."""
        validate_key(key)
        if max_bytes is None:
            return self._get(key)
        if max_bytes < 0:
            raise ConfigError("max_bytes must be >= 0", key=key, max_bytes=max_bytes)
        data = self._get_bounded(key, max_bytes)
        if len(data) > max_bytes:  # a backend that could only tell once it had read it
            raise too_large(key, self.uri, len(data), max_bytes)
        return data

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Return bytes ``[start, end)``; :class:`ConfigError` when the range is out of bounds."""
        validate_key(key)
        _check_range_args(key, start, end)
        return self._get_range(key, start, end)

    def put(self, key: str, data: BytesLike, *, if_absent: bool = True) -> None:
        """Store ``data`` under ``key``, durably and atomically.

        With ``if_absent`` (the default) raise :class:`AlreadyExistsError` if the key exists:
        published objects are immutable. ``if_absent=False`` replaces the content.
        """
        validate_key(key)
        self._require_writable("put", key)
        self._put(key, memoryview(data).cast("B"), if_absent=if_absent)

    def put_stream(
        self, key: str, chunks: Iterable[BytesLike], *, size: int, if_absent: bool = True
    ) -> None:
        """Store the concatenation of ``chunks`` (exactly ``size`` bytes) like :meth:`put`,
        without holding it whole where the backend can stream: ``file://`` keeps one chunk,
        ``s3://`` a few parts (multipart upload); other backends join the chunks.

        A total other than ``size`` is a :class:`ConfigError` and stores nothing.
        """
        validate_key(key)
        self._require_writable("put", key)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ConfigError("put_stream size must be an int >= 0", key=key, size=size)
        self._put_stream(key, _exactly(chunks, size, key), size=size, if_absent=if_absent)

    def list(self, prefix: str = "") -> Keys:
        """Return the sorted keys that start with ``prefix`` (a string prefix, not a folder)."""
        return self._list(validate_prefix(prefix))

    def delete(self, key: str) -> None:
        """Remove ``key``; deleting an absent key is not an error."""
        validate_key(key)
        self._require_writable("delete", key)
        self._delete(key)

    def head(self, key: str) -> ObjectInfo | None:
        """Return size and etag of ``key``, or ``None`` when absent."""
        return self._head(validate_key(key))

    def cas(self, key: str, data: BytesLike, *, expected: BytesLike | None) -> None:
        """Write ``data`` only if the current content equals ``expected``.

        ``expected=None`` means "only if absent". Raise :class:`ConflictError` otherwise (the
        key moved: re-read and retry). Meant for small pointer objects such as LATEST.
        """
        validate_key(key)
        self._require_writable("cas", key)
        self._cas(key, bytes(data), expected=None if expected is None else bytes(expected))

    def close(self) -> None:
        """Release connections and threads; the store must not be used afterwards."""

    def __enter__(self: _S) -> _S:  # noqa: PYI019 (typing.Self needs 3.11)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    def _require_writable(self, op: str, key: str) -> None:
        if not self.writable:
            raise StoreError(
                f"{op} refused: this store is read-only",
                key=key,
                store=self.uri,
                hint="publish through a writable store (file:// or s3://)",
            )

    # -- backend hooks: arguments are already validated ----------------------------------------

    @abstractmethod
    def _get(self, key: str) -> bytes: ...

    @abstractmethod
    def _get_range(self, key: str, start: int, end: int) -> bytes: ...

    def _get_bounded(self, key: str, max_bytes: int) -> bytes:
        """The object, refused (:func:`too_large`) when over ``max_bytes`` before its body is
        read where the backend can tell; this default reads it whole (``get`` checks)."""
        return self._get(key)

    @abstractmethod
    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None: ...

    @abstractmethod
    def _list(self, prefix: str) -> Keys: ...

    @abstractmethod
    def _delete(self, key: str) -> None: ...

    @abstractmethod
    def _head(self, key: str) -> ObjectInfo | None: ...

    @abstractmethod
    def _cas(self, key: str, data: bytes, *, expected: bytes | None) -> None: ...

    def _put_stream(
        self, key: str, chunks: Iterator[memoryview], *, size: int, if_absent: bool
    ) -> None:
        """Default: join, then ``_put`` (backends that can stream override this)."""
        buf = bytearray()
        for c in chunks:
            buf += c
        self._put(key, memoryview(buf), if_absent=if_absent)


def _exactly(chunks: Iterable[BytesLike], size: int, key: str) -> Iterator[memoryview]:
    """The chunks as byte memoryviews; ConfigError (before the last one is consumed, so the
    backend never commits) when they do not add up to ``size``."""
    seen = 0
    for c in chunks:
        mv = memoryview(c).cast("B")
        seen += len(mv)
        if seen > size:
            raise ConfigError("put_stream got more bytes than its size", key=key, size=size)
        yield mv
    if seen != size:
        raise ConfigError("put_stream got fewer bytes than its size", key=key, size=size, got=seen)
