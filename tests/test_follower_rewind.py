"""A replica that followed a run from its anchor catches up by ONE folded patch, end to end on
the built-in engine: its records of v0 -> v1 rebuild v0's words, the fold v0 -> v6 is decoded
against them and proven to reach the signed target (a tensor changed at v1 and left alone by
the fold goes back to v0's words); a record that no longer holds the engine's words is
refused and the follower takes the chain instead, never serving wrong bits; records go on a
load, a failed commit and an audit mismatch.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("torch")
pytest.importorskip("transformers")

from rollpatch import native
from rollpatch.board import Board
from rollpatch.errors import RollpatchError
from rollpatch.follower import Follower
from rollpatch.formats import cast_view
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.trust import Root, Signer, SigningKey, Trust, sign_root
from rollpatch.view import View
from tests.conftest import FAST_FOLLOWER

pytestmark = pytest.mark.skipif(native.core is None, reason="the native core is not built")

RUN = "rewind"
FAST = FAST_FOLLOWER
#: One anchor (v0): every version v >= 2 also gets the fold v0 -> v.
CFG = {"keyframe_every": 0, "skip_strides": (), "fold_every": 8}
#: Moves at v1 only and is back to v0's values from v2 on: the fold from v0 leaves it alone.
BACK = "model.norm.weight"


@dataclasses.dataclass
class Run:
    board: Board
    views: list[View]


@pytest.fixture(scope="module")
def run(tiny_model: Path) -> Run:
    from rollpatch.io.safetensors import load_view

    key = SigningKey.generate()
    trust = Trust(sign_root(Root.new([key.public]), [key]))
    board = Board(f"memory://rewind-{os.getpid()}-{id(key)}")
    masters = {
        n: t.to_array().astype(np.float32)
        for n, t in load_view(tiny_model / "model.safetensors").items()
    }
    first = masters[BACK].copy()
    rng = np.random.default_rng(9)
    views = []
    cfg = PublisherConfig(signer=Signer(keys=(key,)), **CFG)
    with Publisher(board, RUN, cfg, asynchronous=False) as pub:
        for v in range(8):
            for name, m in masters.items():
                if v and (name != BACK or v == 1):
                    pick = rng.random(m.shape) < 0.04
                    m[pick] *= np.float32(1) + rng.normal(0, 0.05, int(pick.sum())).astype(
                        np.float32
                    )
            if v == 2:
                masters[BACK] = first.copy()
            assert pub.publish(masters) == v
            views.append(cast_view(masters, "bf16"))
    assert not np.array_equal(views[1][BACK].data, views[0][BACK].data)
    assert np.array_equal(views[6][BACK].data, views[0][BACK].data)
    return Run(Board(board.store, trust=trust), views)


def _engine(tiny_model: Path, **kw: Any) -> Any:
    from rollpatch.engines.reference import ReferenceEngine

    return ReferenceEngine.from_dir(tiny_model, threads=1, serve_http=False, **kw)


@pytest.fixture
def engine(reference_engine: Any) -> Any:
    return reference_engine


def _boot(eng: Any, run: Run) -> tuple[list[list[int]], list[int]]:
    """Load v0; record the hops of every stage_encoded and the versions committed."""
    eng.load(run.views[0].copy(), 0)
    calls: list[list[int]] = []
    written: list[int] = []
    stage, commit = eng.stage_encoded, eng.commit_staged

    def stage_encoded(steps: Any, version: int) -> Any:
        calls.append([len(s.blobs) for s in steps])
        return stage(steps, version)

    def commit_staged(staged: Any, version: int) -> None:
        written.append(version)
        commit(staged, version)

    eng.stage_encoded, eng.commit_staged = stage_encoded, commit_staged
    return calls, written


def _fresh(eng: Any) -> str:
    """The engine's root digest re-hashed from its live words (no cached digest)."""
    return View({n: t for n, t in eng.runtime.view.items()}).digest()


def _exact(eng: Any, view: View) -> None:
    assert eng.digest == view.digest() == _fresh(eng)
    for name, t in view.items():
        assert np.array_equal(eng.runtime.view[name].data, t.data), name


def test_a_followed_replica_catches_up_by_one_rewound_fold(run: Run, engine: Any) -> None:
    calls, written = _boot(engine, run)
    f = Follower(run.board, RUN, engine, FAST)
    assert f.sync(1) == 1 and calls == [[1]]
    assert engine.rewindable() == {0: run.views[0].digest()}
    plan = run.board.plan(RUN, 1, 6, sources=engine.rewindable())
    assert [(s.base, s.to) for s in plan.steps] == [(0, 6)] and plan.rewinds
    assert [(s.base, s.to) for s in run.board.plan(RUN, 1, 6).steps] == [
        (v, v + 1) for v in range(1, 6)
    ]
    assert f.sync(6) == 6
    assert calls[-1] == [1] and written == [1, 6]  # one hop, one decode, one commit
    assert [(s.base, s.to) for s in f.last_plan.steps] == [(0, 6)]  # type: ignore[union-attr]
    _exact(engine, run.views[6])
    # changed at v1, untouched by the fold: back to v0's words
    assert np.array_equal(engine.runtime.view[BACK].data, run.views[0][BACK].data)
    assert sorted(engine.rewindable()) == [0, 1]  # and v1 -> v6 is a record too
    assert f.sync(7) == 7 and calls[-1] == [1]  # one behind: the step, not a rewind
    assert [(s.base, s.to) for s in f.last_plan.steps] == [(6, 7)]  # type: ignore[union-attr]
    _exact(engine, run.views[7])


def test_a_corrupted_record_is_refused_and_the_chain_taken(run: Run, engine: Any) -> None:
    calls, written = _boot(engine, run)
    f = Follower(run.board, RUN, engine, FAST)
    assert f.sync(1) == 1
    (rec,) = engine.rewind._records
    name = max(rec.undo, key=lambda n: rec.undo[n][0].size)
    rec.undo[name][1][7] ^= 1  # the retained word is no longer v0's
    assert f.sync(6) == 6
    assert calls[1:] == [[1], [1, 1, 1, 1, 1]]  # the rewind refused, then the chain from v1
    assert written == [1, 6]  # nothing written by the refused staging
    _exact(engine, run.views[6])
    assert engine.rewindable() == {1: run.views[1].digest()}  # the suspect records went
    st = f.status()
    assert st.last_error is None and st.reboots == 0


def test_no_records_no_rewind(run: Run, tiny_model: Path) -> None:
    import torch

    threads = torch.get_num_threads()  # the engine sets it
    eng = _engine(tiny_model, rewind_max_bytes=0)
    try:
        calls, _ = _boot(eng, run)
        f = Follower(run.board, RUN, eng, FAST)
        assert f.sync(1) == 1 and eng.rewindable() == {}
        assert f.sync(6) == 6 and calls[-1] == [1, 1, 1, 1, 1]
        _exact(eng, run.views[6])
    finally:
        eng.close()
        torch.set_num_threads(threads)


def test_rewind_max_bytes_is_checked(tiny_model: Path) -> None:
    from rollpatch.errors import ConfigError

    with pytest.raises(ConfigError, match="rewind_max_bytes"):
        _engine(tiny_model, rewind_max_bytes=-1)


def test_records_go_on_load_failed_commit_and_audit(run: Run, engine: Any) -> None:
    _boot(engine, run)
    f = Follower(run.board, RUN, engine, FAST)
    assert f.sync(1) == 1 and engine.rewindable()
    engine.load(run.views[1].copy(), 1)
    assert engine.rewindable() == {}
    assert f.sync(2) == 2 and engine.rewindable() == {1: run.views[1].digest()}

    def broken(view: Any, staged: Any) -> None:
        raise RollpatchError("disk on fire")

    engine._write = broken
    with pytest.raises(RollpatchError, match="disk on fire"):
        f.sync(3)
    del engine._write
    assert engine.rewindable() == {} and engine.version == 2
    assert f.sync(3) == 3 and engine.rewindable() == {2: run.views[2].digest()}
    t = engine.runtime.view[BACK]
    t.data.reshape(-1)[0] ^= 1  # a word changed behind the engine's back
    report = engine.audit(1 << 40)
    assert report.mismatched and engine.rewindable() == {}


def test_a_reader_that_predates_sources_plans_as_before(run: Run, engine: Any) -> None:
    """With no records to rewind to, the follower calls ``plan`` without ``sources``: a
    reader whose ``plan`` predates them (bench/board.py's chain-only board did) still works."""
    from rollpatch.engines.rewind import RewindLog

    seen: list[dict[str, Any]] = []

    class OldReader(Board):
        def plan(self, run_: str, have: Any, want: int, **kw: Any) -> Any:
            seen.append(kw)
            if "sources" in kw:
                raise TypeError("plan() got an unexpected keyword argument 'sources'")
            return super().plan(run_, have, want, **kw)

    engine.rewind = RewindLog(max_bytes=0)
    _boot(engine, run)
    f = Follower(run.board, RUN, engine, FAST)
    f._reader = OldReader(run.board.store, trust=run.board.trust)  # the bench's seam
    assert f.sync(1) == 1 and f.sync(4) == 4
    assert seen and all("sources" not in kw for kw in seen)
    _exact(engine, run.views[4])
