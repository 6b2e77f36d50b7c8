"""The reference engine's staged commits (issue 10): staging proves the target while serving,
the commit only writes; encoded chains; double buffers; refused patches; ``sum_delta``; the
background audit finding a flipped bit.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from rollpatch.errors import BaseMismatchError, ConfigError, EngineError, TargetMismatchError
from rollpatch.patch import Patch, diff
from rollpatch.view import View
from tests.refenginefix import (
    PROMPT,
    audited_sidecar,
    base,
    engine,
    greedy,
    model_dir,
    restore,
    target,
)

_FIXTURES = (base, engine, model_dir, restore, target)  # used by name


# ---- staged commits and the background audit (issue 10) -------------------------------


def test_stage_while_serving_then_commit_only_writes(
    engine: Any, base: View, target: View, restore: None
) -> None:
    """Staging proves the target digests from the changed words alone, while generation runs;
    the commit writes, reads back, and leaves digests that a full re-hash confirms."""
    from rollpatch.follower.commit import CommitGate

    rt = engine.runtime
    patch = diff(base, target)
    ids = rt.tokenizer.encode(PROMPT)
    gen = rt.generate(ids, max_tokens=40, temperature=0, ignore_eos=True)
    next(gen)  # a generation is in flight and keeps stepping while we stage
    staged = engine.stage(patch, 2)
    assert list(gen) and engine.version == 1  # staging wrote nothing
    assert set(staged.digests) == set(patch.tensors) and staged.target == target.digest()
    assert staged.changed == patch.n_changed and staged.nbytes == 12 * staged.changed
    gate = CommitGate(engine, "pause")
    gate.run(lambda: engine.commit_staged(staged, 2))
    assert engine.version == 2 and engine.digest == target.digest()
    assert gate.last is not None and gate.last.pause_s == gate.last_pause_s
    fresh = View({n: t for n, t in rt.view.items()})  # no cached digests: a full re-hash
    assert fresh.digest() == target.digest()
    with pytest.raises(BaseMismatchError):  # staged against version 1: refused on version 2
        engine.commit_staged(staged, 3)
    assert engine.version == 2


def test_commit_whose_write_check_fails_leaves_every_word_in_place(
    engine: Any, base: View, target: View, restore: None
) -> None:
    """A word changed behind the digests after staging (the last tensor written): the
    commit's old-word check refuses it and nothing of the update stays written. As in the
    vLLM worker, the rollback writes the held version's words over every staged position
    of the tensors it started, the one changed behind the digests included."""
    rt = engine.runtime
    staged = engine.stage(diff(base, target), 2)
    names = list(staged.tensors)
    victim = names[-1]
    before = {n: rt.view[n].data.copy() for n in rt.view}
    pos = int(staged.tensors[victim].positions[0])
    rt.view[victim].data[pos] ^= 1  # behind the cached digests: the base check still passes
    with pytest.raises(BaseMismatchError):
        engine.commit_staged(staged, 2)
    assert engine.version == 1
    assert all(np.array_equal(rt.view[n].data, before[n]) for n in before)


def test_stage_encoded_chain_in_place_while_serving(
    engine: Any, base: View, target: View, restore: None
) -> None:
    """A chain of two published steps is decoded into one copy per touched tensor while a
    generation runs (rollpatch.engines.catchup: nothing written, the decoder's changes prove
    the targets), then committed; a full re-hash confirms the target."""
    from rollpatch.engines.staged import EncodedStep
    from rollpatch.patch import encode

    full = diff(base, target)
    mid = View({n: t.copy() for n, t in base.items()})
    for name, tp in full.tensors.items():
        mid[name].data[tp.changes().positions[::2]] = tp.changes().new[
            ::2
        ]  # half of the change, then the rest
        mid.invalidate(name)
    steps = [
        EncodedStep((encode(diff(a, b), a),), a.digest(), b.digest())
        for a, b in ((base, mid), (mid, target))
    ]
    rt = engine.runtime
    gen = rt.generate(rt.tokenizer.encode(PROMPT), max_tokens=40, temperature=0, ignore_eos=True)
    next(gen)
    staged = engine.stage_encoded(steps, 2)
    assert list(gen) and engine.version == 1 and engine.digest == base.digest()
    assert staged is not None and staged.target == target.digest()
    assert staged.changed == full.n_changed  # the composed change, not the two steps' sum
    assert staged.digests == engine.stage(full, 2).digests
    engine.commit_staged(staged, 2)
    assert View({n: t for n, t in rt.view.items()}).digest() == target.digest()
    # from the base again: a version the engine's record of that commit rebuilds (a rewind),
    # which leads to the words it holds: nothing to write
    again = engine.stage_encoded(steps, 3)
    assert again is not None and again.base == again.target == target.digest()
    assert again.changed == 0
    engine.rewind.clear()
    with pytest.raises(BaseMismatchError):  # neither the held version nor a rewindable one
        engine.stage_encoded(steps, 3)


def test_double_buffered_commit_exchanges_storage(
    engine: Any, base: View, target: View, restore: None
) -> None:
    """``writes="double_buffer"``: staging builds each touched tensor's new storage (the live
    weights untouched, generation running), the commit exchanges it for the parameters' in
    O(1): the model computes exactly what the in-place commit computes, the view aliases the
    new storage (a full re-hash = target), and a failed exchange puts the old storage back."""
    from rollpatch.engines.reference import ReferenceEngine
    from rollpatch.engines.reference.binding import Storage
    from rollpatch.engines.staged import EncodedStep
    from rollpatch.patch import encode

    rt = engine.runtime
    engine.apply(diff(base, target), 2)
    want = greedy(rt)
    engine.load(base, 1)
    double = ReferenceEngine(rt, serve_http=False, writes="double_buffer")
    ptrs = {n: p.data_ptr() for n, p in rt.model.named_parameters()}
    gen = rt.generate(rt.tokenizer.encode(PROMPT), max_tokens=20, temperature=0, ignore_eos=True)
    next(gen)
    step = EncodedStep((encode(diff(base, target), base),), base.digest(), target.digest())
    staged = double.stage_encoded([step], 2)
    assert staged is not None and set(staged.payload["buffers"]) == set(staged.tensors)
    # made ready while staging (torch and view tensors over the buffers): the pause assigns
    assert all(isinstance(b, Storage) for b in staged.payload["buffers"].values())
    assert list(gen) and rt.view.digest() == base.digest()  # nothing written while staging
    double.commit_staged(staged, 2)
    assert rt.held_digest == target.digest() == rt.view.digest()
    assert greedy(rt) == want
    moved = [n for n, p in rt.model.named_parameters() if p.data_ptr() != ptrs[n]]
    assert moved and all(
        rt.view[n].data.__array_interface__["data"][0] == p.data_ptr()
        for n, p in rt.model.named_parameters()
        if n in rt.view
    )
    rt.view.invalidate()
    assert rt.view.digest() == target.digest()
    staged = double.stage(diff(target, base), 1)
    name = next(iter(staged.payload["buffers"]))
    staged.payload["buffers"]["no.such.tensor"] = staged.payload["buffers"][name]
    with pytest.raises(EngineError):
        double.commit_staged(staged, 1)
    assert rt.view.digest() == target.digest() and engine.version == 2
    with pytest.raises(ConfigError):
        ReferenceEngine(rt, serve_http=False, writes="both")  # type: ignore[arg-type]


def test_stage_refuses_a_patch_that_would_miss_its_target(
    engine: Any, base: View, target: View
) -> None:
    from rollpatch.patch import DeltaOp, TensorPatch

    patch = diff(base, target)
    name = min(patch.tensors)
    tp = patch.tensors[name]
    bad_new = tp.changes().new.copy()
    bad_new[0] ^= 1
    bad = Patch(
        patch.base,
        patch.target,
        {
            **patch.tensors,
            name: TensorPatch(
                name,
                tp.kind,
                tp.shape,
                tp.base_digest,
                tp.target_digest,
                DeltaOp(tp.changes().positions, tp.changes().old, bad_new),
            ),
        },
    )
    with pytest.raises(TargetMismatchError):
        engine.stage(bad, 2)
    assert engine.version == 1 and engine.digest == base.digest()


@pytest.mark.parametrize("slice_", [1 << 16, 3])
def test_sum_delta_matches_a_full_hash(monkeypatch: pytest.MonkeyPatch, slice_: int) -> None:
    """The O(changed) sum change equals a full re-hash, also when it is summed in slices
    (3 positions: slices end between 8-byte words, never inside one)."""
    from rollpatch.engines import sumchange
    from rollpatch.engines.sumchange import sum_delta
    from rollpatch.view import sum128

    monkeypatch.setattr(sumchange, "_SUM_SLICE", slice_)
    rng = np.random.default_rng(3)
    m = (1 << 64) - 1
    for dtype, n in (
        (np.uint16, 1),
        (np.uint16, 1003),
        (np.uint32, 77),
        (np.uint8, 13),
        (np.uint64, 9),
        (np.uint8, 4000),
    ):
        a = rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype)
        pos = np.unique(rng.integers(0, n, max(1, n // 4))).astype(np.int64)
        new = rng.integers(0, np.iinfo(dtype).max, pos.size, dtype=dtype)
        s, d = sum128(a), sum_delta(a, pos, new)
        b = a.copy()
        b[pos] = new
        assert ((s[0] + d[0]) & m, (s[1] + d[1]) & m) == sum128(b)


def test_audit_finds_a_flipped_bit_and_the_sidecar_resyncs(model_dir: Path, tmp_path: Path) -> None:
    """Flip one bit of a live weight behind the sidecar's back: the audit finds it within its
    period, /ready answers 503 (out of rotation), and the follower re-syncs from a keyframe
    by itself, back on a verified version whose full re-hash is the published digest."""
    from rollpatch.engines.reference import ReferenceEngine

    board = f"file://{tmp_path / 'board'}"
    eng = ReferenceEngine.from_dir(model_dir, threads=1)
    sc, latest = audited_sidecar(board, eng)
    try:
        deadline = time.monotonic() + 60
        while sc.sidecar.follower.version != latest:
            assert time.monotonic() < deadline, "never caught up"
            time.sleep(0.02)
        assert httpx.get(sc.url + "/ready").status_code == 200
        name = min(eng.runtime.view)
        seen, loaded = threading.Event(), []
        load = eng.load

        def held_load(view: View, version: int) -> None:  # hold the re-sync until /ready 503
            seen.wait(30)
            loaded.append(version)
            load(view, version)

        eng.load = held_load  # type: ignore[method-assign]
        auditor = sc.sidecar.follower.auditor
        assert auditor is not None
        hashed_before = auditor.bytes
        t0 = time.monotonic()
        with eng.runtime.commit() as view:  # a stray write: nothing updates any digest
            view[name].data[5] ^= np.uint16(1 << 3)
        # the audit's 503 (one before it is another: /ready's probe of the engine timing out)
        while not (
            auditor.bytes_at_first_mismatch is not None  # counted when the audit found it
            and httpx.get(sc.url + "/ready").status_code == 503
        ):
            assert time.monotonic() - t0 < 30, "the audit never found the flipped bit"
            time.sleep(0.01)
        hashed = auditor.bytes_at_first_mismatch - hashed_before
        seen.set()
        while not (
            httpx.get(sc.url + "/ready").status_code == 200
            and sc.sidecar.follower.version == latest
        ):
            assert time.monotonic() - t0 < 60, "never came back on a verified version"
            time.sleep(0.02)
        # found within one pass over the model, counted from before the write: the slice
        # running then (which may have read that tensor just before it) adds one more budget,
        # and the pass's last slice may end past the tensor
        assert 0 < hashed <= eng.runtime.view.nbytes + 2 * auditor.budget, hashed
        assert loaded == [latest] and sc.sidecar.follower.status().audits == 1
        fresh = View({n: t for n, t in eng.runtime.view.items()})
        assert fresh.digest() == sc.sidecar.board.manifest("r1", latest).target
        v = httpx.get(sc.url + "/version").json()
        assert v["audit_mismatches"] == 1
        # pause mode: a pause figure, no drain figure (no admission was closed to drain)
        assert v["last_pause_s"] is not None and v["last_drain_s"] is None
    finally:
        sc.stop()
