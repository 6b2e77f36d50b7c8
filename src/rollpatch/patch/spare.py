"""The output arrays of :func:`rollpatch.patch.apply_encoded`, kept from one apply to the next.

An in-place apply fills one int64 position array and one old and one new array per element
type (docs/patch-format.md §9, work memory); they serve as the undo until the patch is
verified, then nothing reads them. Fresh arrays are fresh pages, which the kernel zeroes on
first touch: at 100M BF16 parameters and lr 1e-5 (7.7M changes, 92 MB of outputs) that was
~2.5k page faults and ~10% of the apply's CPU time on one thread. So the arrays of a
verified apply are kept (one set, ``take`` hands it to one caller at a time) and reused by
the next one that fits in them.

The trade-off is memory held between applies: at most :func:`max_bytes` (default 256 MiB,
12 bytes per change for 16-bit kinds: ~22M changes); a larger set is dropped, as before.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

__all__ = ["give", "max_bytes", "set_max_bytes", "take"]

#: key -> array: "pos" (int64), or (dtype, 0 | 1) for the old and new elements of a type
Arrays = dict[Any, np.ndarray]

_lock = threading.Lock()
_spare: Arrays = {}
_max = 256 << 20


def max_bytes() -> int:
    """The most bytes of output arrays kept between applies."""
    return _max


def set_max_bytes(n: int) -> None:
    """Keep at most ``n`` bytes of output arrays between applies (0: keep none)."""
    global _max
    if type(n) is not int or n < 0:
        raise ValueError(f"max bytes: a non-negative int, not {n!r}")
    with _lock:
        _max = n
        if n == 0:
            _spare.clear()


def take(sizes: dict[Any, tuple[np.dtype[Any], int]]) -> Arrays:
    """Arrays of at least ``sizes[key] = (dtype, length)`` each: the spare's where they are
    large enough and of that type, else new ones (an eighth larger, for the next apply)."""
    with _lock:
        spare = dict(_spare)
        _spare.clear()
    out: Arrays = {}
    for key, (dt, n) in sizes.items():
        a = spare.get(key)
        if a is None or a.dtype != dt or a.size < n:
            a = np.empty(n + n // 8, dtype=dt)
        out[key] = a
    return out


def give(arrays: Arrays) -> None:
    """Keep ``arrays`` (from :func:`take`; nothing else may hold them) for the next apply,
    if they fit in :func:`max_bytes` and no other set was kept meanwhile."""
    held = sum(a.nbytes for a in arrays.values())
    with _lock:
        if not _spare and 0 < held <= _max:
            _spare.update(arrays)
