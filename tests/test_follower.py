"""The follower: catch-up bit for bit, keyframes, skips, shards, following, signatures, limits.

The published board: tests/followfix.py. Self-healing: test_follower_healing.py; the
overlay and memory: test_follower_overlay.py; ``rollpatch pull``: test_follower_cli.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.engines import ViewEngine
from rollpatch.errors import ConfigError, ManifestError, NoPathError
from rollpatch.follower import Follower, FollowerConfig, FollowerState
from rollpatch.trust import Root, SigningKey, Trust, sign_root
from tests.followfix import (
    FAST,
    LAST,
    ROOT,
    RUN,
    SHARDED,
    Published,
    assert_holds,
    board,
    copy_board,
    engine_at,
    next_view,
    publish,
    published,
    signed,
)

_FIXTURES = (board, published, signed)  # used by name


# -- catch-up, keyframes, skips, shards ------------------------------------------------------


@pytest.mark.parametrize("behind", [1, 4, 16])
def test_catch_up_is_bit_exact_in_one_commit(
    board: Board, published: Published, behind: int
) -> None:
    engine = engine_at(published, LAST - behind)
    f = Follower(board, RUN, engine, FAST)
    commits: list[tuple[int, float]] = []
    f.on_commit.append(lambda v, pause: commits.append((v, pause)))
    assert f.sync() == LAST
    assert_holds(engine, published.views[LAST])
    assert f.last_plan is not None and not f.last_plan.steps[0].is_keyframe
    assert [c[0] for c in commits] == [LAST]  # composed: one apply, one pause
    st = f.status()
    assert (st.state, st.version, st.latest, st.lag, st.commits) == (
        FollowerState.IDLE,
        LAST,
        LAST,
        0,
        1,
    )
    assert st.objects_fetched == f.last_plan.n_objects and st.bytes_fetched == f.last_plan.bytes
    assert st.last_fetch_s is not None and st.last_stage_s is not None
    # one pause figure: the gate's, reported by on_commit and the status alike
    assert f.gate.last is not None and f.gate.last.ok and f.gate.last.mode == "pause"
    assert commits[0][1] == st.last_commit_s == f.gate.last.pause_s == f.gate.pauses[-1]
    assert f.sync() == LAST and f.status().commits == 1  # nothing to do


def test_a_staging_engine_is_written_under_the_gate_only(
    board: Board, published: Published
) -> None:
    """An engine that stages is asked to stage before the gate closes, and only to write
    (commit_staged) inside it; the commit is bit-exact and its digests need no re-hash."""
    from rollpatch.engines.staged import stage_patch
    from rollpatch.patch.ops import scatter

    events: list[str] = []

    class Staging(ViewEngine):
        def stage(self, patch: Any, version: int) -> Any:
            events.append(f"stage paused={f.gate.busy}")
            v = self.view
            return stage_patch(patch, v.__getitem__, v.tensor_digests(), v.sum_state)

        def commit_staged(self, staged: Any, version: int) -> None:
            events.append(f"write paused={f.gate.busy}")
            for name, st in staged.tensors.items():
                scatter(self.view[name], st.positions, st.new, st.old)
                if st.target_state is not None:
                    self.view.update_sum_state(name, st.target_state)
                else:
                    self.view.invalidate(name)
            self._version = version

        def apply(self, patch: Any, version: int) -> None:
            raise AssertionError("a staging engine is not asked to apply")

    engine = Staging()
    engine.load(published.views[LAST - 3].copy(), LAST - 3)
    f = Follower(board, RUN, engine, FAST)
    assert f.sync() == LAST
    assert events == ["stage paused=False", "write paused=True"]
    assert_holds(engine, published.views[LAST])


@pytest.mark.parametrize("want,first", [(LAST, 20), (20, 20), (5, 0)])
def test_boot_from_keyframe(board: Board, published: Published, want: int, first: int) -> None:
    engine = ViewEngine()
    f = Follower(board, RUN, engine, FAST)
    assert f.status().version is None
    assert f.sync(want) == want
    assert f.last_plan is not None and f.last_plan.steps[0].is_keyframe
    assert f.last_plan.steps[0].to == first
    assert len(f.last_plan.steps[0].objects) == (2 if first in SHARDED else 1)
    assert_holds(engine, published.views[want])


def test_skip_patches_used_when_cheaper(board: Board, published: Published) -> None:
    f = Follower(board, RUN, engine_at(published, 4), FAST)
    assert f.sync(12) == 12
    assert f.last_plan is not None
    assert [(s.base, s.to) for s in f.last_plan.steps] == [(4, 8), (8, 12)]
    chain = board.plan(RUN, 4, 5).bytes + sum(board.plan(RUN, v, v + 1).bytes for v in range(5, 12))
    assert f.last_plan.bytes < chain
    assert_holds(f.engine, published.views[12])  # type: ignore[arg-type]


def test_sharded_patch_versions(board: Board, published: Published) -> None:
    f = Follower(board, RUN, engine_at(published, 19), FAST)
    assert f.sync(21) == 21
    assert f.last_plan is not None
    assert [len(s.objects) for s in f.last_plan.steps] == [2, 2]
    assert_holds(f.engine, published.views[21])  # type: ignore[arg-type]


def test_refuses_to_move_backwards(board: Board, published: Published) -> None:
    f = Follower(board, RUN, engine_at(published, 10), FAST)
    with pytest.raises(NoPathError):
        f.sync(3)  # first sync: the engine's version is verified, then refused
    assert f.sync(10) == 10
    with pytest.raises(NoPathError):
        f.sync(3)
    assert f.status().state is FollowerState.IDLE and f.version == 10
    assert_holds(f.engine, published.views[10])  # type: ignore[arg-type]


def test_background_follows_new_versions(board: Board, published: Published) -> None:
    engine = ViewEngine()
    f = Follower(board, RUN, engine, FAST)
    seen: list[int] = []
    f.on_commit.append(lambda v, _: seen.append(v))
    f.start()
    try:
        assert f.wait_for(LAST, timeout=20)
        views = dict(published.views)
        views[LAST + 1] = next_view(np.random.default_rng(9), views[LAST])
        publish(board, LAST + 1, views, bases=(LAST,), keyframe=False)
        assert f.wait_for(LAST + 1, timeout=20)
        assert_holds(engine, views[LAST + 1])
        assert not f.wait_for(LAST + 2, timeout=0.05)
    finally:
        f.stop()
    assert seen == [LAST, LAST + 1]
    assert not f._watcher.alive and f.status().state is FollowerState.IDLE


# -- signatures, limits, config ------------------------------------------------------------


def test_signature_required_and_checked(signed: Published, published: Published) -> None:
    ok = Follower(copy_board(signed), RUN, ViewEngine(), trust=Trust(ROOT))
    assert ok.sync() == 5
    assert_holds(ok.engine, signed.views[5])  # type: ignore[arg-type]
    other = SigningKey.generate()
    wrong = sign_root(Root.new([other.public]), [other])
    for pub, root, msg in [(signed, wrong, "valid signature"), (published, ROOT, "not signed")]:
        engine = ViewEngine()
        f = Follower(copy_board(pub), RUN, engine, trust=Trust(root))
        with pytest.raises(ManifestError, match=msg):
            f.sync()
        assert engine.version is None and f.status().state is FollowerState.ERROR
        assert f.status().objects_fetched == 0


def test_max_stage_bytes_refuses_large_plans(board: Board, published: Published) -> None:
    f = Follower(board, RUN, ViewEngine(), FollowerConfig(max_stage_bytes=1000))
    with pytest.raises(NoPathError, match="max_stage_bytes"):
        f.sync()
    assert f.status().objects_fetched == 0


@pytest.mark.parametrize(
    "field,value",
    [
        ("poll_s", 0),
        ("poll_s", float("nan")),
        ("fetch_workers", 0),
        ("retries", -1),
        ("retries", 1.5),
        ("backoff_s", -1),
        ("timeout_s", 0),
        ("max_stage_bytes", 0),
        ("fetch_workers", True),
    ],
)
def test_config_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        FollowerConfig(**{field: value})  # type: ignore[arg-type]
