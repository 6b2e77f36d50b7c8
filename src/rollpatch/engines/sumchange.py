"""The rp.sum128 change of sparse writes, in O(changed): what a tensor's digest state
becomes when words at some positions change, from the 8-byte words they fall in only
(docs/patch-format.md §7.1: the sum is additive over words). :func:`dry_change` (native: the
old words checked in the same pass, nothing written) and :func:`sum_delta` (numpy) are used
by staging (:mod:`rollpatch.engines.staged`) and the engines that stage themselves."""

from __future__ import annotations

import numpy as np

from ..errors import BaseMismatchError, PatchError
from ..kinds import Kind
from ..view import sum128_terms

__all__ = ["SumState", "dry_change", "sum_delta"]

_M64 = (1 << 64) - 1
SumState = tuple[int, int]


#: Positions summed at a time by :func:`sum_delta` (bounds its temporaries, ~100 B each).
_SUM_SLICE = 1 << 16


def sum_delta(data: np.ndarray, positions: np.ndarray, new: np.ndarray) -> SumState:
    """How the rp.sum128 state of ``data`` (flat, contiguous words) changes when the words at
    ``positions`` (sorted int64) become ``new``: reads only the 8-byte words they fall in, a
    slice of positions at a time (slices end between 8-byte words: the sum is additive over
    words, so the slices' changes add up)."""
    if positions.size == 0:
        return 0, 0
    per = 8 // data.itemsize
    s0 = s1 = 0
    start = 0
    while start < positions.size:
        end = min(start + _SUM_SLICE, positions.size)
        while end < positions.size and positions[end] // per == positions[end - 1] // per:
            end += 1  # keep every position of an 8-byte word in one slice
        d0, d1 = _sum_delta(data, positions[start:end], new[start:end], per)
        s0, s1 = (s0 + d0) & _M64, (s1 + d1) & _M64
        start = end
    return s0, s1


def _sum_delta(data: np.ndarray, positions: np.ndarray, new: np.ndarray, per: int) -> SumState:
    widx = positions // per
    first = np.r_[True, widx[1:] != widx[:-1]]
    u = widx[first]
    row = np.cumsum(first) - 1
    idx = u[:, None] * per + np.arange(per)
    ok = idx < data.size
    old_buf = np.zeros((u.size, per), dtype=data.dtype)
    old_buf[ok] = data[idx[ok]]
    new_buf = old_buf.copy()
    new_buf[row, positions % per] = new
    j = u.astype(np.uint64)
    ow, nw = old_buf.view("<u8").reshape(-1), new_buf.view("<u8").reshape(-1)
    (a0, a1), (b0, b1) = sum128_terms(nw, j), sum128_terms(ow, j)
    return (a0 - b0) & _M64, (a1 - b1) & _M64


def dry_change(
    kind: Kind,
    words: np.ndarray,
    pos: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
    name: str,
    *,
    jmap: tuple[int, int, int] | None = None,
) -> SumState | None:
    """The rp.sum128 change of writing ``new`` at ``pos`` in ``words`` (a tensor's flat words
    of ``kind``), checked in the same native pass that writes nothing (``apply``, dry: each
    8-byte word a position falls in read once; packed kinds too): the positions strictly
    increasing and in range (else :class:`PatchError`), the words there ``old`` (else
    :class:`BaseMismatchError`). None without the native core or for words not contiguous.

    ``jmap`` ``(j0, row_words, j_skip)``: ``words`` hold a block of the tensor the change is
    of (a tensor-parallel rank's rows or columns), whose 8-byte word ``j`` is the tensor's word
    ``j + j0 + (j // row_words) * j_skip`` mod 2^64 (``row_words`` 0: no rows), so the change
    is of the whole tensor's sum (:func:`rollpatch.engines.sglang.slices.word_map`)."""
    from .. import native

    core = native.core
    if core is None or not words.flags.c_contiguous:
        return None
    n = words.size * 2 if kind.packed else words.size
    try:
        at = () if jmap is None else (False, *(j % (1 << 64) for j in jmap))
        d0, d1 = core.apply(native.kind_tuple(kind, n), words, pos, old, new, True, *at)
    except BaseMismatchError as err:
        raise BaseMismatchError("old elements differ from the engine's words", tensor=name) from err
    except ValueError as err:  # the core's refusal of the positions
        raise PatchError("positions out of range or not strictly increasing", tensor=name) from err
    return int(d0), int(d1)
