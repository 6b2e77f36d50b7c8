"""A copy with a sparse update written in (``native.core.copy_apply`` and
``rollpatch.engines.writing.copy_with_writes``): what a second buffer or a prebuilt kernel's
weight copy is made with before a commit."""

from __future__ import annotations

import numpy as np
import pytest

from rollpatch import native
from rollpatch.engines.writing import copy_with_writes
from rollpatch.errors import BaseMismatchError, TargetMismatchError

WORDS = (np.uint8, np.uint16, np.uint32, np.uint64)


def _update(
    rng: np.random.Generator, src: np.ndarray, density: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    k = int(src.size * density) if src.size else 0
    pos = np.sort(rng.choice(src.size, k, replace=False)).astype(np.int64)
    if src.size and density > 0:  # the first and the last word too
        pos = np.union1d(pos, [0, src.size - 1]).astype(np.int64)
    old = src[pos].copy()
    new = (old ^ rng.integers(1, 255, pos.size).astype(src.dtype)).astype(src.dtype)
    return pos, old, new


def _want(src: np.ndarray, pos: np.ndarray, new: np.ndarray) -> np.ndarray:
    out = src.copy()
    out[pos] = new
    return out


@pytest.mark.skipif(native.core is None, reason="the native core is not built")
@pytest.mark.parametrize("dtype", WORDS)
@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 4097, 70_001])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.3, 1.0])
def test_copy_apply_is_the_copy_with_the_new_words(dtype: type, n: int, density: float) -> None:
    """Block by block (8 KiB), every width, blocks with and without changes, first and last
    word: the copy equals numpy's copy and scatter; the source is left alone."""
    rng = np.random.default_rng(n + int(density * 1000) + np.dtype(dtype).itemsize)
    src = rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True)
    keep = src.copy()
    pos, old, new = _update(rng, src, density)
    dst = np.full_like(src, 7)
    native.core.copy_apply(src.itemsize, src, dst, pos, old, new)
    assert np.array_equal(dst, _want(src, pos, new))
    assert np.array_equal(src, keep)


@pytest.mark.skipif(native.core is None, reason="the native core is not built")
def test_copy_apply_refuses_bad_updates() -> None:
    """A differing old word, positions out of order, repeated or out of range, and arrays of
    other lengths or widths: refused with the change at fault."""
    core = native.core
    rng = np.random.default_rng(1)
    src = rng.integers(0, 1 << 16, 20_000, dtype=np.uint16)
    pos, old, new = _update(rng, src, 0.05)
    dst = np.empty_like(src)
    bad_old = old.copy()
    bad_old[17] ^= 1
    with pytest.raises(BaseMismatchError, match="at change 17"):
        core.copy_apply(2, src, dst, pos, bad_old, new)
    for bad in (pos[::-1].copy(), np.concatenate([pos[:3], pos[2:]])):
        with pytest.raises(ValueError, match="range or order"):
            core.copy_apply(2, src, dst, bad, src[bad], src[bad])
    for p in (np.array([-1], np.int64), np.array([src.size], np.int64)):
        with pytest.raises(ValueError, match="range or order"):
            core.copy_apply(2, src, dst, p, np.zeros(1, np.uint16), np.zeros(1, np.uint16))
    with pytest.raises(ValueError, match="lengths"):
        core.copy_apply(2, src, dst[:-1], pos, old, new)
    with pytest.raises(ValueError, match="lengths"):
        core.copy_apply(2, src, dst, pos, old[:-1], new)
    with pytest.raises(ValueError, match="lengths"):
        core.copy_apply(3, src, dst, pos, old, new)
    with pytest.raises((ValueError, BufferError, TypeError)):  # a read-only destination
        core.copy_apply(2, src, bytes(src.nbytes), pos, old, new)
    both = src.copy()
    for s_, d_ in ((both, both), (both[:-2], both[2:])):  # the same or overlapping words
        with pytest.raises(ValueError, match="overlap"):
            core.copy_apply(2, s_, d_, pos[:0], old[:0], new[:0])


@pytest.mark.parametrize("with_core", [True, False])
def test_copy_with_writes_native_and_general_paths(
    monkeypatch: pytest.MonkeyPatch, with_core: bool
) -> None:
    """The same copy with and without the native core; words compared as words (a NaN's
    payload, -0); positions out of order take the general path; a differing old word raises
    BaseMismatchError naming the parameter."""
    if with_core and native.core is None:
        pytest.skip("the native core is not built")
    if not with_core:
        monkeypatch.setattr(native, "core", None)
    rng = np.random.default_rng(2)
    src = rng.integers(0, 1 << 16, 50_000, dtype=np.uint16)
    src[:2] = (0x7FC1, 0x8000)  # a NaN with a payload, -0
    pos, old, new = _update(rng, src, 0.02)
    dst = np.empty_like(src)
    copy_with_writes(src, dst, pos, old, new, "w")
    assert np.array_equal(dst, _want(src, pos, new))
    shuffled = rng.permutation(pos.size)
    dst2 = np.empty_like(src)
    copy_with_writes(src, dst2, pos[shuffled], old[shuffled], new[shuffled], "w")
    assert np.array_equal(dst2, dst)
    bad = old.copy()
    bad[3] ^= 1
    with pytest.raises(BaseMismatchError) as got:
        copy_with_writes(src, np.empty_like(src), pos, bad, new, "w")
    assert got.value.context["param"] == "w"
    with pytest.raises(ValueError, match="one layout"):
        copy_with_writes(src, dst[:-1], pos, old, new, "w")
    with pytest.raises(ValueError, match="overlap"):
        copy_with_writes(dst, dst, pos, new, new, "w")


def test_copy_with_writes_read_back_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that does not land (the scatter stubbed out on the general path) is caught by
    the read-back."""
    from rollpatch.engines import writing

    monkeypatch.setattr(native, "core", None)
    monkeypatch.setattr(writing, "_scatter", lambda flat, off, new: None)
    rng = np.random.default_rng(3)
    src = rng.integers(0, 1 << 16, 1000, dtype=np.uint16)
    pos, old, new = _update(rng, src, 0.05)
    with pytest.raises(TargetMismatchError, match="read-back"):
        copy_with_writes(src, np.empty_like(src), pos, old, new, "w")
