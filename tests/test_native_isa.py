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
    the output's first guess (one pass, grown per 2^20 elements)."""
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
            got = np.frombuffer(core.diff(kt, t.data, u.data, start, count), np.int64)
            want = start + np.flatnonzero(ea[start : start + count] != eb[start : start + count])
            assert np.array_equal(got, want), (n, density, start, count)
        with pytest.raises(ValueError):
            core.diff(kt, t.data, u.data, 0, m + 1)
