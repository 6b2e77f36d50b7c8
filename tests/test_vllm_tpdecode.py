"""Decoding at TP > 1 split between the ranks (rollpatch.engines.vllm.tpdecode), offline:
ranks simulated with threads and a barrier (tests/vllm_layouts.py). Each touched tensor is
gathered to one rank, decoded there and shared; every rank ends with the patch a decode of
its own gives (sent point to point: its blocks' part of it), and an owner's failure is
raised on every rank."""

from __future__ import annotations

import itertools
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.engines.vllm import layout, tensorblocks
from rollpatch.engines.vllm.ops import OPS, _chain
from rollpatch.engines.vllm.tpdecode import decode_split, owners
from rollpatch.engines.vllm.tpshare import (
    ERROR_ROOM,
    bound,
    pack,
    pack_error,
    restrict,
    unpack,
    within,
)
from rollpatch.errors import BaseMismatchError, EngineError, PatchDecodeError, RollpatchError
from rollpatch.kinds import get_kind
from rollpatch.patch import DeltaOp, TensorPatch, decode, diff, encode, inspect
from rollpatch.patch.header import MIN_FULL_BOUND
from rollpatch.view import sum128
from tests import vllm_layouts


def _versions(n: int, share: float = 0.05) -> list[Any]:
    cks = [vllm_layouts.checkpoint()]
    for i in range(n):
        cks.append(vllm_layouts.random_step(cks[-1], 10 + i, share))
    return cks


def _change(a: np.ndarray, b: np.ndarray) -> tuple[int, int]:
    (a0, a1), (b0, b1) = sum128(a), sum128(b)
    return (b0 - a0) & ((1 << 64) - 1), (b1 - a1) & ((1 << 64) - 1)


def _mine(w: Any, tp: TensorPatch) -> TensorPatch:
    """``tp``'s changes in the block rank ``w`` holds (what the owner sends it)."""
    return restrict(tp, w.rank_placements(tp.name)[w.rank])


def _steps(tmp: Path, views: list[Any]) -> list[dict[str, Any]]:
    steps = []
    for i, (a, b) in enumerate(itertools.pairwise(views)):
        path = tmp / f"step{i}"
        path.write_bytes(encode(diff(a, b), a))
        steps.append({"base": a.digest(), "target": b.digest(), "paths": [str(path)]})
    return steps


@pytest.mark.parametrize("tp", [2, 4])
def test_split_decode_equals_a_whole_decode_and_commits(tp: int, tmp_path: Path) -> None:
    """One step and a chain of two: each rank's decoded (composed) patch equals the decode
    against the whole view in the blocks the rank holds; each delta tensor is gathered once,
    to one rank; the ranks' shares are balanced; staging and committing through the worker
    ops reach the target."""
    cks = _versions(2)
    views = [vllm_layouts.words_view(c) for c in cks]
    steps = _steps(tmp_path, views)
    ranks = vllm_layouts.SimulatedRanks(cks[0], tp)
    assert ranks.weights[0].splits_decoding
    timings: list[dict[str, float]] = [{} for _ in range(tp)]
    got = ranks.run(lambda w: _chain(w, steps[:1], timings=timings[w.rank]))
    for t in timings:  # each rank's split of the decode, reported to its caller
        assert set(t) == {"gather_ms", "own_decode_ms", "share_ms", "gather_wait_ms"} | (
            {"assemble_ms"} if "assemble_ms" in t else set()
        )
        assert (
            min(t.values()) >= 0 and t["gather_wait_ms"] + t.get("assemble_ms", 0) <= t["gather_ms"]
        )
    want = decode(Path(steps[0]["paths"][0]).read_bytes(), views[0])
    n_delta = sum(1 for t in want.tensors.values() if t.op == "delta")
    sums = {n: _change(views[0][n].data, views[1][n].data) for n in want.tensors}
    for w, (p, known, vouched) in zip(ranks.weights, got, strict=True):
        assert p.tensors.keys() == want.tensors.keys() and known == {}
        assert all(p.tensors[n].equals(_mine(w, want.tensors[n])) for n in want.tensors)
        assert vouched == sums  # each owner's measured change of the whole tensor, exact
    assert ranks.gathered_to == [n_delta] * tp  # every rank joins every tensor's gather
    deltas = [e for e in inspect(Path(steps[0]["paths"][0]).read_bytes()).tensors]
    cost = [int(np.prod(e["shape"])) + 16 * e["changed"] for e in deltas]
    plan = owners(cost, tp)
    assert ranks.owned == [len(p) for p in plan] and sum(ranks.owned) == n_delta
    loads = [sum(cost[i] for i in p) for p in plan]
    assert max(loads) - min(loads) <= max(cost)  # balanced by cost
    before = list(ranks.gathered_to)
    chained = ranks.run(lambda w: _chain(w, steps))
    both = diff(views[0], views[2])
    touched = set(want.tensors) | {
        e["name"] for e in inspect(Path(steps[1]["paths"][0]).read_bytes()).tensors
    }
    # the chain: each touched tensor gathered once (to its owner), all steps decoded there
    assert [g - b for g, b in zip(ranks.gathered_to, before, strict=True)] == [len(touched)] * tp
    sums = {n: _change(views[0][n].data, views[2][n].data) for n in both.tensors}
    for w, (p, _, vouched) in zip(ranks.weights, chained, strict=True):
        assert vouched == sums  # the decoder's measured change of the chain
        assert p.base == views[0].digest() and p.target == views[2].digest()
        for name, t in both.tensors.items():
            assert p.tensors[name].equals(_mine(w, t))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"token": "t", "steps": steps, "staging": "inline"}))
    gathers = list(ranks.gathers)  # the held digests are known: staging gathers no whole tensor
    assert ranks.run(lambda w: OPS["stage"](w, str(spec), "")["background"]) == [False] * tp
    assert [s["target"] for s in ranks.run(lambda w: OPS["staged"](w, "t", ""))] == [
        views[2].digest()
    ] * tp
    assert ranks.gathers == gathers
    done = ranks.run(lambda w: OPS["commit"](w, "t", ""))
    assert [d["root"] for d in done] == [views[2].digest()] * tp, done
    assert ranks.run(lambda w: w.root()) == [views[2].digest()] * tp
    for r in range(tp):
        for spec_ in vllm_layouts.layer_specs(tp):
            load = vllm_layouts.vllm_load(cks[2], tp, r)[spec_.param]
            want_p = load.reshape(layout.param_shape(spec_, tp))
            assert np.array_equal(ranks.params[r][spec_.param], want_p), (r, spec_.param)


@pytest.mark.parametrize("tp", [2, 4])
def test_split_decode_equals_every_rank_decoding(tp: int, tmp_path: Path) -> None:
    """The same chain and step staged with and without the split gives the same patch: whole
    where the owners broadcast their results, each rank's blocks' part of it where they send
    it point to point; then what reaches a rank is the change once, not once per rank (the
    bytes received fall by about the TP degree); staged, both reach the same words."""
    cks = _versions(2, share=0.2)
    steps = _steps(tmp_path, [vllm_layouts.words_view(c) for c in cks])
    every = vllm_layouts.SimulatedRanks(cks[0], tp, split=False)
    assert not every.weights[0].splits_decoding
    for chain in (steps, steps[:1]):
        p2p = vllm_layouts.SimulatedRanks(cks[0], tp)
        split = p2p.run(lambda w, c=chain: _chain(w, c)[0])
        cast = vllm_layouts.SimulatedRanks(cks[0], tp, p2p=False)
        broadcast = cast.run(lambda w, c=chain: _chain(w, c)[0])
        whole = every.run(lambda w, c=chain: _chain(w, c)[0])
        for w, a, b, c in zip(p2p.weights, split, broadcast, whole, strict=True):
            assert all(b.tensors[n].equals(c.tensors[n]) for n in c.tensors)
            assert all(a.tensors[n].equals(_mine(w, c.tensors[n])) for n in c.tensors)
        assert sum(p2p.received) * (tp - 1) < sum(cast.received), (p2p.received, cast.received)
    assert every.owned == [0] * tp and min(every.gathers) > 0
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"token": "t", "steps": steps[:1], "staging": "inline"}))
    for ranks in (p2p, cast):  # the single step staged and committed: the same words
        ranks.run(lambda w: OPS["stage"](w, str(spec), ""))
        done = ranks.run(lambda w: OPS["commit"](w, "t", ""))
        assert [d["root"] for d in done] == [steps[0]["target"]] * tp, done
    assert all(np.array_equal(a[p], b[p]) for a, b in zip(p2p.params, cast.params) for p in a)


def test_an_owners_failure_is_raised_on_every_rank(tmp_path: Path) -> None:
    """A corrupt payload is seen by its owner only (the others do not read it); every rank
    raises the owner's error, with the owner's rank, and nothing is left waiting. A rank
    whose replicas disagree fails the same way, on every rank."""
    cks = _versions(1)
    views = [vllm_layouts.words_view(c) for c in cks]
    steps = _steps(tmp_path, views)
    blob = bytearray(Path(steps[0]["paths"][0]).read_bytes())
    h = inspect(bytes(blob))
    e = next(e for e in h.tensors if e["name"] == "down_proj.weight")
    blob[h.payload_start + e["offset"] + e["length"] // 2] ^= 0x10
    Path(steps[0]["paths"][0]).write_bytes(bytes(blob))
    ranks = vllm_layouts.SimulatedRanks(cks[0], 2)
    out = ranks.run(lambda w: _chain(w, steps))
    assert all(isinstance(o, PatchDecodeError) for o in out), out
    assert {o.context["tensor"] for o in out} == {"down_proj.weight"}
    assert len({o.context["rank"] for o in out}) == 1  # the owner's
    assert all("checksum" in str(o) for o in out)
    steps = _steps(tmp_path, views)  # intact again
    assert "norm.weight" in {
        e["name"] for e in inspect(Path(steps[0]["paths"][0]).read_bytes()).tensors
    }
    ranks = vllm_layouts.SimulatedRanks(cks[0], 2)
    ranks.params[1]["norm.weight"].reshape(-1)[0] ^= 1  # a replicated tensor's rank-1 copy
    for w in ranks.weights:  # digests held from before: the root check passes
        w._digests = dict(views[0].tensor_digests())
    out = ranks.run(lambda w: _chain(w, steps))
    assert all(isinstance(o, EngineError) for o in out), out
    assert all("disagree" in str(o) and o.context["tensor"] == "norm.weight" for o in out)


def test_layout_mismatch_is_refused_before_any_gather() -> None:
    """A patch whose tensor has another shape than the engine's is refused on every rank
    before any collective (none left waiting)."""
    cks = _versions(1)
    flip = {n: (a.T.copy() if n == "down_proj.weight" else a) for n, a in cks[0].items()}
    flip1 = {n: (a.T.copy() if n == "down_proj.weight" else a) for n, a in cks[1].items()}
    a, b = vllm_layouts.words_view(flip), vllm_layouts.words_view(flip1)
    blob = encode(diff(a, b), a)
    ranks = vllm_layouts.SimulatedRanks(cks[0], 2)
    out = ranks.run(lambda w: decode_split(w, blob, None, MIN_FULL_BOUND))
    assert all(isinstance(o, BaseMismatchError) for o in out), out
    assert all("layout differs" in str(o) for o in out)
    assert ranks.gathered_to == [0, 0]


def _entry(kind: str, shape: tuple[int, ...], changed: int) -> dict[str, Any]:
    """A header entry of tensor ``t`` as the result wire reads it."""
    return {
        "name": "t",
        "kind": kind,
        "shape": list(shape),
        "base": "a" * 64,
        "target": "b" * 64,
        "changed": changed,
    }


def test_owners_plan() -> None:
    """Costliest first to the least loaded rank; the same plan from the same costs."""
    costs = [100, 1160, 850, 26]
    assert owners(costs, 2) == [[1], [2, 0, 3]]
    assert owners(costs, 4) == [[1], [2], [0], [3]]
    assert owners([], 3) == [[], [], []]
    assert owners([5, 5, 5], 2) == [[0, 2], [1]]


@pytest.mark.parametrize("kind", ["bf16", "e4m3", "e2m1x2", "f32"])
def test_pack_unpack(kind: str) -> None:
    """A result round-trips; its size is the one every rank expects; truncated, over-long
    or inconsistent bytes are refused; an owner's error comes back as its class with its
    message, hint and rank, cut to its room when long."""
    k = get_kind(kind)
    n = 1000
    rng = np.random.default_rng(0)
    pos = np.sort(rng.choice(n, 30, replace=False)).astype(np.int64)
    top = (1 << k.bits) - 1
    old = rng.integers(0, top, 30).astype(k.elem_dtype)
    new = (old ^ 1).astype(k.elem_dtype)
    shape = (n // 2,) if k.packed else (n,)
    e = _entry(k.name, shape, 30)
    tp = TensorPatch("t", k, shape, "a" * 64, "b" * 64, DeltaOp(pos, old, new))
    got, change = unpack(e, pack(tp, (5, (1 << 64) - 1)))
    assert got.equals(tp) and change == (5, (1 << 64) - 1)
    data = pack(tp, None)
    assert len(data) == 32 + 30 * (4 + 2 * k.elem_dtype.itemsize)  # 4-byte positions
    assert len(data) <= bound(e) and 32 + ERROR_ROOM <= bound(e)
    got, change = unpack(e, data)
    assert got.equals(tp) and change is None
    assert unpack({**e, "changed": None}, data)[0].equals(tp)  # a chain's: no count known
    with pytest.raises(EngineError, match="malformed"):
        unpack({**e, "changed": None, "shape": [1]}, data)  # more changes than elements
    for bad in (
        data[:10],
        data[:-1],
        data + b"\x00",  # a byte past the result
        b"\x07" + data[1:],
        data[:2] + b"\x02" + data[3:],
    ):
        with pytest.raises(EngineError, match="truncated|malformed"):
            unpack(e, bad)
    with pytest.raises(EngineError, match="malformed"):
        unpack({**e, "changed": 29}, data)  # not the header's count
    if not k.packed:  # a row block's part (positions 0..499) and a column block's
        rows = layout.Placement("t", "p", (10, 100), (5, 100), 0, 0, 0, 5)
        cols = layout.Placement("t", "p", (10, 100), (10, 50), 1, 50, 0, 50)
        shaped = TensorPatch("t", k, (10, 100), "a" * 64, "b" * 64, DeltaOp(pos, old, new))
        for pl, keep in ((rows, pos < 500), (cols, pos % 100 >= 50)):
            part = restrict(shaped, pl)
            assert np.array_equal(part.changes().positions, pos[keep])
            assert np.array_equal(part.changes().new, new[keep]) and within(part, pl)
            assert not within(shaped, pl)  # a change outside the block
    err = pack_error(BaseMismatchError("nope", tensor="t", hint="h"), 3)
    with pytest.raises(BaseMismatchError, match="nope") as caught:
        unpack(e, err)
    assert caught.value.context["rank"] == 3 and caught.value.hint == "h"
    with pytest.raises(EngineError, match="MemoryError"):
        unpack(e, pack_error(MemoryError("big"), 1))
    with pytest.raises(EngineError, match="failed to decode"):
        unpack(e, struct.pack("<BBB5xQQQ", 1, 0, 0, 9, 0, 0) + b"{not json")
    for bad in (err[:40], err + b" "):  # its length runs past the bytes, or stops short
        with pytest.raises(EngineError, match="malformed"):
            unpack(e, bad)
    long = pack_error(PatchDecodeError("x" * 5000, tensor="y" * 5000), 1)
    assert len(long) <= 32 + ERROR_ROOM
    with pytest.raises(PatchDecodeError, match="x{500}") as caught:
        unpack(e, long)
    assert caught.value.context == {"rank": 1, "tensor": "t"}


def test_wide_positions() -> None:
    k = get_kind("bf16")
    shape = (1 << 33,)
    pos = np.array([5, (1 << 32) + 7], dtype=np.int64)
    w = np.array([1, 2], dtype=k.elem_dtype)
    tp = TensorPatch("t", k, shape, "a" * 64, "b" * 64, DeltaOp(pos, w, w + 1))
    e = _entry(k.name, shape, 2)
    data = pack(tp, None)
    assert len(data) == 32 + 2 * (8 + 4)
    assert unpack(e, data)[0].equals(tp)


def test_assemble_checks_replicas_and_coverage() -> None:
    """The whole tensor from every rank's range: replicated ranges must agree, every index
    must be covered (rows or columns)."""
    a = np.arange(8 * 6, dtype=np.uint16).reshape(8, 6)

    def pl(dim: int, lo: int, n: int) -> layout.Placement:
        ps = (n, 6) if dim == 0 else (8, n)
        return layout.Placement("t", "t", (8, 6), ps, dim, lo, 0, n)

    for dim, cuts in ((0, [(0, 4), (4, 4)]), (1, [(0, 3), (3, 3)]), (0, [(0, 5), (3, 5)])):
        pls = [pl(dim, lo, n) for lo, n in cuts]
        parts = [a[lo : lo + n] if dim == 0 else a[:, lo : lo + n].copy() for lo, n in cuts]
        assert np.array_equal(tensorblocks.assemble(pls, parts), a.reshape(-1))
    pls = [pl(0, 0, 5), pl(0, 3, 5)]
    bad = a[3:8].copy()
    bad[0, 0] ^= 1  # row 3, held by both ranks
    with pytest.raises(EngineError, match="disagree"):
        tensorblocks.assemble(pls, [a[0:5], bad])
    with pytest.raises(EngineError, match="cover"):
        tensorblocks.assemble([pl(0, 0, 3), pl(0, 4, 4)], [a[0:3], a[4:8]])
    with pytest.raises(EngineError, match="dimensions"):
        tensorblocks.assemble([pl(0, 0, 8), pl(1, 0, 6)], [a, a])


def test_a_chain_refuses_a_corrupt_step_on_every_rank(tmp_path: Path) -> None:
    """A chain's payloads are checked on every rank before any collective (a corrupt second
    step: every rank raises, none gathered); an owner's failure inside the chain (a step
    decoded against other words than its base: the summed state misses the target) reaches
    every rank."""
    cks = _versions(3)
    views = [vllm_layouts.words_view(c) for c in cks]
    steps = _steps(tmp_path, views)
    path = Path(steps[1]["paths"][0])
    blob = bytearray(path.read_bytes())
    h = inspect(bytes(blob))
    e = h.tensors[0]
    blob[h.payload_start + e["offset"]] ^= 0x01
    path.write_bytes(bytes(blob))
    ranks = vllm_layouts.SimulatedRanks(cks[0], 2)
    out = ranks.run(lambda w: _chain(w, steps))
    assert all(isinstance(o, PatchDecodeError) and "checksum" in str(o) for o in out), out
    assert ranks.gathered_to == [0, 0]
    other = vllm_layouts.words_view(vllm_layouts.random_step(cks[0], 99))  # not v1
    (tmp_path / "b").mkdir()
    steps = _steps(tmp_path, views)[:1] + _steps(tmp_path / "b", [other, views[2]])
    ranks = vllm_layouts.SimulatedRanks(cks[0], 2)
    out = ranks.run(lambda w: _chain(w, steps))
    assert all(isinstance(o, RollpatchError) for o in out), out
    assert len({type(o) for o in out}) == 1 and len({str(o) for o in out}) == 1
    assert ranks.gathered_to[0] > 0 and "rank" in out[0].context, out  # an owner's, shared


def test_without_the_native_core_a_chain_goes_step_by_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No native core: the chain is decoded step by step (the numpy reference), each tensor
    still by one rank; no change is measured, so staging proves by reading the words."""
    from rollpatch import native

    cks = _versions(2)
    views = [vllm_layouts.words_view(c) for c in cks]
    steps = _steps(tmp_path, views)
    monkeypatch.setattr(native, "core", None)
    ranks = vllm_layouts.SimulatedRanks(cks[0], 2)
    both = diff(views[0], views[2])
    for p, known, vouched in ranks.run(lambda w: _chain(w, steps)):
        assert known == {} and vouched == {}
        assert all(
            p.tensors[n].changes().new.tolist() == t.changes().new.tolist()
            for n, t in both.tensors.items()
        )
    assert sum(ranks.owned) > 0


def _with_fault(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, fault: Callable[[Any, Any], Any]
) -> list[Any]:
    """Both ranks' outcomes of a one-step chain at TP 2 with ``tpdecode.<name>`` replaced on
    each rank by ``fault(rank, real)``."""
    import threading

    from rollpatch.engines.vllm import tpdecode

    cks = _versions(1)
    steps = _steps(tmp_path, [vllm_layouts.words_view(c) for c in cks])
    local = threading.local()
    real = getattr(tpdecode, name)
    monkeypatch.setattr(tpdecode, name, lambda *a: fault(getattr(local, "rank", None), real)(*a))

    def run(w: Any) -> Any:
        local.rank = w.rank
        return _chain(w, steps)

    return vllm_layouts.SimulatedRanks(cks[0], 2).run(run)


def test_a_rank_that_refuses_its_part_takes_every_rank_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sent point to point, the ranks receive different bytes: rank 0 (made faulty here)
    sends rank 1 whole tensors instead of its blocks' part; rank 1 refuses them, and rank 0,
    which received valid parts, raises too (told by rank 1) instead of going on alone."""
    out = _with_fault(
        tmp_path, monkeypatch, "restrict", lambda r, real: (lambda tp, pl: tp) if r == 0 else real
    )
    assert isinstance(out[1], EngineError) and "outside this rank's block" in str(out[1]), out
    assert isinstance(out[0], EngineError) and "refused" in str(out[0]), out
    assert out[0].context["rank"] == 1


def test_a_malformed_result_table_is_refused_by_every_rank_before_any_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table of lengths whose total is out of bounds is not received: the rank that got it
    (rank 1, told here that no result may have a byte) refuses it, and every rank hears so
    before the results are sent, so rank 0 raises too instead of waiting on its sends."""
    out = _with_fault(
        tmp_path, monkeypatch, "bound", lambda r, real: (lambda job: 0) if r == 1 else real
    )
    assert isinstance(out[1], EngineError) and "malformed result table" in str(out[1]), out
    assert isinstance(out[0], EngineError) and "refused the result table" in str(out[0]), out
    assert out[0].context["rank"] == 1
