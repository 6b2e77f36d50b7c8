"""Rewind records (:mod:`rollpatch.engines.rewind`): an engine that committed v0 -> v1 -> v2
rebuilds v0's words from its records and decodes the fold v0 -> v3 against them in one pass;
the staged update leads from the live words to v3 exactly (a position changed twice goes back
to its oldest word, a tensor the fold leaves alone goes back to v0's words), for whole, FP8
and packed 4-bit kinds; a record that no longer holds the engine's words is refused; the cap,
the pruning and the planner's rewind sources.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from rollpatch import native
from rollpatch.engines.catchup import decode_in_place
from rollpatch.engines.rewind import UNSEEN_KEEP, RewindLog, merge_positions
from rollpatch.engines.staged import StagedTensor, StagedUpdate, stage_patch
from rollpatch.errors import BaseMismatchError
from rollpatch.formats import cast_view
from rollpatch.manifest import PatchObject
from rollpatch.patch import DeltaOp, diff, encode
from rollpatch.patch.ops import scatter
from rollpatch.planning import cheapest_plan
from rollpatch.types import ObjectRef
from rollpatch.view import View
from tests.conftest import make_manifest

pytestmark = pytest.mark.skipif(native.core is None, reason="the native core is not built")


def _versions(fmt: str) -> list[View]:
    """v0..v3: steps move a fifth of the values; step 2 writes half of step 1's back to their
    first value (a position changed twice); ``c.bias`` moves at v1 and v2 and is back to v0's
    at v3 (the fold v0 -> v3 does not touch it)."""
    rng = np.random.default_rng(5)
    m0 = {
        "a.weight": rng.standard_normal((256, 384)).astype(np.float32),
        "b.weight": rng.standard_normal((128, 256)).astype(np.float32),
        "c.bias": rng.standard_normal((4, 32)).astype(np.float32),
    }
    ms = [m0]
    for k in range(3):
        nxt = {}
        for name, w in ms[-1].items():
            w = w.copy()
            moved = rng.random(w.shape) < 0.2
            w[moved] += rng.standard_normal(int(moved.sum())).astype(np.float32) * 0.2
            if k == 1:
                back = (ms[1][name] != m0[name]) & (rng.random(w.shape) < 0.5)
                w[back] = m0[name][back]
            nxt[name] = w
        ms.append(nxt)
    ms[3]["c.bias"] = m0["c.bias"].copy()
    # (FP8's per-tensor scales are coded by another codec, not decoded in place: left out)
    return [View({n: t for n, t in cast_view(m, fmt).items() if "scale" not in n}) for m in ms]


def _commit(live: View, staged: StagedUpdate) -> None:
    """An engine's commit: the staged writes, the proven states."""
    for name, st in staged.tensors.items():
        scatter(live[name], st.positions, st.new, st.old)
        live.invalidate(name)
    live.digest()


def _follow(views: list[View], upto: int, log: RewindLog) -> View:
    """Load v0, then commit v0 -> v1 -> ... -> v``upto``, recording each commit."""
    live = views[0].copy()
    live.digest()
    for v in range(upto):
        staged = stage_patch(
            diff(views[v], views[v + 1]), live.__getitem__, live.tensor_digests(), live.sum_state
        )
        log.record(v, staged.base, staged.target, staged.tensors, live.cached_sum_state)
        _commit(live, staged)
    assert live.digest() == views[upto].digest()
    return live


def _stage_fold(
    live: View, views: list[View], log: RewindLog, *, frm: int, to: int
) -> StagedUpdate:
    fold = [encode(diff(views[frm], views[to]), views[frm])]
    step = {"base": views[frm].digest(), "target": views[to].digest()}
    rewind = log.rewind(views[frm].digest(), live.digest())
    assert rewind is not None
    out = decode_in_place(live, [step], [fold], live.sum_state, rewind=rewind, held=live.digest())
    assert out is not None
    patch, known = out
    return stage_patch(patch, live.__getitem__, live.tensor_digests(), live.sum_state, known=known)


@pytest.mark.parametrize("fmt", ["bf16", "fp8-e4m3", "nvfp4"])
@pytest.mark.parametrize("threads", ["1", "4"])
@pytest.mark.parametrize("held", [1, 2])  # one record (its words as they are), or two merged
def test_rewound_fold_reaches_the_target(
    fmt: str, threads: str, held: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLPATCH_THREADS", threads)
    views = _versions(fmt)
    log = RewindLog()
    live = _follow(views, held, log)
    assert log.rewindable() == {v: views[v].digest() for v in range(held)}
    assert "c.bias" not in diff(views[0], views[3]).tensors or not (
        diff(views[0], views[3]).tensors["c.bias"].change.positions.size  # type: ignore[union-attr]
    )
    e = [{n: t.elements() for n, t in v.items()} for v in views]
    # positions both commits changed: their oldest word (v0's) is the one rebuilt
    assert sum(np.count_nonzero((e[1][n] != e[0][n]) & (e[2][n] != e[1][n])) for n in e[0]) > 0
    staged = _stage_fold(live, views, log, frm=0, to=3)
    assert staged.base == views[held].digest() and staged.target == views[3].digest()
    want = diff(views[held], views[3])  # the writes are exactly the live words -> v3
    assert set(staged.tensors) == {n for n, t in want.tensors.items() if t.change.positions.size}  # type: ignore[union-attr]
    assert "c.bias" in staged.tensors  # changed since v0, not by the fold: back to v0's words
    for name, st in staged.tensors.items():
        w = want.tensors[name].change
        assert isinstance(w, DeltaOp)
        assert np.array_equal(st.positions, w.positions), name
        assert np.array_equal(st.old, w.old) and np.array_equal(st.new, w.new), name
        assert st.target_digest == views[3].tensor_digest(name)
    assert live.digest() == views[held].digest()  # staging only read the live words
    _commit(live, staged)
    for name, t in views[3].items():
        assert np.array_equal(live[name].data, t.data), name
    assert View({n: t.copy() for n, t in live.items()}).digest() == views[3].digest()


def test_rewind_from_the_newest_record_and_a_chain() -> None:
    """From v1 (one record back) by the step v1 -> v3's chain of two patches."""
    views = _versions("bf16")
    log = RewindLog()
    live = _follow(views, 2, log)
    rewind = log.rewind(views[1].digest(), live.digest())
    assert rewind is not None and rewind.version == 1
    blobs = [[encode(diff(a, b), a)] for a, b in itertools.pairwise(views[1:])]
    steps = [{"base": a.digest(), "target": b.digest()} for a, b in itertools.pairwise(views[1:])]
    out = decode_in_place(live, steps, blobs, live.sum_state, rewind=rewind, held=live.digest())
    assert out is not None
    staged = stage_patch(
        out[0], live.__getitem__, live.tensor_digests(), live.sum_state, known=out[1]
    )
    _commit(live, staged)
    assert live.digest() == views[3].digest()


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_a_corrupted_record_is_refused(fmt: str) -> None:
    views = _versions(fmt)
    log = RewindLog()
    live = _follow(views, 2, log)
    undo = log._records[0].undo
    name = max(undo, key=lambda n: undo[n][0].size)  # nvfp4: the packed 4-bit words
    assert live[name].kind.packed == (fmt == "nvfp4")
    old = undo[name][1]
    old[len(old) // 2] ^= 1  # the retained words no longer are v0's
    with pytest.raises(BaseMismatchError, match="rebuilt words"):
        _stage_fold(live, views, log, frm=0, to=3)
    assert live.digest() == views[2].digest()


def _staged(n: int, size: int = 100) -> dict[str, StagedTensor]:
    pos = np.arange(size, dtype=np.int64)
    old = np.zeros(size, np.uint16)
    return {f"t{i}": StagedTensor(f"t{i}", pos, old, old, "d", (0, 0)) for i in range(n)}


def test_cap_pruning_and_continuity() -> None:
    one = 100 * (8 + 2)  # positions int64 + old words, one tensor
    log = RewindLog(max_bytes=3 * one)
    log.prune(0)  # anchor evidence at v0 (none seen: only the last UNSEEN_KEEP are kept)
    for v in range(5):
        log.record(v, f"r{v}", f"r{v + 1}", _staged(1), lambda n: (1, 2))
    assert sorted(log.rewindable()) == [2, 3, 4] and log.nbytes == 3 * one  # oldest dropped
    assert log.rewind("r2", "r5") is not None and log.rewind("r2", "other") is None
    assert log.rewind("r0", "r5") is None
    log.prune(3)
    assert sorted(log.rewindable()) == [3, 4]
    log.record(5, "r5", "r6", _staged(1), lambda n: (1, 2))
    assert sorted(log.rewindable()) == [3, 4, 5]
    log.record(7, "x7", "x8", _staged(1), lambda n: (1, 2))  # not from the newest's target
    assert sorted(log.rewindable()) == [7]
    log.record(8, "x8", "x9", _staged(2), lambda n: None)  # a state not known: rewind broken
    assert log.rewindable() == {}
    big = RewindLog(max_bytes=one)
    big.record(0, "r0", "r1", _staged(2), lambda n: (1, 2))  # one record over the cap
    assert big.rewindable() == {}
    off = RewindLog(max_bytes=0)
    off.record(0, "r0", "r1", _staged(1), lambda n: (1, 2))
    assert off.rewindable() == {}
    log.record(0, "r0", "r1", _staged(1), lambda n: (1, 2))
    log.clear()
    assert log.rewindable() == {} and len(log) == 0


def test_without_anchor_evidence_only_the_last_records_are_kept() -> None:
    """A board with neither folds nor skip patches never names an anchor: what could be
    rebuilt would serve no plan, so only the commits a first fold's evidence needs are kept,
    and evidence seen later keeps everything from its anchor on."""
    log = RewindLog()
    for v in range(6):
        log.record(v, f"r{v}", f"r{v + 1}", _staged(1), lambda n: (1, 2))
    assert sorted(log.rewindable()) == list(range(6 - UNSEEN_KEEP, 6))
    log.prune(4)
    for v in range(6, 9):
        log.record(v, f"r{v}", f"r{v + 1}", _staged(1), lambda n: (1, 2))
    assert sorted(log.rewindable()) == [4, 5, 6, 7, 8]
    log.clear()  # a load may go back in the run: the evidence goes too
    for v in range(4):
        log.record(v, f"r{v}", f"r{v + 1}", _staged(1), lambda n: (1, 2))
    assert len(log) == UNSEEN_KEEP


def test_merge_positions() -> None:
    a = np.array([1, 5, 9], np.int64)
    b = np.array([0, 5, 10], np.int64)
    assert merge_positions([a, b, np.empty(0, np.int64)]).tolist() == [0, 1, 5, 9, 10]
    assert merge_positions([a]) is a
    assert merge_positions([]).size == 0


def _ref(key: str, size: int) -> ObjectRef:
    return ObjectRef(key, size, "0" * 64)


def test_the_planner_starts_at_a_rewind_source() -> None:
    """v1..v6 step patches of 100 bytes each; v6 also folds from v0 (300 bytes)."""
    d = {v: f"{v:064x}" for v in range(7)}
    ms = {0: make_manifest("r", 0, target=d[0])}
    for v in range(1, 7):
        patches = [PatchObject(_ref(f"s{v}", 100), v - 1, d[v - 1])]
        if v >= 2:
            patches.append(PatchObject(_ref(f"f{v}", 60 * v), 0, d[0]))
        ms[v] = make_manifest("r", v, target=d[v], patches=tuple(patches))
    hops = lambda p: [(s.base, s.to) for s in p.steps]
    plain = cheapest_plan("r", 1, 6, ms)
    assert hops(plain) == [(1, 2), (2, 3), (3, 4), (4, 5), (5, 6)] and not plain.rewinds
    plan = cheapest_plan("r", 1, 6, ms, sources={0: d[0]})
    assert hops(plan) == [(0, 6)] and plan.rewinds and plan.start == 0 and plan.have == 1
    assert hops(cheapest_plan("r", 1, 6, ms, sources={0: d[1]})) == hops(plain)  # wrong digest
    assert hops(
        cheapest_plan("r", 1, 6, {v: m for v, m in ms.items() if v}, sources={0: d[0]})
    ) == hops(plain)
    assert hops(cheapest_plan("r", 5, 6, ms, sources={0: d[0]})) == [(5, 6)]  # cheaper from have
