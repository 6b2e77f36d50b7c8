"""A published chain decoded inside the engine (:mod:`rollpatch.engines.catchup`): the composed
change equals a plain diff of the chain's ends, element for element, whatever the steps do
(overlapping changes, changes written back to their first value), for whole and packed kinds,
on one thread and on four (tensors on a pool, each tensor's chunk ranges on a nested one)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from rollpatch import native
from rollpatch.engines.catchup import decode_in_place
from rollpatch.formats import cast_view
from rollpatch.patch import DeltaOp, diff, encode
from rollpatch.view import View

pytestmark = pytest.mark.skipif(native.core is None, reason="the native core is not built")


def _masters(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "a.weight": rng.standard_normal((512, 300)).astype(np.float32),  # one chunk
        "b.weight": rng.standard_normal((1100, 1024)).astype(np.float32),  # > 2^20: two chunks
        "c.bias": rng.standard_normal(77).astype(np.float32),
    }


def _chain(fmt: str) -> list[View]:
    """Four versions: step 1 moves a third of the values; step 2 moves others and writes half
    of step 1's back to their first value; step 3 moves some again."""
    rng = np.random.default_rng(7)
    m0 = _masters(rng)
    ms = [m0]
    for k in range(3):
        prev = ms[-1]
        nxt = {}
        for name, w in prev.items():
            w = w.copy()
            moved = rng.random(w.shape) < 0.3
            w[moved] += rng.standard_normal(int(moved.sum())).astype(np.float32) * 0.05
            if k == 1:  # half of step 1's moves go back exactly to the first value
                back = (ms[1][name] != m0[name]) & (rng.random(w.shape) < 0.5)
                w[back] = m0[name][back]
            nxt[name] = w
        ms.append(nxt)
    return [cast_view(m, fmt) for m in ms]


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("steps", [1, 2, 3])
@pytest.mark.parametrize("threads", ["1", "4"])  # ROLLPATCH_THREADS: serial; pools
def test_composed_change_equals_the_diff_of_the_ends(
    fmt: str, steps: int, threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLPATCH_THREADS", threads)
    views = _chain(fmt)
    blobs = [[encode(diff(a, b), a)] for a, b in itertools.pairwise(views)]
    chain = [{"base": a.digest(), "target": b.digest()} for a, b in itertools.pairwise(views)]
    live = views[0]
    out = decode_in_place(live, chain[:steps], blobs[:steps], live.sum_state)
    assert out is not None
    patch, states = out
    want = diff(views[0], views[steps])
    assert set(patch.tensors) >= set(want.tensors)
    if steps >= 2 and fmt == "bf16":  # the chain really writes words back to their first value
        b0, b1, b2 = (v["b.weight"].data.view(np.uint8) for v in views[:3])
        assert np.count_nonzero((b1 != b0) & (b2 == b0)) > 1000
    for name, tp in patch.tensors.items():
        got = tp.change
        assert isinstance(got, DeltaOp)
        if name not in want.tensors:  # every change of the chain was written back
            assert got.positions.size == 0
            continue
        w = want.tensors[name].change
        assert isinstance(w, DeltaOp)
        assert np.array_equal(got.positions, w.positions), name
        assert np.array_equal(got.old, w.old) and np.array_equal(got.new, w.new), name
        assert tp.target_digest == views[steps].tensor_digest(name)
    for name, st in states.items():
        target = View({name: views[steps][name]})
        assert st == target.sum_state(name)
    assert views[0].digest() == _chain(fmt)[0].digest()  # the live words were only read


def test_arena_arrays_are_disjoint_aligned_and_outlive_their_block() -> None:
    """The kept change arrays come from shared blocks: each is its own aligned, writable
    region (writing one never shows in another), a request larger than a block gets a block
    of its own, an array stays valid after the arena has moved to a new block, and a worst
    case reserved is trimmed to what was used (the next array starts right after it)."""
    from rollpatch.engines.catchup import Changes, _Arena

    arena = _Arena()
    arena.BLOCK = 1 << 12
    got = [arena.empty(n, dt) for n, dt in ((3, np.int64), (5, np.uint16), (0, np.uint8))]
    got += [arena.empty(1000, np.int64), arena.empty(7, np.uint8)]  # 8000 B: a block of its own
    for k, a in enumerate(got):
        assert a.flags.writeable and (a.size == 0 or a.ctypes.data % 64 == 0)
        a[...] = k + 1
    room = arena.empty(100, np.int64)  # reserved for a worst case, 3 used: the rest given back
    room[:3] = 9
    used = arena.trim(room, 3)
    after = arena.empty(4, np.int64)
    after[...] = 10
    assert used.tolist() == [9, 9, 9] and after.ctypes.data - used.ctypes.data == 64
    for k, a in enumerate(got):
        assert (a == k + 1).all()
    changes = Changes()  # one arena per array: a merge's worst case trimmed in each
    got = changes.trim(changes.empty(50, np.uint16), 4)
    again = changes.empty(3, np.uint16)
    assert [a.size for a in got] == [4, 4, 4] and [a.dtype for a in again] == [
        np.int64,
        np.uint16,
        np.uint16,
    ]
    assert [b.ctypes.data - a.ctypes.data for a, b in zip(got, again, strict=True)] == [64] * 3
    pos = np.arange(10, dtype=np.int64)
    mask = pos % 3 == 0
    kp, ko, kn = changes.keep(mask, pos, pos.astype(np.uint16), 2 * pos.astype(np.uint16))
    assert kp.tolist() == [0, 3, 6, 9] and ko.dtype == np.uint16 and kn.tolist() == [0, 6, 12, 18]
