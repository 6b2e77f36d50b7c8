"""Bounded safetensors reading and writing for views (so a keyframe is a loadable checkpoint).

Format (huggingface/safetensors): 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``,
then the data section. Reading validates everything before allocating: header size cap,
known dtypes, offsets inside the file, non-overlapping and without holes (every data byte in
one tensor), ``prod(shape) * itemsize == end - begin``.

rollpatch records each tensor's element kind in ``__metadata__["rollpatch.kinds"]`` (a JSON
object, only for kinds that differ from the dtype's default, e.g. packed E2M1 codes in U8).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .. import jsonsafe
from ..errors import ViewError
from ..kinds import DTYPE_BYTES, get_kind, kind_for_dtype
from ..view import Tensor, View
from .names import check_names

__all__ = [
    "MAX_HEADER_BYTES",
    "STREAM_CHUNK_BYTES",
    "load_view",
    "read_header",
    "read_view_ranges",
    "save_view",
    "view_chunks",
    "view_from_bytes",
    "view_to_bytes",
]

#: The safetensors reference implementation's cap on the JSON header.
MAX_HEADER_BYTES = 100 * 1024 * 1024
_MAX_DIMS = 16
#: header → entry → shape list: 3 levels; the spec allows no deeper structure.
_MAX_DEPTH = 8
_KINDS_KEY = "rollpatch.kinds"
#: Largest single read of :func:`read_view_ranges` (a tensor is read in pieces of this size).
STREAM_CHUNK_BYTES = 64 * 1024 * 1024
#: Smallest window of :func:`read_view_ranges` (views of tiny tensors: few requests).
MIN_WINDOW_BYTES = 1024 * 1024


def read_header(f: BinaryIO, file_size: int) -> tuple[dict[str, Any], int]:
    """Read and validate the header; returns (header dict, data section start)."""
    raw = f.read(8)
    n = _header_len(raw, file_size)
    return _parse_json(f.read(n)), 8 + n


def _header_len(raw: bytes, file_size: int) -> int:
    if len(raw) != 8:
        raise ViewError("file too short for a safetensors header", size=file_size)
    n = int.from_bytes(raw, "little")
    if n > MAX_HEADER_BYTES or n + 8 > file_size:
        raise ViewError("safetensors header length out of bounds", header_len=n, size=file_size)
    return n


def _parse_json(raw: bytes) -> dict[str, Any]:
    # strict and bounded: no NaN, no duplicate names, no lone surrogates, no deep nesting
    header = jsonsafe.loads(
        raw,
        what="safetensors header",
        error=ViewError,
        max_bytes=MAX_HEADER_BYTES,
        max_depth=_MAX_DEPTH,
    )
    if not isinstance(header, dict):
        raise ViewError("safetensors header must be a JSON object")
    return header


def _entries(
    header: dict[str, Any], data_len: int
) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    out = []
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(e, dict) or set(e) - {"dtype", "shape", "data_offsets"}:
            raise ViewError("malformed safetensors entry", tensor=name)
        dtype, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise ViewError(f"unsupported dtype {dtype!r}", tensor=name)
        if (
            not isinstance(shape, list)
            or len(shape) > _MAX_DIMS
            or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**48 for d in shape
            )
        ):
            raise ViewError("malformed shape", tensor=name)
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            or not 0 <= offs[0] <= offs[1] <= data_len
        ):
            raise ViewError("data_offsets out of bounds", tensor=name, data_len=data_len)
        count = 1
        for d in shape:
            count *= d
        if count * DTYPE_BYTES[dtype] != offs[1] - offs[0]:
            raise ViewError("shape and dtype do not match the byte span", tensor=name)
        out.append((name, dtype, tuple(shape), offs[0], offs[1]))
    out.sort(key=lambda t: (t[3], t[4]))
    for a, b in itertools.pairwise(out):
        if b[3] < a[4]:
            raise ViewError("overlapping tensors in safetensors file", tensor=b[0])
    _no_holes(out, data_len)
    return out


def _no_holes(entries: list[tuple[str, str, tuple[int, ...], int, int]], data_len: int) -> None:
    """The format's rule: the data section is entirely indexed, without holes (bytes no
    tensor covers, before, between or after the tensors; an audit, session 41)."""
    end = 0
    for name, _, _, begin, stop in entries:
        if begin != end:
            raise ViewError(
                "safetensors file has a hole: data bytes no tensor covers (the format "
                "forbids them)",
                tensor=name,
                begin=begin,
                hole_from=end,
            )
        end = stop
    if end != data_len:
        raise ViewError(
            "safetensors file has bytes after its last tensor (the format forbids holes)",
            data_end=end,
            data_len=data_len,
        )


def _kinds_from_metadata(meta: dict[str, Any]) -> dict[str, str]:
    raw = meta.get(_KINDS_KEY)
    if raw is None:
        return {}
    if not isinstance(raw, str):
        raise ViewError("malformed rollpatch.kinds metadata")
    kinds = jsonsafe.loads(
        raw,
        what="rollpatch.kinds metadata",
        error=ViewError,
        max_bytes=MAX_HEADER_BYTES,
        max_depth=2,
    )
    if not isinstance(kinds, dict) or not all(isinstance(v, str) for v in kinds.values()):
        raise ViewError("malformed rollpatch.kinds metadata")
    return kinds


def _metadata(header: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """(view metadata, rollpatch kinds by tensor) of a parsed header."""
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ViewError("__metadata__ must map strings to strings")
    return {k: v for k, v in meta.items() if k != _KINDS_KEY}, _kinds_from_metadata(meta)


def _kind(kinds: dict[str, str], name: str, dtype: str) -> Any:
    kind = get_kind(kinds[name]) if name in kinds else kind_for_dtype(dtype)
    if kind.dtype != dtype:
        raise ViewError("kind does not match dtype", tensor=name, kind=kind.name, dtype=dtype)
    return kind


def _build(
    header: dict[str, Any], data: np.ndarray | memoryview | bytes, data_len: int, copy: bool
) -> View:
    view_meta, kinds = _metadata(header)
    buf = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    tensors = {}
    for name, dtype, shape, begin, end in _entries(header, data_len):
        kind = _kind(kinds, name, dtype)
        words = buf[begin:end]
        words = words.copy() if copy else words
        tensors[name] = Tensor(kind, shape, words.view(kind.word_dtype))
    return View(tensors, view_meta)


def read_entries_ranges(
    read: Callable[[int, int], bytes], size: int
) -> list[tuple[str, str, tuple[int, ...]]]:
    """The ``(name, dtype, shape)`` of every tensor a safetensors object of ``size`` bytes
    holds, from its header alone (two ranged reads; validated as :func:`read_view_ranges`
    validates it, not hashed: what the caller decides from it must not need the object's
    BLAKE3)."""
    header, n = _ranged_header(_checked(read, None), size)
    return [(name, dtype, shape) for name, dtype, shape, _, _ in _entries(header, size - 8 - n)]


def _checked(
    read: Callable[[int, int], bytes], feed: Callable[[bytes], object] | None
) -> Callable[[int, int], bytes]:
    """``read`` that refuses a short read and passes every byte to ``feed``."""

    def take(start: int, end: int) -> bytes:
        got = read(start, end)
        if len(got) != end - start:
            raise ViewError(
                "short read while streaming a safetensors object",
                start=start,
                end=end,
                got=len(got),
            )
        if feed is not None:
            feed(got)
        return got

    return take


def _ranged_header(take: Callable[[int, int], bytes], size: int) -> tuple[dict[str, Any], int]:
    """The parsed header of a safetensors object of ``size`` bytes and its length."""
    n = _header_len(take(0, 8) if size >= 8 else b"", size)
    return _parse_json(take(8, 8 + n)), n


def read_view_ranges(
    read: Callable[[int, int], bytes],
    size: int,
    *,
    on_bytes: Callable[[bytes], object] | None = None,
    chunk_bytes: int = STREAM_CHUNK_BYTES,
    into: Callable[[str, str, tuple[int, ...], int], np.ndarray | None] | None = None,
) -> View:
    """Read a safetensors object of ``size`` bytes through ranged reads.

    ``into(name, dtype, shape, nbytes)`` may return the ``uint8`` array of ``nbytes`` a tensor
    is read into (e.g. its place inside a larger tensor), or None to allocate it.

    ``read(start, end)`` returns bytes ``[start, end)``. The header is validated before any
    tensor is allocated; then the data section is read front to back in windows of at most
    ``chunk_bytes`` and at most the largest tensor (but at least 1 MiB; small tensors share a
    read, large ones take several), each copied into its tensors' words: memory is the view
    plus one window (≤ one tensor, or 1 MiB), never a second copy. Every byte
    of the object, in order, is passed to ``on_bytes`` (e.g. a running hash that the caller
    checks before using the view).
    """
    chunk_bytes = max(int(chunk_bytes), 1)
    take = _checked(read, on_bytes)
    header, n = _ranged_header(take, size)
    start, data_len = 8 + n, size - 8 - n
    view_meta, kinds = _metadata(header)
    entries = _entries(header, data_len)
    # a window never larger than the largest tensor (the view plus one tensor), but not tiny
    largest = max((end - begin for *_, begin, end in entries), default=0)
    chunk_bytes = min(chunk_bytes, max(largest, MIN_WINDOW_BYTES))
    words = {
        name: _destination(into, name, dtype, shape, end - begin)
        for name, dtype, shape, begin, end in entries
    }
    k = 0
    for a in range(0, data_len, chunk_bytes):
        b = min(a + chunk_bytes, data_len)
        window = np.frombuffer(take(start + a, start + b), dtype=np.uint8)
        while k < len(entries) and entries[k][4] <= a:
            k += 1
        for name, _, _, begin, end in entries[k:]:
            if begin >= b:
                break
            lo, hi = max(begin, a), min(end, b)
            words[name][lo - begin : hi - begin] = window[lo - a : hi - a]
        del window  # before the next read: one window alive, not two
    tensors = {}
    for name, dtype, shape, _, _ in entries:
        kind = _kind(kinds, name, dtype)
        tensors[name] = Tensor(kind, shape, words.pop(name).view(kind.word_dtype))
    return View(tensors, view_meta)


def _destination(
    into: Callable[[str, str, tuple[int, ...], int], np.ndarray | None] | None,
    name: str,
    dtype: str,
    shape: tuple[int, ...],
    nbytes: int,
) -> np.ndarray:
    got = None if into is None else into(name, dtype, tuple(shape), nbytes)
    if got is None:
        return np.empty(nbytes, dtype=np.uint8)
    if got.dtype != np.uint8 or got.size != nbytes or not got.flags.c_contiguous:
        raise ViewError("destination of a streamed tensor has the wrong layout", tensor=name)
    return got


def load_view(path: str | os.PathLike[str], *, mmap: bool = False) -> View:
    """Load a safetensors file as a view. ``mmap=True`` maps it copy-on-write."""
    path = Path(path)
    try:
        return _load(path, mmap)
    except ViewError as e:  # which file it was: a user passes several
        if "path" in e.context:
            raise
        raise type(e)(f"{path}: {e.message}", hint=e.hint, **e.context) from None


def _load(path: Path, mmap: bool) -> View:
    size = path.stat().st_size
    with open(path, "rb") as f:
        header, start = read_header(f, size)
        data: np.ndarray
        if mmap:
            data = np.memmap(path, dtype=np.uint8, mode="c", offset=start, shape=(size - start,))
            return _build(header, data, size - start, copy=False)
        data = np.fromfile(f, dtype=np.uint8, count=size - start)
    if data.size != size - start:
        raise ViewError("safetensors file truncated while reading", path=str(path))
    return _build(header, data, size - start, copy=False)


def view_from_bytes(raw: bytes | memoryview) -> View:
    """Parse a safetensors blob (copying tensor data out of it)."""
    mv = memoryview(raw)
    n = _header_len(bytes(mv[:8]), len(mv))
    header = _parse_json(bytes(mv[8 : 8 + n]))
    return _build(header, mv[8 + n :], len(mv) - 8 - n, copy=True)


def _header_bytes(view: View, metadata: dict[str, str] | None) -> bytes:
    check_names(view, reserved_only=True)  # a tensor there would replace the metadata
    header: dict[str, Any] = {}
    meta = dict(view.metadata)
    meta.update(metadata or {})
    kinds = {
        name: t.kind.name for name, t in view.items() if kind_for_dtype(t.dtype).name != t.kind.name
    }
    if kinds:
        meta[_KINDS_KEY] = json.dumps(kinds, sort_keys=True)
    if meta:
        header["__metadata__"] = meta
    offset = 0
    for name in sorted(view):
        t = view[name]
        header[name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)  # data section starts 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw


def view_chunks(
    view: View, metadata: dict[str, str] | None = None
) -> tuple[int, Callable[[], Iterator[memoryview]]]:
    """The safetensors serialization of ``view`` as (size, a function that yields its pieces
    in order: the header, then each tensor's words without a copy). Call the function once per
    pass (e.g. hash, then upload); nothing but the header is allocated."""
    head = _header_bytes(view, metadata)
    names = sorted(view)
    size = len(head) + sum(view[n].nbytes for n in names)

    def pieces() -> Iterator[memoryview]:
        yield memoryview(head)
        for name in names:
            yield memoryview(np.ascontiguousarray(view[name].data)).cast("B")  # type: ignore[arg-type]

    return size, pieces


def save_view(
    view: View, path: str | os.PathLike[str], metadata: dict[str, str] | None = None
) -> None:
    """Write a view as safetensors, atomically (temp file, fsync, rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.writelines(view_chunks(view, metadata)[1]())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # named by the file asked for, not the temp file (removed below)
        raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        if tmp.exists():
            tmp.unlink()


def view_to_bytes(view: View, metadata: dict[str, str] | None = None) -> bytes:
    """Serialize a view as a safetensors blob in memory."""
    parts = [_header_bytes(view, metadata)]
    parts += [view[name].data.tobytes() for name in sorted(view)]
    return b"".join(parts)
