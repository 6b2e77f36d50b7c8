"""SGLang at tensor parallelism > 1, offline: every rank's blocks of the synthetic fused layout
(q/k/v and gate/up column-split, o/down row-split, the padded vocabulary, replicated KV heads
at TP 4, a replicated norm), as the weight loaders written after vLLM's/SGLang's place them
(``tests.vllm_layouts.vllm_load``).

The ranks' partial rp.sum128 sums add up to the published digests (each distinct block once);
staging a decoded patch on every rank moves the sums to the target digests (checked before any
rank writes); commits scatter only what each rank holds; an undo restores a rank's words;
double-buffered, each rank's second buffers are exchanged in, exchanged back by an undo and
released after; refusals leave the words untouched; the adapter's gather of a tensor from the
ranks (shared memory or files) gives it bit for bit. The live tests at TP 2:
tests/test_sglang_tp_live.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.engines.sglang.ranked import RankWeights
from rollpatch.engines.sglang.slices import combine
from rollpatch.engines.vllm.layout import placements
from rollpatch.errors import BaseMismatchError, EngineError
from rollpatch.kinds import get_kind
from rollpatch.patch import Patch, diff
from rollpatch.view import View
from tests import vllm_layouts
from tests.test_sglang_offline import NumpyBuffers


def _ranks(
    tp: int, ck: dict[str, np.ndarray], kv_heads: int = 2, *, buffered: bool = False
) -> list[RankWeights]:
    specs = vllm_layouts.layer_specs(tp, kv_heads)
    out = []
    for rank in range(tp):
        loaded = vllm_layouts.vllm_load(ck, tp, rank, kv_heads)
        params = {
            s.param: loaded[s.param].reshape(vllm_layouts.param_shape(s, tp)).copy() for s in specs
        }
        kinds = {s.param: get_kind("bf16") for s in specs}
        buffers = NumpyBuffers(params) if buffered else None
        out.append(RankWeights(dict(params), specs, kinds, rank=rank, tp=tp, buffers=buffers))
    return out


def _tensors(view: View) -> dict[str, list[object]]:
    return {n: [t.kind.name, list(t.shape)] for n, t in view.items()}


def _held(ranks: list[RankWeights], view: View) -> tuple[dict[str, str], str]:
    return combine([r.blocks() for r in ranks], _tensors(view))


@pytest.mark.parametrize("tp", [2, 4])
def test_rank_sums_add_up_to_the_published_digests(tp: int) -> None:
    ck = vllm_layouts.checkpoint(0)
    a = vllm_layouts.words_view(ck)
    ranks = _ranks(tp, ck)
    assert any(not pl.whole for s in vllm_layouts.layer_specs(tp) for pl in placements(s, 0, tp))
    assert _held(ranks, a) == (a.tensor_digests(), a.digest())
    reports = [r.blocks() for r in ranks]
    reports[-1] = {n: b for n, b in reports[-1].items() if n != "down_proj.weight"}
    with pytest.raises(EngineError, match="cover"):  # a rank's block missing
        combine(reports, _tensors(a))


@pytest.mark.parametrize("tp", [2, 4])
def test_staged_rank_commits_reach_the_target_and_undo(tp: int) -> None:
    ck = vllm_layouts.checkpoint(1)
    a = vllm_layouts.words_view(ck)
    b = vllm_layouts.words_view(vllm_layouts.random_step(ck, 7))
    ranks = _ranks(tp, ck)
    before = [{p: v.copy() for p, v in r.params.items()} for r in ranks]
    patch = diff(a, b)
    staged = [r.stage(patch) for r in ranks]
    assert all(
        np.array_equal(before[i][p], r.params[p]) for i, r in enumerate(ranks) for p in r.params
    )
    digests, _ = combine([s.blocks for s in staged], {n: _tensors(a)[n] for n in patch.tensors})
    assert digests == {n: tp_.target_digest for n, tp_ in patch.tensors.items()}
    for r, s in zip(ranks, staged):
        r.commit(s.token)
    assert _held(ranks, b) == (b.tensor_digests(), b.digest())
    assert combine([r.blocks(fresh=True) for r in ranks], _tensors(b))[1] == b.digest()
    want = _ranks(tp, vllm_layouts.random_step(ck, 7))  # what a fresh load of b puts where
    for r, w in zip(ranks, want):
        assert all(np.array_equal(r.params[p], w.params[p]) for p in r.params)
    ranks[0].undo(staged[0].token)  # another rank failed: this one goes back
    assert all(np.array_equal(before[0][p], ranks[0].params[p]) for p in ranks[0].params)
    with pytest.raises(EngineError, match="undo"):
        ranks[0].undo(staged[0].token)


@pytest.mark.parametrize("tp", [2, 4])
def test_double_buffered_rank_commits_exchange_undo_and_release(tp: int) -> None:
    """Double-buffered at TP > 1: staging builds each rank's second buffers (nothing live
    written), the commit exchanges storages and gives the words of an in-place commit; an
    undo exchanges the old storage back; a release frees it (no undo after that)."""
    ck = vllm_layouts.checkpoint(5)
    a = vllm_layouts.words_view(ck)
    b = vllm_layouts.words_view(vllm_layouts.random_step(ck, 2))
    ranks = _ranks(tp, ck, buffered=True)
    live = [dict(r.params) for r in ranks]
    snap = [{p: v.copy() for p, v in r.params.items()} for r in ranks]
    before = ranks[0].blocks(fresh=True)
    patch = diff(a, b)
    staged = [r.stage(patch, "double_buffer") for r in ranks]
    assert all(s.buffers and set(s.buffers) == set(s.writes) for s in staged)
    for r, lv, sn in zip(ranks, live, snap):
        assert all(r.params[p] is lv[p] and np.array_equal(sn[p], lv[p]) for p in lv)
    for r, s in zip(ranks, staged):
        r.commit(s.token)
        assert set(s.retired) == set(s.writes)  # kept for an undo
    assert _held(ranks, b) == (b.tensor_digests(), b.digest())
    assert combine([r.blocks(fresh=True) for r in ranks], _tensors(b))[1] == b.digest()
    want = _ranks(tp, vllm_layouts.random_step(ck, 2))
    for r, w, lv, sn in zip(ranks, want, live, snap):
        assert all(np.array_equal(r.params[p], w.params[p]) for p in r.params)
        assert all(np.array_equal(sn[p], lv[p]) for p in lv)  # the old storage never written
    ranks[0].undo(staged[0].token)  # another rank failed: the old storage exchanged back
    assert all(ranks[0].params[p] is live[0][p] for p in live[0])
    assert ranks[0].blocks() == ranks[0].blocks(fresh=True) == before
    released = ranks[1].release()["released"]
    assert released == len(staged[1].writes) > 0 and not staged[1].retired
    with pytest.raises(EngineError, match="undo"):
        ranks[1].undo(staged[1].token)
    i = 2 % tp  # tp 4: rank 2 committed, never released; tp 2: rank 0, undone
    assert bool(staged[i].retired) == (tp > 2)
    s2 = ranks[i].stage(diff(b, a) if tp > 2 else patch, "double_buffer")
    assert s2.buffers and not staged[i].retired  # staging again released the commit's storage


def test_rank_refusals_leave_the_words_untouched() -> None:
    ck = vllm_layouts.checkpoint(2)
    a = vllm_layouts.words_view(ck)
    b = vllm_layouts.words_view(vllm_layouts.random_step(ck, 3))
    ranks = _ranks(2, ck)
    snap = [{p: v.copy() for p, v in r.params.items()} for r in ranks]
    good = diff(a, b)
    name = "down_proj.weight"  # row-split: each rank holds half of every row
    tp_ = good.tensors[name]
    ch = tp_.changes()
    bad_old = dataclasses.replace(tp_, change=dataclasses.replace(ch, old=ch.new))
    with pytest.raises(BaseMismatchError):
        ranks[1].stage(Patch(good.base, good.target, {**good.tensors, name: bad_old}, {}))
    with pytest.raises(EngineError, match="double-buffered"):
        ranks[0].stage(good, "double_buffer")
    with pytest.raises(EngineError, match="split"):
        ranks[0][name]
    staged = ranks[0].stage(good)
    ranks[0].commit(ranks[0].stage(good).token)  # staged again: the first token is gone
    with pytest.raises(EngineError, match="no staged update"):
        ranks[0].commit(staged.token)
    assert all(np.array_equal(snap[1][p], ranks[1].params[p]) for p in ranks[1].params)
    flipped = ranks[1].params["o_proj.weight"]
    flipped[0, 0] ^= 1
    bad = ranks[1].audit(1 << 30)["mismatched"]
    assert bad == ["o_proj.weight"]


class RanksChannel:
    """The adapter's channel over in-process ranks (what the loader answers, per rank)."""

    def __init__(self, ranks: list[RankWeights]) -> None:
        self.ranks, self.tp, self.fail_rank = ranks, len(ranks), -1
        self.calls: list[list[str]] = []

    def control(self, op: str, *, rank: int = 0, **args: object) -> dict[str, object]:
        w = self.ranks[rank]
        if op == "digest":
            return {"blocks": w.blocks(fresh=bool(args.get("fresh")))}
        if op == "stage_decoded":
            from rollpatch.engines.sglang.loader import _paths
            from rollpatch.engines.sglang.owned import read_decoded_all

            mode = str(args.get("mode", "in_place"))
            paths = _paths(w, dict(args))
            return {**w.stage(read_decoded_all(paths), mode).summary(), "ms": 1.0}  # type: ignore[arg-type]
        if op in ("export_blocks", "decode_owned"):  # the loader's own, in this process
            from rollpatch.engines.sglang.loader import _CONTROL

            return _CONTROL[op](w, {"op": op, **args})
        if op == "export":  # the loader's own export, in this process
            from rollpatch.engines.sglang.loader import _export

            return _export(w, str(args["name"]), str(args["path"]), bool(args.get("into")))
        assert op == "drop"
        w.staged.clear()
        return {"ok": True}

    def controls(self, op: str, **args: object) -> list[dict[str, object]]:
        return [self.control(op, rank=r, **args) for r in range(self.tp)]

    def commands(self, cmds: list[dict[str, str]], *, flush: bool) -> list[dict[str, object]]:
        self.calls.append([c["op"] for c in cmds])
        out: list[dict[str, object]] = []
        for r, c in enumerate(cmds):
            if c["op"] == "commit" and r == self.fail_rank:
                out.append({"ok": False, "error": {"type": "TargetMismatchError", "message": "x"}})
            elif c["op"] == "commit":
                out.append({"ok": True, "changed": self.ranks[r].commit(c["token"]).changed})
            elif c["op"] == "undo":
                out.append({"ok": True, **self.ranks[r].undo(c["token"])})
            else:
                out.append({"ok": True})
        return out


def test_adapter_proves_the_ranks_sum_and_undoes_a_partial_commit(tmp_path: Path) -> None:
    """tp.stage checks the ranks' moved sums against the target before anyone writes; when a
    rank's commit fails, the ranks that wrote undo it and every rank is on the base again."""
    from rollpatch.engines.sglang import tp as tp_ops
    from rollpatch.engines.vllm.transfer import write_decoded
    from rollpatch.errors import TargetMismatchError

    ck = vllm_layouts.checkpoint(4)
    a = vllm_layouts.words_view(ck)
    b = vllm_layouts.words_view(vllm_layouts.random_step(ck, 9))
    ranks = _ranks(2, ck)
    ch = RanksChannel(ranks)
    tensors = _tensors(a)
    assert tp_ops.held(ch, tensors, fresh=True) == (a.tensor_digests(), a.digest())  # type: ignore[arg-type]
    snap = [{p: v.copy() for p, v in r.params.items()} for r in ranks]
    patch, path = diff(a, b), tmp_path / "patch.bin"
    write_decoded(patch, path)
    tampered = diff(a, b)
    tampered.tensors["o_proj.weight"].changes().new[0] ^= np.uint16(1)
    write_decoded(tampered, tmp_path / "bad.bin")
    with pytest.raises(TargetMismatchError):
        tp_ops.stage(ch, tampered, tmp_path / "bad.bin", a.tensor_digests(), tensors)  # type: ignore[arg-type]
    assert all(not r.staged for r in ranks)  # dropped everywhere
    tokens, summary = tp_ops.stage(ch, patch, path, a.tensor_digests(), tensors)  # type: ignore[arg-type]
    assert summary["digests"] == {n: t.target_digest for n, t in patch.tensors.items()}
    ch.fail_rank = 1
    with pytest.raises(TargetMismatchError):
        tp_ops.commit(ch, tokens)  # type: ignore[arg-type]
    assert ch.calls == [["commit", "commit"], ["undo", "noop"]]
    for r, before in zip(ranks, snap):
        assert all(np.array_equal(before[p], r.params[p]) for p in r.params)
    assert tp_ops.held(ch, tensors, fresh=True)[1] == a.digest()  # type: ignore[arg-type]
    ch.fail_rank = -1
    tokens, _ = tp_ops.stage(ch, patch, path, a.tensor_digests(), tensors)  # type: ignore[arg-type]
    tp_ops.commit(ch, tokens)  # type: ignore[arg-type]
    assert tp_ops.held(ch, tensors, fresh=True) == (b.tensor_digests(), b.digest())  # type: ignore[arg-type]


def _chain(n: int) -> tuple[list[View], list[Any]]:
    """Views v0..vn of random steps and each step's published wire-format patch."""
    from rollpatch.engines.staged import EncodedStep
    from rollpatch.patch.wire import encode_views

    cks = [vllm_layouts.checkpoint(3)]
    for seed in range(1, n + 1):
        cks.append(vllm_layouts.random_step(cks[-1], seed))
    views = [vllm_layouts.words_view(ck) for ck in cks]
    steps = [
        EncodedStep(
            (encode_views(views[k - 1], views[k]),), views[k - 1].digest(), views[k].digest()
        )
        for k in range(1, n + 1)
    ]
    return views, steps


@pytest.mark.parametrize(
    ("tp", "batch", "mode"),
    [
        (2, 1 << 28, "in_place"),
        (4, 1 << 28, "in_place"),
        (2, 1, "in_place"),
        (4, 1, "double_buffer"),
    ],
)
def test_owner_ranks_decode_a_chain_that_every_rank_stages(
    tp: int, batch: int, mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At TP > 1 the adapter stages a chain without gathering the model: each touched
    tensor's owner rank decodes it whole (from the ranks' blocks in shared memory, a batch
    at a time: ``batch`` 1 puts each tensor in its own), every rank stages its part of the
    owners' files, the sums are proven before any rank writes, and the commit reaches the
    last step's digests; one step the same way; no file is left behind."""
    from rollpatch.engines.sglang import tp as tp_ops
    from rollpatch.engines.sglang import tpencoded

    monkeypatch.setattr(tpencoded, "BATCH_BYTES", batch)
    views, steps = _chain(4)
    ranks = _ranks(tp, vllm_layouts.checkpoint(3), buffered=mode == "double_buffer")
    ch = RanksChannel(ranks)
    tensors = _tensors(views[0])
    count = iter(range(1 << 20))

    def fresh(what: str) -> Path:
        return tmp_path / f"{what}-{next(count)}"

    snap = [{p: v.copy() for p, v in r.params.items()} for r in ranks]
    got = tpencoded.stage_encoded(ch, steps, views[0].digest(), tensors, mode, fresh)  # type: ignore[arg-type]
    assert got is not None
    staged, summary = got
    assert (staged.base, staged.target) == (views[0].digest(), views[4].digest())
    assert summary["phases"]["gather"] > 0 and summary["phases"]["decode"] > 0
    assert list(tmp_path.iterdir()) == []  # the wholes, blobs and parts unlinked
    for r, before in zip(ranks, snap):  # staged: nothing written
        assert all(np.array_equal(before[p], r.params[p]) for p in r.params)
    tp_ops.commit(ch, staged.payload["sglang_tokens"])  # type: ignore[arg-type]
    assert tp_ops.held(ch, tensors, fresh=True) == (views[4].tensor_digests(), views[4].digest())  # type: ignore[arg-type]
    back = _chain(5)[1][4]  # one step, v4 -> v5
    got = tpencoded.stage_encoded(ch, [back], views[4].digest(), tensors, mode, fresh)  # type: ignore[arg-type]
    assert got is not None
    tp_ops.commit(ch, got[0].payload["sglang_tokens"])  # type: ignore[arg-type]
    assert tp_ops.held(ch, tensors, fresh=True)[1] == back.target  # type: ignore[arg-type]


@pytest.mark.parametrize("batch", [1, 1 << 30])
def test_a_kept_arena_is_reused_and_what_it_held_is_never_read(
    batch: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adapter's arena (sglang/arena.py) stays from one staging to the next, the ranks
    keep their mapping of it, and garbage left in it (a staging's leftovers, or anything)
    cannot reach a staged update: each rank's blocks tile every tensor again. It grows by a
    new file when a batch needs more; closing it unlinks it and the ranks let go."""
    from rollpatch.engines.sglang import owned, tpencoded
    from rollpatch.engines.sglang import tp as tp_ops
    from rollpatch.engines.sglang.arena import Arena

    monkeypatch.setattr(tpencoded, "BATCH_BYTES", batch)
    views, steps = _chain(3)
    ranks = _ranks(2, vllm_layouts.checkpoint(3))
    ch, tensors = RanksChannel(ranks), _tensors(views[0])
    count = iter(range(1 << 20))
    arena = Arena(lambda what: tmp_path / f"{what}-{next(count)}")
    paths = []
    for k, step in enumerate(steps):
        if arena.path is not None:  # garbage where the tensors go
            with open(arena.path, "r+b") as f:
                f.write(np.random.default_rng(k).bytes(arena.nbytes))
        root = views[k].digest()
        got = tpencoded.stage_encoded(
            ch, [step], root, tensors, "in_place", ch_fresh(tmp_path), arena
        )  # type: ignore[arg-type]
        assert got is not None
        tp_ops.commit(ch, got[0].payload["sglang_tokens"])  # type: ignore[arg-type]
        assert tp_ops.held(ch, tensors, fresh=True)[1] == views[k + 1].digest()  # type: ignore[arg-type]
        paths.append(arena.path)
        assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [arena.path.name]  # type: ignore[union-attr]
    assert len(set(paths)) == 1 and owned._ARENA[0] == str(paths[0])  # mapped once, kept
    if batch == 1:  # one tensor per batch: the arena spans the largest
        big = max(t.nbytes for t in views[0].values())
        assert big <= arena.nbytes < big + Arena.ALIGN
    first = arena.path
    arena.fit(arena.nbytes + 1)  # a batch needing more: a new file, the old one gone
    assert arena.path != first and not first.exists()  # type: ignore[union-attr]
    owned.unmap_arena()
    arena.close()
    assert not owned._ARENA and [p for p in tmp_path.iterdir() if p.is_file()] == []


def ch_fresh(tmp_path: Path) -> Any:
    count = iter(range(1 << 20))
    return lambda what: tmp_path / f"f-{what}-{next(count)}"


def test_owned_decoding_refuses_before_any_rank_stages(tmp_path: Path) -> None:
    """Another base, a tampered payload, a layout the engine does not hold: refused with no
    rank staged and nothing written; a step in another codec is left to the follower (None)."""
    import dataclasses as dc

    from rollpatch.engines.sglang import tpencoded
    from rollpatch.errors import PatchDecodeError
    from rollpatch.patch import FullOp
    from rollpatch.patch.wire import encode

    views, steps = _chain(2)
    ranks = _ranks(2, vllm_layouts.checkpoint(3))
    ch, tensors = RanksChannel(ranks), _tensors(views[0])
    snap = [{p: v.copy() for p, v in r.params.items()} for r in ranks]

    count = iter(range(1 << 20))

    def stage(steps: list[Any], root: str = views[0].digest(), t: Any = tensors) -> Any:
        def fresh(what: str) -> Path:
            return tmp_path / f"{what}-{next(count)}"

        return tpencoded.stage_encoded(ch, steps, root, t, "in_place", fresh)  # type: ignore[arg-type]

    with pytest.raises(BaseMismatchError, match="root"):
        stage(steps, root=views[1].digest())
    with pytest.raises(BaseMismatchError, match="tensor is not the patch's base"):
        stage(steps[1:], root=steps[1].base)  # the ranks hold v0
    blob = bytearray(steps[0].blobs[0])
    blob[-1] ^= 1  # the last payload byte: its checksum no longer holds
    with pytest.raises(PatchDecodeError, match="checksum"):
        stage([dc.replace(steps[0], blobs=(bytes(blob),)), steps[1]])
    odd = {**tensors, "o_proj.weight": ["bf16", [1, 1]]}
    with pytest.raises(BaseMismatchError, match="layout"):
        stage(steps, t=odd)
    full = diff(views[0], views[1])
    name = min(full.tensors)
    full.tensors[name] = dc.replace(full.tensors[name], change=FullOp(views[1][name].copy()))
    assert stage([dc.replace(steps[0], blobs=(encode(full, views[0]),))]) is None
    assert all(not r.staged for r in ranks)
    for r, before in zip(ranks, snap):
        assert all(np.array_equal(before[p], r.params[p]) for p in r.params)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tp", [2, 4])
def test_export_gathers_every_tensor_from_the_ranks(tp: int, tmp_path: Path) -> None:
    """words() at TP > 1: each rank's block copied into one shared buffer of the whole tensor
    (or sent as a file and placed by the adapter) gives the checkpoint tensor, bit for bit."""
    from rollpatch.engines.sglang import tp as tp_ops

    ck = vllm_layouts.checkpoint(6)
    a = vllm_layouts.words_view(ck)
    ch = RanksChannel(_ranks(tp, ck))
    for name, t in a.items():
        for shared in (True, False):
            path = tmp_path / f"{name}-{shared}.bin"
            got = tp_ops.export(ch, name, _tensors(a)[name], path, shared=shared)  # type: ignore[arg-type]
            assert got.kind == t.kind and got.shape == t.shape
            assert np.array_equal(got.data, t.data), (name, shared)
            assert not path.exists()  # unlinked (a shared buffer stays mapped until dropped)


def test_controls_reach_every_rank_at_once_and_raise_the_first_failure() -> None:
    """SglangChannel.controls: every rank's control call runs at the same time (each waits
    for all the others at a barrier, which one rank after another would never pass), answers
    in rank order; a failing rank's error is raised once every rank has answered."""
    import threading

    from rollpatch.engines.sglang.channel import SglangChannel

    class Probe(SglangChannel):
        def __init__(self, tp: int, fail: int = -1) -> None:
            super().__init__("http://x", shared_dir=None, timeout=5.0, lock=threading.RLock())
            self.tp, self.fail, self.done = tp, fail, []
            self.barrier = threading.Barrier(tp, timeout=10)

        def start(self) -> None:
            pass

        def control(self, op: str, *, rank: int = 0, **args: object) -> dict[str, object]:
            self.barrier.wait()  # passed only when every rank's call runs at once
            if rank == self.fail:
                raise EngineError("rank failed", rank=rank)
            self.done.append(rank)
            return {"op": op, "rank": rank, **args}

    for tp in (2, 4):
        ch = Probe(tp)
        try:
            got = ch.controls("digest", fresh=True)
        finally:
            ch.close()
        assert got == [{"op": "digest", "rank": r, "fresh": True} for r in range(tp)]
    ch = Probe(4, fail=1)
    try:
        with pytest.raises(EngineError, match="rank failed"):
            ch.controls("drop")
        assert sorted(ch.done) == [0, 2, 3]  # the others answered first
    finally:
        ch.close()
