"""The native core at every instruction-set level this machine runs (scalar, AVX2,
AVX-512), each forced in turn: the numpy reference's bytes and views (tests/test_native.py
checks the default level)."""

from __future__ import annotations

import numpy as np
import pytest

from rollpatch import native
from rollpatch.errors import RollpatchError
from rollpatch.kinds import KINDS
from rollpatch.patch.ctxv2 import CHUNK
from rollpatch.view import Tensor, _sum128_numpy
from tests.test_native import NATIVE, _both
from tests.test_patch import _perturb, _words

# Every instruction-set level of the core this machine runs (scalar, AVX2, AVX-512): the
# default path is the best one, so without forcing each the others are never run here.
LEVELS = native.ISAS[: native.ISAS.index(native.isa()[1]) + 1]


@pytest.fixture
def isa_level(request: pytest.FixtureRequest) -> object:
    used, _ = native.isa(request.param)
    assert used == request.param
    yield request.param
    native.isa("default")


@pytest.mark.parametrize("isa_level", LEVELS, indirect=True)
@pytest.mark.parametrize("kind_name", sorted(KINDS))
def test_every_isa_level_gives_the_same_bytes_and_views(isa_level: str, kind_name: str) -> None:
    """Encode, decode and in-place decode at each level forced: the numpy reference's bytes
    and views (whole 256-element blocks, a short last block, several chunks, every density:
    contexts inside and outside the join's window, blocks with none or many changes)."""
    kind = KINDS[kind_name]
    for n, density in ((1000, 0.4), (65_536 + 17, 0.002), (65_536 + 17, 0.3), (CHUNK + 3, 0.01)):
        rng = np.random.default_rng(n + int(1000 * density))
        words = n // 2 if kind.packed else n
        a = _words(rng, kind_name, words)
        b = _perturb(rng, kind_name, a, density)
        t, u = Tensor(kind, (a.size,), a), Tensor(kind, (b.size,), b.astype(kind.word_dtype))
        payload = _both(t, u, reuse_reference=True)
        ea, eb = t.elements(), u.elements()
        pos = np.flatnonzero(ea != eb)
        if not pos.size:
            continue
        w = Tensor(kind, t.shape, t.data.copy())
        p, o, nw, _, state = NATIVE.decode_into_hashed(memoryview(payload), w, int(pos.size))
        assert np.array_equal(p, pos) and np.array_equal(o, ea[pos]) and np.array_equal(nw, eb[pos])
        assert np.array_equal(w.data, u.data), "in-place decode wrote other words"
        assert state == _sum128_numpy(u.data.reshape(-1).view(np.uint8)), "in-pass hash"


def test_isa_levels_are_forced_and_restored() -> None:
    """``rollpatch.native.isa``: a forced level is the one in use; one above the CPU's best
    runs as the best; unknown names are refused; "default" goes back to the best (or to
    ROLLPATCH_ISA)."""
    best = native.isa()[1]
    try:
        assert native.isa("scalar") == ("scalar", best)
        assert native.isa("avx512")[0] == best
        with pytest.raises(RollpatchError):
            native.isa("sse9")
    finally:
        native.isa("default")
    assert native.isa()[0] in native.ISAS


@pytest.mark.parametrize("isa_level", LEVELS, indirect=True)
@pytest.mark.parametrize("kind_name", sorted(KINDS))
def test_every_isa_level_encodes_the_same_bytes(isa_level: str, kind_name: str) -> None:
    """The encoder's pass at each level forced (scalar, AVX2, AVX-512): the numpy
    reference's bytes, for weights whose contexts are few (hot) and for random words
    (contexts everywhere, cold), at densities from one change per block to every element,
    over a chunk boundary and a short last block."""
    rng = np.random.default_rng(len(kind_name) * 7 + len(isa_level))
    kind = KINDS[kind_name]
    for n, density, uniform in [
        (65_536 + 300, 0.002, False),
        (65_536 + 300, 0.08, False),
        (65_536 + 300, 0.08, True),
        (70_001, 0.5, False),
        (70_001, 0.97, True),
        (CHUNK + 1000, 0.03, False),
    ]:
        words = max(n // 2 if kind.packed else n, 1)
        if uniform:
            a = rng.integers(0, 256, words * kind.word_dtype.itemsize, dtype=np.uint8)
            a = a.view(kind.word_dtype)
        else:
            a = _words(rng, kind_name, words)
        b = _perturb(rng, kind_name, a, density)
        _both(
            Tensor(kind, (a.size,), a),
            Tensor(kind, (b.size,), b.astype(kind.word_dtype)),
            reuse_reference=True,
        )


@pytest.mark.parametrize("isa_level", LEVELS, indirect=True)
@pytest.mark.parametrize("kind_name", sorted(KINDS))
def test_every_isa_level_diffs_the_same_positions(isa_level: str, kind_name: str) -> None:
    """``core.diff`` (rp_diff.c) at each level forced: numpy's positions of the elements that
    differ, over whole tensors and sub-ranges that start and end anywhere (odd 4-bit codes, a
    range shorter than one 64-byte step), at densities from none to every element, and past
    the output's first guess (as bytes, the worst case reserved once; as a mapping grown per
    2^20 elements, forced with ``reserve=0``; into a caller's buffer, refused when it has no
    room for the worst case, is read-only or misaligned), and with the differing words of
    both tensors into the caller's buffers too (kinds of 8 bits and more)."""
    core = native.core
    assert core is not None
    kind = KINDS[kind_name]
    rng = np.random.default_rng(len(kind_name) * 11 + len(isa_level))
    for n, density in ((1, 1.0), (300, 0.0), (1001, 0.5), (70_001, 0.97), ((1 << 20) + 333, 0.06)):
        words = max(n // 2 if kind.packed else n, 1)
        a = _words(rng, kind_name, words)
        b = _perturb(rng, kind_name, a, density).astype(kind.word_dtype)
        t, u = Tensor(kind, (a.size,), a), Tensor(kind, (b.size,), b)
        ea, eb = t.elements(), u.elements()
        kt = native.kind_tuple(kind, t.n_elements)
        m = t.n_elements
        for start, count in ((0, m), (1, m - 1), (m // 3, m // 3 + 1), (m - 1, 1), (5, 0)):
            if start + count > m or start < 0:
                continue
            want = start + np.flatnonzero(ea[start : start + count] != eb[start : start + count])
            for reserve in (
                (),
                (0,),
            ):  # the worst case reserved as bytes; a mapping grown by ranges
                got = np.frombuffer(core.diff(kt, t.data, u.data, start, count, *reserve), np.int64)
                assert np.array_equal(got, want), (n, density, start, count, reserve)
            room = np.full(count + 1, -7, np.int64)  # a caller's buffer: the count returned
            found = core.diff(kt, t.data, u.data, start, count, 0, room[:count])
            assert np.array_equal(room[:found], want) and room[count] == -7  # none past it
            if kind.packed:  # words out only for kinds of 8 bits and more
                with pytest.raises(ValueError, match="8 bits"):
                    core.diff(kt, t.data, u.data, start, count, 0, room[:count], a, b.copy())
                continue
            olds, news = (np.full(count + 1, 7, kind.word_dtype) for _ in "on")
            room[:] = -7
            found = core.diff(kt, t.data, u.data, start, count, 0, room[:count], olds, news)
            assert np.array_equal(room[:found], want) and room[count] == -7
            assert np.array_equal(olds[:found], a[want]) and np.array_equal(news[:found], b[want])
            assert olds[count] == news[count] == 7  # none past the room for n words
        with pytest.raises(ValueError):
            core.diff(kt, t.data, u.data, 0, m + 1)
        if not kind.packed:
            pos, w = np.empty(m, np.int64), np.empty(m, kind.word_dtype)
            for bad in ((w, None), (None, w), (w[:-1], w.copy()), (w, w.copy()[:-1])):
                with pytest.raises(ValueError):  # both or neither, with room for n words each
                    core.diff(kt, t.data, u.data, 0, m, 0, pos, *bad)
            with pytest.raises(ValueError, match="with out only"):
                core.diff(kt, t.data, u.data, 0, m, 0, None, w, w.copy())
        for bad in (np.empty(m - 1, np.int64), np.empty(m, np.int64)[:-1]):
            with pytest.raises(ValueError):  # no room for the worst case: nothing written
                core.diff(kt, t.data, u.data, 0, m, 0, bad)
        with pytest.raises((ValueError, BufferError, TypeError)):  # read-only
            core.diff(kt, t.data, u.data, 0, m, 0, bytes(8 * m))
        with pytest.raises(ValueError):  # misaligned
            core.diff(kt, t.data, u.data, 0, m, 0, np.zeros(8 * m + 1, np.uint8)[1:])


def _merge_ref(
    p: tuple[np.ndarray, np.ndarray, np.ndarray], q: tuple[np.ndarray, np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The composed change by numpy: every position of either list, the first's old word where
    it has one and the second's new word where it has one, no-ops dropped."""
    allp = np.union1d(p[0], q[0])
    ip, iq = np.searchsorted(allp, p[0]), np.searchsorted(allp, q[0])
    old, new = np.empty(allp.size, p[1].dtype), np.empty(allp.size, p[1].dtype)
    new[ip], new[iq] = p[2], q[2]
    old[iq], old[ip] = q[1], p[1]
    keep = old != new
    return allp[keep], old[keep], new[keep]


@pytest.mark.parametrize("isa_level", LEVELS, indirect=True)
@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_every_isa_level_composes_like_the_numpy_merge(isa_level: str, width: int) -> None:
    """``core.compose`` (rp_compose.c) at each level forced: numpy's merge for lists of every
    shape the run loop meets (one sparse and one dense list either way round, equal sizes,
    shared positions, runs longer than eight, tails shorter than eight, empty lists, no-op
    entries and changes undone), then a disagreement (-1) and positions out of order in
    either list (ValueError, also when a disagreement comes first)."""
    core = native.core
    assert core is not None
    dt = np.dtype(f"u{width}")
    rng = np.random.default_rng(width * 31 + len(isa_level))
    hi = 1 << min(8 * width, 16)

    def lists(n: int, dp: float, dq: float) -> tuple[tuple[np.ndarray, ...], ...]:
        base = rng.integers(0, hi, n).astype(dt)
        mid = base.copy()
        pp = np.flatnonzero(rng.random(n) < dp).astype(np.int64)
        mid[pp] = rng.integers(0, hi, pp.size).astype(dt)  # some draws equal: no-op entries
        end = mid.copy()
        qp = np.flatnonzero(rng.random(n) < dq).astype(np.int64)
        end[qp] = rng.integers(0, hi, qp.size).astype(dt)
        undo = qp[rng.random(qp.size) < 0.1]
        end[undo] = base[undo]  # changes undone: dropped from the composed change
        return (pp, base[pp], mid[pp]), (qp, mid[qp], end[qp])

    def run(p: tuple[np.ndarray, ...], q: tuple[np.ndarray, ...]) -> int:
        cap = p[0].size + q[0].size
        out = (np.empty(cap, np.int64), np.empty(cap, dt), np.empty(cap, dt))
        n = core.compose(width, *p, *q, *out)
        if n >= 0:
            want = _merge_ref(p, q)  # type: ignore[arg-type]
            for got, w in zip(out, want, strict=True):
                assert np.array_equal(got[:n], w)
        return int(n)

    for n, dp, dq in (
        (0, 0.0, 0.0),
        (5, 0.5, 0.5),
        (40, 1.0, 0.0),
        (40, 0.0, 1.0),
        (3_001, 0.15, 0.85),
        (3_001, 0.85, 0.15),
        (20_000, 0.02, 0.3),
        (20_000, 0.3, 0.02),
        (20_000, 0.5, 0.5),
        (20_000, 1.0, 1.0),
    ):
        p, q = lists(n, dp, dq)
        assert run(p, q) >= 0
        assert run(q, p) >= 0 or np.intersect1d(p[0], q[0]).size  # reversed: may disagree
    p, q = lists(5_000, 0.3, 0.3)
    shared = np.intersect1d(p[0], q[0])
    assert shared.size
    k = int(np.searchsorted(q[0], shared[shared.size // 2]))
    q[1][k] ^= 1  # the second list's old word is not the first's new word there
    assert run(p, q) == -1
    for which in (0, 1):
        for at in (1, 9, 1_400):
            bad = [list(p), list(q)]
            pos = bad[which][0].copy()
            pos[at], pos[at - 1] = pos[at - 1], pos[at]
            bad[which][0] = pos
            with pytest.raises(ValueError, match="not increasing"):
                run(tuple(bad[0]), tuple(bad[1]))


@pytest.mark.parametrize("isa_level", LEVELS, indirect=True)
def test_every_isa_level_sums_words_held_apart_like_numpy(isa_level: str) -> None:
    """``sum128_at`` (a tensor-parallel rank's block, summed at the words' indices in the
    tensor) at each level forced: numpy's terms for every row width the vector loops split
    (below, at and past 4 and 16 words), one row or many, empty data; the blocks of a row
    split and of a column split add up to the whole tensor's rp.sum128; refused when the data
    are not whole rows of whole words."""
    from rollpatch.view import sum128, sum128_at, sum128_terms

    core = native.core
    assert core is not None
    rng = np.random.default_rng(len(isa_level))
    for width in (1, 3, 4, 5, 15, 16, 17, 33, 64):
        for rows in (1, 3):
            words = rng.integers(0, 1 << 63, rows * width, dtype=np.uint64)
            j0, stride = int(rng.integers(0, 1 << 40)), width + int(rng.integers(0, 9))
            index = (
                np.arange(rows, dtype=np.uint64)[:, None] * np.uint64(stride)
                + np.uint64(j0)
                + np.arange(width, dtype=np.uint64)[None, :]
            ).reshape(-1)
            want = sum128_terms(words, index)
            assert tuple(core.sum128_at(words.view(np.uint8), j0, width, stride)) == want
            if rows == 1:
                assert tuple(core.sum128_at(words.view(np.uint8), j0, 0, 0)) == want
    assert tuple(core.sum128_at(b"", 5, 0, 0)) == (0, 0)
    tensor = rng.integers(0, 1 << 16, (8, 48), dtype=np.uint16)  # 12 words per row
    whole = sum128(tensor)
    top, bottom = tensor[:3], tensor[3:]  # a row split: contiguous runs
    parts = [sum128_at(top, 0), sum128_at(bottom, 3 * 12)]
    assert tuple(sum(p[i] for p in parts) % (1 << 64) for i in (0, 1)) == whole
    left, right = tensor[:, :16], tensor[:, 16:]  # a column split: a run per row
    parts = [sum128_at(left, 0, 4, 12), sum128_at(right, 4, 8, 12)]
    assert tuple(sum(p[i] for p in parts) % (1 << 64) for i in (0, 1)) == whole
    for bad in ((b"\0" * 12, 0, 0, 0), (b"\0" * 24, 0, 2, 2)):
        with pytest.raises(ValueError):
            core.sum128_at(*bad)
    with pytest.raises(ValueError):
        sum128_at(np.zeros(3, np.uint16), 0)


def test_sum128_at_without_the_core_is_numpys(monkeypatch: pytest.MonkeyPatch) -> None:
    """``rollpatch.view.sum128_at`` without the native core (numpy's terms) sums as the core."""
    from rollpatch.view import sum128_at

    words = np.random.default_rng(3).integers(0, 1 << 63, 3 * 17, dtype=np.uint64)
    native_sums = [sum128_at(words, 7, 17, 40), sum128_at(words, 7)]
    monkeypatch.setattr(native, "core", None)
    assert [sum128_at(words, 7, 17, 40), sum128_at(words, 7)] == native_sums
