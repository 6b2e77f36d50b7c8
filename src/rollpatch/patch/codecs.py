"""Tensor payload codecs, found by stable id (headers name codecs by id, never by class).

- ``rp.ctxgolomb.v1``: the context-modelled delta codec (docs/patch-format.md §4).
- ``rp.xorzstd.v1``: XOR of old and new bytes + zstd, for dense deltas (what Stitch ships).
- ``zstd`` / ``raw``: whole tensors for ``full`` ops.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import zstandard

from ..errors import CodecError, PatchDecodeError
from ..kinds import Kind
from ..view import Tensor
from .bits import (FixedReader, FixedWriter, UnaryReader, UnaryWriter, decode_expgolomb,
                   decode_sequence, encode_expgolomb, encode_sequence, expgolomb_cost,
                   read_varint, write_varint)
from .groups import Groups
from .ops import gather

__all__ = ["DeltaCodec", "DELTA_CODECS", "get_delta_codec", "encode_full", "decode_full",
           "to_key", "from_key"]


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


def _signed_delta(kind: Kind, old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(magnitude a ≥ 1 as uint64, positive?) of key(new) − key(old) mod 2^W, in [−S, S)."""
    s, mask = _consts(kind)
    dt = kind.elem_dtype.type
    diff = (to_key(kind, new) - to_key(kind, old)) & dt(mask)
    positive = diff < dt(s)
    mag = np.where(positive, diff, (dt(0) - diff) & dt(mask))
    return mag.astype(np.uint64), positive


def _best_order(tail: np.ndarray, bits: int) -> int:
    """Exp-Golomb order with the fewest bits (the cost is convex in the order)."""
    best, cost = 0, expgolomb_cost(tail, 0)
    for k in range(1, min(bits, 63)):
        c = expgolomb_cost(tail, k)
        if c >= cost:
            break
        best, cost = k, c
    return best


def _negative(kind: Kind, old: np.ndarray) -> np.ndarray:
    if kind.order == "unsigned":
        return np.zeros(old.shape, dtype=bool)
    return (old.astype(np.uint64) & np.uint64(1 << (kind.bits - 1))) != 0


class DeltaCodec(ABC):
    """Codes one delta tensor given its base tensor."""

    codec_id: str

    @abstractmethod
    def encode(self, base: Tensor, positions: np.ndarray, old: np.ndarray,
               new: np.ndarray) -> bytes: ...

    @abstractmethod
    def decode(self, payload: memoryview, base: Tensor,
               changed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Returns (positions, old, new); raises PatchDecodeError on any inconsistency."""


@dataclass(frozen=True)
class CtxGolomb(DeltaCodec):
    """Context-grouped Golomb codes for positions, outward/big flags and exp-Golomb tails."""

    codec_id: str = "rp.ctxgolomb.v1"

    def encode(self, base: Tensor, positions: np.ndarray, old: np.ndarray,
               new: np.ndarray) -> bytes:
        kind = base.kind
        groups = Groups(kind, base.elements())
        sizes, ranks, ids = groups.split(positions)
        mag, positive = _signed_delta(kind, old, new)
        outward = positive ^ _negative(kind, old)
        big = mag > np.uint64(1)
        tail = mag[big] - np.uint64(2)
        eg = _best_order(tail, kind.bits)
        params = bytearray()
        write_varint(params, len(ids))
        for g, r in zip(ids, ranks):
            write_varint(params, int(g))
            write_varint(params, int(r.size))
        for v in (int(outward.sum()), int(big.sum()), eg):
            write_varint(params, v)
        uw, fw = UnaryWriter(), FixedWriter()
        for g, r in zip(ids, ranks):
            encode_sequence(r, int(sizes[g]), uw, fw)
        k = int(positions.size)
        encode_sequence(np.flatnonzero(outward), k, uw, fw)
        encode_sequence(np.flatnonzero(big), k, uw, fw)
        encode_expgolomb(tail, eg, uw, fw)
        unary = uw.getvalue()
        out = bytearray()
        write_varint(out, len(params))
        out += params
        write_varint(out, len(unary))
        out += unary
        out += fw.getvalue()
        return bytes(out)

    def _params(self, params: list[int],
                ncontexts: int) -> tuple[list[int], list[int], list[int]]:
        if not params or len(params) != 2 * params[0] + 4:
            raise PatchDecodeError("wrong number of params", codec=self.codec_id)
        ids, counts = params[1:1 + 2 * params[0]:2], params[2:2 + 2 * params[0]:2]
        if any(b <= a for a, b in zip(ids, ids[1:])) or (ids and ids[-1] >= ncontexts) \
                or any(c < 1 for c in counts):
            raise PatchDecodeError("invalid context list", codec=self.codec_id)
        return ids, counts, params[-3:]

    def decode(self, payload: memoryview, base: Tensor,
               changed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        kind = base.kind
        plen, pos = read_varint(payload, 0)
        if pos + plen > len(payload):
            raise PatchDecodeError("params overrun the payload", codec=self.codec_id)
        params, p = [], pos
        while p < pos + plen:
            v, p = read_varint(payload, p)
            params.append(v)
        if p != pos + plen:
            raise PatchDecodeError("params overrun their length", codec=self.codec_id)
        ulen, q = read_varint(payload, pos + plen)
        if q + ulen > len(payload):
            raise PatchDecodeError("unary stream overruns the payload", codec=self.codec_id)
        elements = base.elements()
        groups = Groups(kind, elements)
        ids, counts, (k_out, k_big, eg) = self._params(params, groups.ncontexts)
        if sum(counts) != changed:
            raise PatchDecodeError("group counts do not add up to the changed count",
                                   codec=self.codec_id)
        if k_out > changed or k_big > changed or eg > 63:
            raise PatchDecodeError("flag counts out of range", codec=self.codec_id)
        sizes, chunk_counts = groups.sizes()
        if any(c > sizes[g] for g, c in zip(ids, counts)):
            raise PatchDecodeError("more changes than elements in a context",
                                   codec=self.codec_id)
        ur = UnaryReader(payload[q:q + ulen])
        fr = FixedReader(payload[q + ulen:])
        ranks = [decode_sequence(int(sizes[g]), c, ur, fr) for g, c in zip(ids, counts)]
        positions = groups.join(np.array(ids, dtype=np.int64), ranks, chunk_counts)
        outward = np.zeros(changed, dtype=bool)
        outward[decode_sequence(changed, k_out, ur, fr)] = True
        big = decode_sequence(changed, k_big, ur, fr)
        mag = np.ones(changed, dtype=np.uint64)
        mag[big] = decode_expgolomb(big.size, eg, min(kind.bits, 63), ur, fr) + np.uint64(2)
        ur.finish()
        fr.finish()
        s, mask = _consts(kind)
        if (mag > np.uint64(s)).any():
            raise PatchDecodeError("delta magnitude beyond the word range", codec=self.codec_id)
        old = elements[positions]
        positive = outward ^ _negative(kind, old)
        key_old = to_key(kind, old).astype(np.uint64)
        key_new = np.where(positive, key_old + mag, key_old - mag) & np.uint64(mask)
        new = from_key(kind, key_new)
        return positions, old, new


@dataclass(frozen=True)
class XorZstd(DeltaCodec):
    """XOR of old and new stored bytes, zstd level 3 (dense tensors)."""

    codec_id: str = "rp.xorzstd.v1"
    level: int = 3

    def encode(self, base: Tensor, positions: np.ndarray, old: np.ndarray,
               new: np.ndarray) -> bytes:
        x = np.zeros(base.n_elements, dtype=base.kind.elem_dtype)
        x[positions] = old ^ new
        if base.kind.packed:
            x = (x[0::2] | (x[1::2] << 4)).astype(np.uint8)
        return zstandard.ZstdCompressor(level=self.level).compress(x.tobytes())

    def decode(self, payload: memoryview, base: Tensor,
               changed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        raw = _bounded_decompress(payload, base.nbytes)
        x = Tensor(base.kind, base.shape, np.frombuffer(raw, dtype=base.kind.word_dtype))
        xe = x.elements()
        positions = np.flatnonzero(xe)
        if positions.size != changed:
            raise PatchDecodeError("changed count does not match the XOR payload",
                                   codec=self.codec_id)
        old = gather(base, positions)
        return positions, old, old ^ xe[positions]


def _bounded_decompress(payload: memoryview, size: int) -> bytes:
    """zstd-decompress exactly ``size`` bytes, never producing more (no zip bombs)."""
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(bytes(payload))
        out = reader.read(size)
        if len(out) != size or reader.read(1):
            raise PatchDecodeError("zstd payload has the wrong decompressed size",
                                   expected=size)
    except zstandard.ZstdError as e:
        raise PatchDecodeError(f"zstd payload is corrupt: {e}") from None
    return out


DELTA_CODECS: dict[str, DeltaCodec] = {c.codec_id: c for c in (CtxGolomb(), XorZstd())}


def get_delta_codec(codec_id: str) -> DeltaCodec:
    try:
        return DELTA_CODECS[codec_id]
    except KeyError:
        raise CodecError(f"unknown delta codec {codec_id!r}",
                         hint=f"known: {', '.join(DELTA_CODECS)}") from None


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
        raw = _bounded_decompress(payload, size)
    else:
        raise CodecError(f"unknown full-tensor codec {codec!r}", hint="known: zstd, raw")
    return Tensor(kind, shape, np.frombuffer(raw, dtype=kind.word_dtype).copy())
