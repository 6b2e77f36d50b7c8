"""Block-scaled quantisation of a 2-D master [N, K], in cache-sized chunks of rows.

A :class:`Blocking` says how many rows and columns share one scale (0 = the whole dimension):
per-tensor (0, 0), per-channel (1, 0), DeepSeek blocks (128, 128), groups along K (1, g).
Edge blocks may be partial. Each chunk is converted to float32 on the fly (bfloat16/float16
masters are never copied whole), divided by its blocks' divisors, and encoded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from .floats import CHUNK, to_float32

__all__ = ["Blocking", "block_amax", "pack_nibbles", "quantise_blocks"]


@dataclass(frozen=True)
class Blocking:
    """Rows and columns per scale block; 0 means the whole dimension."""

    rows: int
    cols: int

    def size(self, shape: tuple[int, int]) -> tuple[int, int]:
        """(rows, cols) of one block for a tensor of ``shape`` (at least 1 each)."""
        n, k = shape
        return (self.rows or max(n, 1), self.cols or max(k, 1))

    def grid(self, shape: tuple[int, int]) -> tuple[int, int]:
        """Number of blocks along each dimension (partial edge blocks included)."""
        br, bc = self.size(shape)
        return (
            1 if self.rows == 0 else -(-shape[0] // br),
            1 if self.cols == 0 else -(-shape[1] // bc),
        )


def _row_chunks(master: np.ndarray, granule: int) -> Iterator[tuple[int, np.ndarray]]:
    n, k = master.shape
    rows = max(granule, (CHUNK // max(k, 1)) // granule * granule)
    for r0 in range(0, n, rows):
        yield r0, to_float32(master[r0 : r0 + rows])


def _col_max(a: np.ndarray, bc: int) -> np.ndarray:
    """Max over groups of ``bc`` columns of a [r, K] array → [r, ceil(K/bc)]."""
    k = a.shape[1]
    if bc >= k:
        return a.max(axis=1, keepdims=True)
    if k % bc == 0:
        return a.reshape(a.shape[0], k // bc, bc).max(axis=2)
    return np.maximum.reduceat(a, np.arange(0, k, bc), axis=1)


def block_amax(master: np.ndarray, blocking: Blocking) -> np.ndarray:
    """Max |w| of every block, float32 [grid]; NaN and inf propagate (callers check)."""
    shape = master.shape
    br, bc = blocking.size(shape)
    out = np.zeros(blocking.grid(shape), dtype=np.float32)
    if master.size == 0:
        return out
    granule = br if br < shape[0] else 1
    for r0, chunk in _row_chunks(master, granule):
        cols = _col_max(np.abs(chunk), bc)
        if br >= shape[0]:
            np.maximum(out[0], cols.max(axis=0), out=out[0])
        elif br == 1:
            out[r0 : r0 + cols.shape[0]] = cols
        else:
            rows = np.maximum.reduceat(cols, np.arange(0, cols.shape[0], br), axis=0)
            out[r0 // br : r0 // br + rows.shape[0]] = rows
    return out


def _divisor_for(
    divisor: np.ndarray, blocking: Blocking, shape: tuple[int, int], r0: int, rows: int
) -> np.ndarray:
    """The divisors of the chunk rows [r0, r0+rows), broadcastable to [rows, K]."""
    br, bc = blocking.size(shape)
    k = shape[1]
    if br >= shape[0]:
        d = divisor[0:1]
    elif br == 1:
        d = divisor[r0 : r0 + rows]
    else:  # chunks are whole row blocks
        d = np.repeat(divisor[r0 // br : -(-(r0 + rows) // br)], br, axis=0)[:rows]
    if bc >= k:
        return d[:, :1]
    return np.repeat(d, bc, axis=1)[:, :k]


def quantise_blocks(
    master: np.ndarray,
    blocking: Blocking,
    divisor: np.ndarray,
    encode: Callable[[np.ndarray], np.ndarray],
    *,
    packed: bool,
) -> np.ndarray:
    """Codes of ``encode(w / divisor_of_its_block)``: uint8 [N, K], or [N, K/2] when packed.

    ``divisor`` is float32 [grid]; ``encode`` maps a float32 chunk to uint8 codes (it may
    overwrite its argument).
    """
    n, k = master.shape
    out = np.empty((n, k // 2 if packed else k), dtype=np.uint8)
    br, _ = blocking.size(master.shape)
    granule = br if br < n else 1
    for r0, chunk in _row_chunks(master, granule):
        rows = chunk.shape[0]
        scaled = np.divide(
            chunk, _divisor_for(divisor, blocking, master.shape, r0, rows), dtype=np.float32
        )
        codes = encode(scaled)
        if packed:
            pack_nibbles(codes, out=out[r0 : r0 + rows])
        else:
            out[r0 : r0 + rows] = codes
    return out


def pack_nibbles(codes: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Pack 4-bit codes [.., 2m] into bytes [.., m]: element 2i low nibble, 2i+1 high."""
    lo = codes[..., 0::2] & np.uint8(0x0F)
    hi = codes[..., 1::2] << np.uint8(4)
    return np.bitwise_or(lo, hi, out=out)
