"""Tensor payload codecs, found by stable id (headers name codecs by id, never by class).

- ``rp.ctxgolomb.v1``: the context-modelled delta codec (docs/patch-format.md §4).
- ``rp.xorzstd.v1``: XOR of old and new bytes + zstd, for dense deltas (what Stitch ships).
- ``zstd`` / ``raw``: whole tensors for ``full`` ops.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import zstandard

from ..errors import CodecError, PatchDecodeError
from ..kinds import Kind
from ..view import Tensor
from .bits import (
    FixedReader,
    UnaryReader,
    decode_expgolomb,
    decode_sequence,
    read_varint,
)
from .ctxv2 import code_streams, signed_delta
from .groups import Groups
from .ops import gather

__all__ = [
    "DELTA_CODECS",
    "DeltaCodec",
    "bounded_decompress",
    "decode_full",
    "encode_full",
    "from_key",
    "get_delta_codec",
    "to_key",
]


def _consts(kind: Kind) -> tuple[int, int]:
    """(sign bit S, mask 2^W − 1) of one element."""
    return 1 << (kind.bits - 1), (1 << kind.bits) - 1


def to_key(kind: Kind, x: np.ndarray) -> np.ndarray:
    """Order-preserving integer key of each element (in the element dtype), spec §3."""
    s, mask = _consts(kind)
    dt = kind.elem_dtype.type
    x = x.astype(kind.elem_dtype, copy=False)
    if kind.order == "signmag":
        return np.where((x & dt(s)) != 0, ~x & dt(mask), x | dt(s))
    if kind.order == "twos":
        return x ^ dt(s)
    return x


def from_key(kind: Kind, key: np.ndarray) -> np.ndarray:
    """Inverse of :func:`to_key`, as the kind's element dtype."""
    s, mask = _consts(kind)
    dt = kind.elem_dtype.type
    key = key.astype(kind.elem_dtype, copy=False)
    if kind.order == "signmag":
        return np.where((key & dt(s)) != 0, key ^ dt(s), ~key & dt(mask))
    if kind.order == "twos":
        return key ^ dt(s)
    return key


def _negative(kind: Kind, old: np.ndarray) -> np.ndarray:
    if kind.order == "unsigned":
        return np.zeros(old.shape, dtype=bool)
    return (old.astype(np.uint64) & np.uint64(1 << (kind.bits - 1))) != 0


class DeltaCodec(ABC):
    """Codes one delta tensor given its base tensor."""

    codec_id: str

    @abstractmethod
    def encode(
        self, base: Tensor, positions: np.ndarray, old: np.ndarray, new: np.ndarray
    ) -> bytes: ...

    @abstractmethod
    def decode(
        self, payload: memoryview, base: Tensor, changed: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Returns (positions, old, new); raises PatchDecodeError on any inconsistency."""


def _by_context(pctx: np.ndarray, ids: np.ndarray) -> list[np.ndarray]:
    """Indices of the changed elements of each listed context, in position order."""
    order = np.argsort(pctx, kind="stable")
    cuts = np.searchsorted(pctx[order], ids, side="right")
    return np.split(order, cuts[:-1])


@dataclass(frozen=True)
class CtxGolomb(DeltaCodec):
    """Context-grouped Golomb codes: positions and delta magnitudes modelled per exponent."""

    codec_id: str = "rp.ctxgolomb.v1"

    def encode(
        self, base: Tensor, positions: np.ndarray, old: np.ndarray, new: np.ndarray
    ) -> bytes:
        kind = base.kind
        groups = Groups(kind, base.elements())
        sizes, ranks, ids = groups.split(positions)
        mag, outward = signed_delta(kind, old, new)
        members = _by_context(groups.ctx(old), ids) if ids.size else []
        return code_streams(
            kind,
            [int(g) for g in ids],
            [int(sizes[g]) for g in ids],
            ranks,
            members,
            mag,
            outward,
            with_sizes=False,
        )

    def _params(self, payload: memoryview) -> tuple[list[list[int]], int, int]:
        """(per-context [c, k_c, b_c, eg_c], k_s, offset of the unary length)."""
        plen, pos = read_varint(payload, 0)
        if pos + plen > len(payload):
            raise PatchDecodeError("params overrun the payload", codec=self.codec_id)
        params, p = [], pos
        while p < pos + plen:
            v, p = read_varint(payload, p)
            params.append(v)
        if p != pos + plen or not params or len(params) != 4 * params[0] + 2:
            raise PatchDecodeError("wrong number of params", codec=self.codec_id)
        rows = [params[1 + 4 * i : 5 + 4 * i] for i in range(params[0])]
        return rows, params[-1], pos + plen

    def decode(
        self, payload: memoryview, base: Tensor, changed: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        kind = base.kind
        rows, k_out, upos = self._params(payload)
        ulen, q = read_varint(payload, upos)
        if q + ulen > len(payload):
            raise PatchDecodeError("unary stream overruns the payload", codec=self.codec_id)
        elements = base.elements()
        groups = Groups(kind, elements)
        ids = [r[0] for r in rows]
        if (
            any(y <= x for x, y in itertools.pairwise(ids))
            or (ids and ids[-1] >= groups.ncontexts)
            or any(not 1 <= k <= changed or b > k or eg > 63 for _, k, b, eg in rows)
        ):
            raise PatchDecodeError("invalid context list", codec=self.codec_id)
        if sum(r[1] for r in rows) != changed or k_out > changed:
            raise PatchDecodeError(
                "context counts do not add up to the changed count", codec=self.codec_id
            )
        sizes, chunk_counts = groups.sizes()
        if any(k > sizes[c] for c, k, _, _ in rows):
            raise PatchDecodeError("more changes than elements in a context", codec=self.codec_id)
        ur = UnaryReader(payload[q : q + ulen])
        fr = FixedReader(payload[q + ulen :])
        ranks = [decode_sequence(int(sizes[c]), k, ur, fr) for c, k, _, _ in rows]
        positions = groups.join(np.array(ids, dtype=np.int64), ranks, chunk_counts)
        old = elements[positions]
        outward = np.zeros(changed, dtype=bool)
        outward[decode_sequence(changed, k_out, ur, fr)] = True
        members = _by_context(groups.ctx(old), np.array(ids, dtype=np.int64)) if rows else []
        bigs = [decode_sequence(int(m.size), b, ur, fr) for m, (_, _, b, _) in zip(members, rows)]
        mag = np.ones(changed, dtype=np.uint64)
        width = min(kind.bits, 63)
        for m, big, (_, _, _, eg) in zip(members, bigs, rows):
            mag[m[big]] = decode_expgolomb(big.size, eg, width, ur, fr) + np.uint64(2)
        ur.finish()
        fr.finish()
        s, mask = _consts(kind)
        if (mag > np.uint64(s)).any():
            raise PatchDecodeError("delta magnitude beyond the word range", codec=self.codec_id)
        positive = outward ^ _negative(kind, old)
        key_old = to_key(kind, old).astype(np.uint64)
        key_new = np.where(positive, key_old + mag, key_old - mag) & np.uint64(mask)
        return positions, old, from_key(kind, key_new)


@dataclass(frozen=True)
class XorZstd(DeltaCodec):
    """XOR of old and new stored bytes, zstd level 3 (dense tensors)."""

    codec_id: str = "rp.xorzstd.v1"
    level: int = 3

    def encode(
        self, base: Tensor, positions: np.ndarray, old: np.ndarray, new: np.ndarray
    ) -> bytes:
        return self.encode_changes(base.kind, base.n_elements, positions, old, new)

    def encode_changes(
        self, kind: Kind, n: int, positions: np.ndarray, old: np.ndarray, new: np.ndarray
    ) -> bytes:
        """The payload from the changed elements alone (no base tensor needed)."""
        x = np.zeros(n, dtype=kind.elem_dtype)
        x[positions] = old ^ new
        if kind.packed:
            x = (x[0::2] | (x[1::2] << 4)).astype(np.uint8)
        return self.compress(x)

    def compress(self, xor_words: np.ndarray) -> bytes:
        """The payload from the XOR of the old and new stored words."""
        return zstandard.ZstdCompressor(level=self.level).compress(xor_words.tobytes())

    def decode(
        self, payload: memoryview, base: Tensor, changed: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        raw = bounded_decompress(payload, base.nbytes)
        x = Tensor(base.kind, base.shape, np.frombuffer(raw, dtype=base.kind.word_dtype))
        xe = x.elements()
        positions = np.flatnonzero(xe)
        if positions.size != changed:
            raise PatchDecodeError(
                "changed count does not match the XOR payload", codec=self.codec_id
            )
        old = gather(base, positions)
        return positions, old, old ^ xe[positions]


def bounded_decompress(payload: memoryview | bytes, size: int, exact: bool = True) -> bytes:
    """zstd-decompress exactly (or at most) ``size`` bytes, never more (no zip bombs)."""
    try:
        declared = zstandard.frame_content_size(bytes(payload[:18]))
    except zstandard.ZstdError as e:
        raise PatchDecodeError(f"zstd payload is corrupt: {e}") from None
    if declared >= 0 and (declared > size or (exact and declared != size)):
        raise PatchDecodeError(
            "zstd frame declares the wrong size", expected=size, declared=declared
        )
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(bytes(payload))
        parts, got = [], 0
        while got < size:
            part = reader.read(min(size - got, 1 << 20))
            if not part:
                break
            parts.append(part)
            got += len(part)
        out = b"".join(parts)
        if (exact and got != size) or reader.read(1):
            raise PatchDecodeError("zstd payload has the wrong decompressed size", expected=size)
    except zstandard.ZstdError as e:
        raise PatchDecodeError(f"zstd payload is corrupt: {e}") from None
    return out


def _registry() -> dict[str, DeltaCodec]:
    from .codec_v2 import CtxGolombV2

    return {c.codec_id: c for c in (CtxGolomb(), XorZstd(), CtxGolombV2())}  # type: ignore[misc]


DELTA_CODECS: dict[str, DeltaCodec] = _registry()


def get_delta_codec(codec_id: str) -> DeltaCodec:
    try:
        return DELTA_CODECS[codec_id]
    except KeyError:
        raise CodecError(
            f"unknown delta codec {codec_id!r}", hint=f"known: {', '.join(DELTA_CODECS)}"
        ) from None


def encode_full(t: Tensor) -> tuple[str, bytes]:
    """A whole tensor: zstd when it helps, raw otherwise."""
    raw = t.data.tobytes()
    z = zstandard.ZstdCompressor(level=3).compress(raw)
    return ("zstd", z) if len(z) < len(raw) else ("raw", raw)


def decode_full(codec: str, payload: memoryview, kind: Kind, shape: tuple[int, ...]) -> Tensor:
    size = int(np.prod(shape, dtype=np.int64)) * kind.word_dtype.itemsize
    if codec == "raw":
        if len(payload) != size:
            raise PatchDecodeError("raw payload has the wrong size", expected=size)
        raw = bytes(payload)
    elif codec == "zstd":
        raw = bounded_decompress(payload, size)
    else:
        raise CodecError(f"unknown full-tensor codec {codec!r}", hint="known: zstd, raw")
    return Tensor(kind, shape, np.frombuffer(raw, dtype=kind.word_dtype).copy())
