"""Vectorised bit streams and the entropy-coding primitives of ``rp.ctxgolomb.v1``.

Two streams per tensor (see docs/patch-format.md §4): a *unary* stream of ``q`` one-bits
followed by a zero-bit per code, and a *fixed* stream of known-width fields. Splitting them is
what lets numpy decode Golomb codes without a per-symbol loop: all unary codes are found at
once from the zero bits, and every fixed-width field has a width the decoder already knows.
"""

from __future__ import annotations

import numpy as np

from ..errors import CodecError, PatchDecodeError

__all__ = [
    "FixedReader",
    "FixedWriter",
    "UnaryReader",
    "UnaryWriter",
    "bitlen",
    "decode_expgolomb",
    "decode_sequence",
    "encode_expgolomb",
    "encode_sequence",
    "golomb_m",
    "read_varint",
    "write_varint",
]

_MAX_VARINT_BYTES = 9


def write_varint(out: bytearray, value: int) -> None:
    """Unsigned LEB128."""
    if value < 0 or value >= 1 << 63:
        raise CodecError("varint out of range", value=value)
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


def read_varint(buf: memoryview | bytes, pos: int) -> tuple[int, int]:
    """Read a LEB128 varint at ``pos``; returns (value, next position). Bounded to 9 bytes."""
    value = shift = 0
    for i in range(_MAX_VARINT_BYTES):
        if pos + i >= len(buf):
            raise PatchDecodeError("truncated varint")
        byte = buf[pos + i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos + i + 1
        shift += 7
    raise PatchDecodeError("varint too long")


def bitlen(x: np.ndarray) -> np.ndarray:
    """Bit length of each non-negative uint64 (0 for 0), exact for all 64-bit values."""
    x = x.astype(np.uint64, copy=True)
    n = np.zeros(x.shape, dtype=np.int64)
    for s in (32, 16, 8, 4, 2, 1):
        big = x >= (np.uint64(1) << np.uint64(s))
        n[big] += s
        x[big] >>= np.uint64(s)
    return n + (x > 0)


def _container(width: int) -> np.dtype:
    for nbytes in (1, 2, 4, 8):
        if width <= nbytes * 8:
            return np.dtype(f">u{nbytes}")
    raise CodecError("field wider than 64 bits", width=width)


def _to_bits(values: np.ndarray, width: int) -> np.ndarray:
    """(count, width) MSB-first bit matrix of ``values`` (uint8 0/1)."""
    dt = _container(width)
    raw = np.unpackbits(values.astype(dt).view(np.uint8).reshape(values.size, dt.itemsize), axis=1)
    return raw[:, dt.itemsize * 8 - width :]


def _from_bits(block: np.ndarray, width: int) -> np.ndarray:
    """Inverse of :func:`_to_bits`: (count, width) bits → uint64 values."""
    dt = _container(width)
    pad = dt.itemsize * 8 - width
    if pad:
        block = np.concatenate([np.zeros((block.shape[0], pad), np.uint8), block], axis=1)
    return np.packbits(block, axis=1).view(dt).reshape(-1).astype(np.uint64)


class FixedWriter:
    """Accumulates fixed- and per-value-width fields, MSB first."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []

    def write(self, values: np.ndarray, width: int | np.ndarray) -> None:
        """Write each value in ``width`` bits (a scalar, or one width per value)."""
        values = np.asarray(values, dtype=np.uint64)
        if values.size == 0:
            return
        if np.ndim(width) == 0:
            if int(width):
                self._parts.append(_to_bits(values, int(width)).reshape(-1))
            return
        widths = np.asarray(width, dtype=np.int64)
        wmax = int(widths.max())
        if wmax == 0:
            return
        bits = _to_bits(values, wmax)
        keep = np.arange(wmax)[None, :] >= (wmax - widths)[:, None]
        self._parts.append(bits[keep])

    def write_bits(self, bits: np.ndarray) -> None:
        """Append raw bits (uint8 0/1)."""
        self._parts.append(bits.astype(np.uint8, copy=False))

    def getvalue(self) -> bytes:
        if not self._parts:
            return b""
        return np.packbits(np.concatenate(self._parts)).tobytes()


class FixedReader:
    """Reads fields written by :class:`FixedWriter`; every read is bounds-checked."""

    def __init__(self, data: bytes | memoryview) -> None:
        self._bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
        self._pos = 0

    def read(self, count: int, width: int) -> np.ndarray:
        if count == 0 or width == 0:
            return np.zeros(count, dtype=np.uint64)
        end = self._pos + count * width
        if end > self._bits.size:
            raise PatchDecodeError("fixed stream exhausted")
        block = self._bits[self._pos : end].reshape(count, width)
        self._pos = end
        return _from_bits(block, width)

    def read_bits(self, count: int) -> np.ndarray:
        """Read ``count`` raw bits (uint8 0/1)."""
        if self._pos + count > self._bits.size:
            raise PatchDecodeError("fixed stream exhausted")
        out = self._bits[self._pos : self._pos + count]
        self._pos += count
        return out

    def read_varwidth(self, widths: np.ndarray) -> np.ndarray:
        """Read one value per width (widths known to the decoder)."""
        widths = widths.astype(np.int64)
        total = int(widths.sum())
        if self._pos + total > self._bits.size:
            raise PatchDecodeError("fixed stream exhausted")
        if widths.size == 0:
            return np.zeros(0, dtype=np.uint64)
        wmax = int(widths.max())
        if wmax == 0:
            return np.zeros(widths.size, dtype=np.uint64)
        keep = np.arange(wmax)[None, :] >= (wmax - widths)[:, None]
        block = np.zeros((widths.size, wmax), dtype=np.uint8)
        block[keep] = self._bits[self._pos : self._pos + total]
        self._pos += total
        return _from_bits(block, wmax)

    def finish(self) -> None:
        """Reject unused bits beyond zero padding."""
        rest = self._bits[self._pos :]
        if rest.size >= 8 or rest.any():
            raise PatchDecodeError("fixed stream has unused bits")


class UnaryWriter:
    """Accumulates unary codes (q ones, then a zero)."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []

    def write(self, q: np.ndarray) -> None:
        if q.size:
            self._parts.append(q.astype(np.int64))

    def getvalue(self) -> bytes:
        if not self._parts:
            return b""
        q = np.concatenate(self._parts)
        ends = np.cumsum(q + 1) - 1
        total = int(ends[-1]) + 1
        bits = np.ones(total + (-total % 8), dtype=np.uint8)
        bits[ends] = 0
        return np.packbits(bits).tobytes()


class UnaryReader:
    """Decodes every unary code at once; hands them out in order."""

    def __init__(self, data: bytes | memoryview) -> None:
        bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
        zeros = np.flatnonzero(bits == 0)
        if zeros.size:
            if bits.size - zeros[-1] - 1 >= 8:
                raise PatchDecodeError("unary stream has unused bytes")
        elif bits.size:
            raise PatchDecodeError("unary stream holds no code")
        self._q = np.diff(zeros, prepend=-1) - 1
        self._pos = 0

    def read(self, count: int) -> np.ndarray:
        end = self._pos + count
        if end > self._q.size:
            raise PatchDecodeError("unary stream exhausted")
        out = self._q[self._pos : end]
        self._pos = end
        return out

    def finish(self) -> None:
        if self._pos != self._q.size:
            raise PatchDecodeError("unary stream has unused codes")


def golomb_m(n: int, c: int) -> int:
    """Golomb parameter for ``c`` minority slots among ``n`` (≈ ln2 · mean gap, integers)."""
    return max(1, ((n - c) * 693147 + 500000 * c) // (1000000 * c))


def encode_sequence(flags_pos: np.ndarray, n: int, uw: UnaryWriter, fw: FixedWriter) -> None:
    """Code the set slots ``flags_pos`` (sorted) of an ``n``-slot binary sequence."""
    j = int(flags_pos.size)
    if j == 0 or j == n:
        return
    if 2 * j <= n:
        minority = flags_pos
    else:
        mask = np.ones(n, dtype=bool)
        mask[flags_pos] = False
        minority = np.flatnonzero(mask)
    c = int(minority.size)
    m = golomb_m(n, c)
    if m == 1:  # dense: n raw flags cost the same as unary gaps, and are faster
        flags = np.zeros(n, dtype=np.uint8)
        flags[flags_pos] = 1
        fw.write_bits(flags)
        return
    gaps: np.ndarray = np.diff(minority.astype(np.int64), prepend=-1) - 1
    uw.write(gaps // m)
    r = gaps % m
    b = (m - 1).bit_length()
    u = (1 << b) - m
    long = r >= u
    t = np.where(long, (r + u) >> 1, r)
    fw.write(t.astype(np.uint64), b - 1)
    fw.write(((r[long] + u) & 1).astype(np.uint64), 1)


def decode_sequence(n: int, j: int, ur: UnaryReader, fr: FixedReader) -> np.ndarray:
    """Inverse of :func:`encode_sequence`: the sorted set slots (int64)."""
    if j < 0 or j > n:
        raise PatchDecodeError("set count exceeds the slots", n=n, j=j)
    if j == 0:
        return np.zeros(0, dtype=np.int64)
    if j == n:
        return np.arange(n, dtype=np.int64)
    complement = 2 * j > n
    c = n - j if complement else j
    m = golomb_m(n, c)
    if m == 1:
        flags = fr.read_bits(n)
        if int(flags.sum()) != j:
            raise PatchDecodeError("raw flag count does not match", n=n, j=j)
        return np.flatnonzero(flags)
    q = ur.read(c)
    b = (m - 1).bit_length()
    u = (1 << b) - m
    t = fr.read(c, b - 1).astype(np.int64)
    long = t >= u
    e = fr.read(int(long.sum()), 1).astype(np.int64)
    r = t.copy()
    r[long] = (t[long] * 2 + e) - u
    if (r >= m).any():
        raise PatchDecodeError("Golomb remainder out of range")
    gaps = q * m + r
    if (gaps > n).any():
        raise PatchDecodeError("Golomb gap beyond the sequence")
    minority = np.cumsum(gaps + 1) - 1
    if minority.size and minority[-1] >= n:
        raise PatchDecodeError("coded position beyond the sequence", n=n)
    if not complement:
        return minority
    mask = np.ones(n, dtype=bool)
    mask[minority] = False
    return np.flatnonzero(mask)


def encode_expgolomb(x: np.ndarray, order: int, uw: UnaryWriter, fw: FixedWriter) -> None:
    """Exp-Golomb of order ``order``: prefix in the unary stream, suffix in the fixed one."""
    if x.size == 0:
        return
    v = x.astype(np.uint64) + np.uint64(1 << order)
    length = bitlen(v)
    uw.write(length - 1 - order)
    low = v - (np.uint64(1) << (length - 1).astype(np.uint64))
    fw.write(low, length - 1)


def decode_expgolomb(
    count: int, order: int, max_bits: int, ur: UnaryReader, fr: FixedReader
) -> np.ndarray:
    """Inverse of :func:`encode_expgolomb`; rejects values wider than ``max_bits``."""
    if count == 0:
        return np.zeros(0, dtype=np.uint64)
    prefix = ur.read(count)
    widths = prefix + order
    if (widths > max_bits).any():
        raise PatchDecodeError("exp-Golomb value too wide", max_bits=max_bits)
    low = fr.read_varwidth(widths)
    return (np.uint64(1) << widths.astype(np.uint64)) + low - np.uint64(1 << order)


def expgolomb_cost(x: np.ndarray, order: int) -> int:
    """Bits :func:`encode_expgolomb` would spend."""
    if x.size == 0:
        return 0
    length = bitlen(x.astype(np.uint64) + np.uint64(1 << order))
    return int((2 * length - 1 - order).sum())
