"""The follower's encoded path, for engines that decode themselves (offline, no vLLM): the
follower hands a plan's patch objects, every step and shard, to an engine that stages them
itself (:meth:`EngineAdapter.stage_encoded`, as VllmEngine's workers do) and decodes against
``words()`` otherwise; a replica whose engine booted on an older version reports no version
until it has caught up. A real vLLM behind the sidecar: tests/test_vllm_sidecar.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.engines import ViewEngine
from rollpatch.engines.staged import EncodedStep, StagedUpdate, stage_patch
from rollpatch.errors import BaseMismatchError
from rollpatch.follower import Follower, FollowerConfig
from rollpatch.formats import cast_view
from rollpatch.patch import Patch, compose, decode
from rollpatch.patch.ops import scatter
from rollpatch.patch.overlay import Overlay
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.store import ObjectInfo, Store
from rollpatch.view import View

RUN = "rl"
FAST = FollowerConfig(poll_s=0.05, backoff_s=0.01, timeout_s=60.0)


# -- offline: the follower's encoded path ------------------------------------------------------


class SelfStaging(ViewEngine):
    """Stages published steps itself, as VllmEngine's workers do: decodes every shard of every
    step against its own words (step k over an Overlay of steps 1..k-1), composes, proves the
    target in O(changed); the commit only scatters."""

    def __init__(self) -> None:
        super().__init__()
        self.staged: list[tuple[list[int], int]] = []  # (objects per step, version) per call
        self.words_calls = 0

    def words(self) -> Any:
        self.words_calls += 1
        return super().words()

    def stage_encoded(self, steps: Sequence[EncodedStep], version: int) -> StagedUpdate:
        view = self.view
        if view.digest() != steps[0].base:
            raise BaseMismatchError("not on the chain's base", engine=self.name)
        patch: Patch | None = None
        for st in steps:
            base = view if patch is None else Overlay(view, patch)
            parts = [decode(b, base, check_base=False) for b in st.blobs]
            one = Patch(st.base, st.target, {n: t for p in parts for n, t in p.tensors.items()})
            patch = one if patch is None else compose(patch, one)
        assert patch is not None
        self.staged.append(([len(st.blobs) for st in steps], version))
        return stage_patch(patch, view.__getitem__, view.tensor_digests(), view.sum_state)

    def commit_staged(self, staged: StagedUpdate, version: int) -> None:
        view = self.view
        assert view.digest() == staged.base
        for name, st in staged.tensors.items():
            scatter(view[name], st.positions, st.new, st.old)
            if st.target_state is not None:
                view.update_sum_state(name, st.target_state)
            else:  # packed kinds: the proof hashed a staged copy; re-hash the written words
                view.invalidate(name)
                assert view.tensor_digest(name) == st.target_digest
        self._version = version


def _masters(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        f"layers.{i}.w": (rng.standard_normal((32, 64)) * 0.02).astype(np.float32) for i in range(4)
    }


def _step(masters: Mapping[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        n: m + (0.01 * float(m.std()) * rng.standard_normal(m.shape)).astype(np.float32)
        for n, m in masters.items()
    }


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[View]]:
    """Versions 0..4 of a small run (one keyframe at 0, step patches) on a file:// board."""
    rng = np.random.default_rng(5)
    board = f"file://{tmp_path_factory.mktemp('encoded') / 'board'}"
    pub = Publisher(
        board, RUN, PublisherConfig(keyframe_every=0, skip_strides=()), asynchronous=False
    )
    masters, views = _masters(rng), []
    for _ in range(5):
        pub.publish(masters)
        views.append(cast_view(masters, "bf16"))
        masters = _step(masters, rng)
    pub.close()
    return board, views


def test_engines_that_stage_get_whole_chains_undecoded(small_run: tuple[str, list[View]]) -> None:
    """A catch-up of any length is one stage_encoded call (nothing decoded in the follower,
    no words crossing), then one commit; its result is bit-exact."""
    board, views = small_run
    engine = SelfStaging()
    engine.load(views[0].copy(), 0)
    f = Follower(board, RUN, engine, FAST)
    assert f.sync(1) == 1 and engine.digest == views[1].digest()
    assert f.sync(4) == 4 and engine.digest == views[4].digest()
    assert engine.staged == [([1], 1), ([1, 1, 1], 4)] and engine.words_calls == 0
    assert View({n: t for n, t in engine.view.items()}).digest() == views[4].digest()
    assert f.status().commits == 2


def test_sharded_steps_are_staged_whole() -> None:
    """A 2-shard step: every shard's object goes to the engine, which binds their union to
    the manifest's whole-view digests."""
    from tests.followfix import _build  # the follower tests' run: v21 has 2 patch shards

    pub = _build(21, None, 0)
    engine = SelfStaging()
    engine.load(pub.views[19].copy(), 19)
    assert Follower(Board(pub.store), "rl", engine, FAST).sync(21) == 21
    assert engine.digest == pub.views[21].digest() and engine.words_calls == 0
    assert engine.staged[0][0][-1] == 2


class GatedStore(Store):
    """Objects wait for ``open`` (to hold a catch-up half-way)."""

    writable = False

    def __init__(self, inner: Store) -> None:
        self.inner, self.uri = inner, inner.uri
        self.open = threading.Event()

    def _get(self, key: str) -> bytes:
        if "/objects/" in key:
            self.open.wait(30)
        return self.inner.get(key)

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        return self.inner.get_range(key, start, end)

    def _list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def _head(self, key: str) -> ObjectInfo | None:
        return self.inner.head(key)

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        raise AssertionError("read-only")

    def _delete(self, key: str) -> None:
        raise AssertionError("read-only")

    def _cas(self, key: str, data: bytes, *, expected: bytes | None) -> None:
        raise AssertionError("read-only")


def test_an_older_engine_is_not_ready_until_caught_up(small_run: tuple[str, list[View]]) -> None:
    board, views = small_run
    gated = GatedStore(Board(board).store)
    engine = ViewEngine()
    engine.load(views[0].copy(), 0)  # booted from an older keyframe: verified, but behind
    f = Follower(Board(gated), RUN, engine, FAST)
    f.start()
    try:
        time.sleep(0.3)
        assert f.version is None and f.status().version is None  # catching up: not ready
        gated.open.set()
        assert f.wait_for(4, 30) and f.version == 4
    finally:
        f.stop()
