"""The follower heals itself: damaged, corrupt, missing and slow objects, flaky stores, engines
holding wrong bits or lying about them, broken adapters, and a bad LATEST (issue 11).

The published board: tests/followfix.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from rollpatch.board import Board, pointer_key
from rollpatch.engines import ViewEngine
from rollpatch.errors import (
    ManifestError,
    NotFoundError,
    ObjectIntegrityError,
    TransientStoreError,
    VerificationError,
)
from rollpatch.follower import Follower, FollowerConfig, FollowerState
from rollpatch.patch import Patch, diff
from rollpatch.store import ObjectInfo, Store
from rollpatch.view import View
from tests.conftest import until
from tests.followfix import (
    FAST,
    LAST,
    RUN,
    Published,
    assert_holds,
    board,
    engine_at,
    published,
    set_latest,
    step_objects,
)

_FIXTURES = (board, published)  # used by name


@pytest.mark.parametrize(
    "damage,error",
    [("flip", ObjectIntegrityError), ("truncate", ObjectIntegrityError), ("delete", NotFoundError)],
)
def test_damaged_object_refused_then_recovered(
    board: Board, published: Published, damage: str, error: type
) -> None:
    engine = engine_at(published, 19)
    f = Follower(board, RUN, engine, FAST)
    key = step_objects(board, 19, LAST, 1)[0]
    good = board.store.get(key)
    if damage == "delete":
        board.store.delete(key)
    else:
        bad = bytearray(good)
        if damage == "flip":
            bad[len(bad) // 2] ^= 0x40
        else:
            del bad[-7:]
        board.store.put(key, bytes(bad), if_absent=False)
    with pytest.raises(error):
        f.sync()
    st = f.status()
    assert st.state is FollowerState.ERROR and st.error_type == error.__name__
    assert st.last_error is not None and st.last_error.startswith(error.__name__)
    assert st.retries >= FAST.retries and st.commits == 0
    assert (engine.version, f.version, st.version) == (19, 19, 19)  # last good version
    assert_holds(engine, published.views[19])
    board.store.put(key, good, if_absent=False)  # repaired
    assert f.sync() == LAST
    st = f.status()
    assert (st.state, st.last_error, st.version) == (FollowerState.IDLE, None, LAST)
    assert_holds(engine, published.views[LAST])


def test_a_corrupt_object_is_planned_around(board: Board, published: Published) -> None:
    """A corrupt stored copy stays corrupt (objects are content-addressed): the follower
    remembers it and reaches the version another way (bench/soak.py found it retrying the
    same plan forever); the bad object is never used again."""
    engine = engine_at(published, None)
    f = Follower(board, RUN, engine, FAST)
    key = step_objects(board, None, LAST, 0)[0]  # the newest keyframe's first object
    bad = bytearray(board.store.get(key))
    bad[len(bad) // 2] ^= 0x40
    board.store.put(key, bytes(bad), if_absent=False)
    assert f.sync() == LAST
    assert_holds(engine, published.views[LAST])
    assert key not in [o.key for s in (f.last_plan.steps if f.last_plan else ()) for o in s.objects]
    assert board.plan(RUN, None, LAST, avoid=frozenset({key})).steps != ()


class FlakyStore(Store):
    """Wraps a store; ``get`` of each key fails ``failures`` times before it works."""

    def __init__(self, inner: Store, failures: int) -> None:
        self.inner, self.failures, self.uri = inner, failures, f"flaky+{inner.uri}"
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def _get(self, key: str) -> bytes:
        with self._lock:
            n = self.calls[key] = self.calls.get(key, 0) + 1
        if n <= self.failures:
            raise TransientStoreError("simulated network failure", key=key)
        return self.inner.get(key)

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        return self.inner.get_range(key, start, end)

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        self.inner.put(key, data, if_absent=if_absent)

    def _list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def _delete(self, key: str) -> None:
        self.inner.delete(key)

    def _head(self, key: str) -> ObjectInfo | None:
        return self.inner.head(key)

    def _cas(self, key: str, data: bytes, *, expected: bytes | None) -> None:
        self.inner.cas(key, data, expected=expected)


def test_transient_store_failures_are_retried(board: Board, published: Published) -> None:
    flaky = Board(FlakyStore(board.store, failures=2))
    engine = engine_at(published, 7)
    f = Follower(flaky, RUN, engine, FAST)
    assert f.sync() == LAST
    assert_holds(engine, published.views[LAST])
    assert f.status().retries >= 2 * (1 + len(f.last_plan.steps))  # type: ignore[union-attr]

    hopeless = Board(FlakyStore(board.store, failures=FAST.retries + 1))
    g = Follower(hopeless, RUN, engine_at(published, 7), FAST)
    with pytest.raises(TransientStoreError):
        g.sync()
    assert g.status().state is FollowerState.ERROR and g.engine.version == 7


def test_engine_with_wrong_bits_reboots_from_keyframe(board: Board, published: Published) -> None:
    engine = engine_at(published, 19)
    engine.view["layers.0.w"].data[3] ^= 1  # behind the engine's back, digest recomputed
    engine.view.invalidate("layers.0.w")
    f = Follower(board, RUN, engine, FAST)
    assert f.sync() == LAST
    assert f.last_plan is not None and f.last_plan.steps[0].is_keyframe
    assert f.status().reboots == 1
    assert_holds(engine, published.views[LAST])


def test_stale_engine_digest_target_mismatch_rolls_back_then_reboots(
    board: Board, published: Published
) -> None:
    engine = engine_at(published, 19)
    change = diff(published.views[19], published.views[LAST])
    name, tp = next((n, t) for n, t in change.tensors.items() if t.op == "delta")
    pos = int(np.setdiff1d(np.arange(engine.view[name].data.size), tp.changes().positions)[0])
    engine.view[name].data[pos] ^= 1  # cached digests still claim version 19
    f = Follower(board, RUN, engine, FAST)
    commits: list[int] = []
    f.on_commit.append(lambda v, _: commits.append(v))
    assert f.sync() == LAST  # apply's target check failed and rolled back; keyframe reboot
    assert f.status().reboots == 1 and commits == [LAST]
    assert f.last_plan is not None and f.last_plan.steps[0].is_keyframe
    assert_holds(engine, published.views[LAST])


class NoOpEngine(ViewEngine):
    """A broken adapter: apply claims the version without changing any bits."""

    def apply(self, patch: Patch, version: int) -> None:
        self._version = version


def test_commit_not_matching_target_is_an_error(board: Board, published: Published) -> None:
    engine = NoOpEngine()
    engine.load(published.views[19].copy(), 19)
    f = Follower(board, RUN, engine, FAST)
    with pytest.raises(VerificationError, match="after the commit"):
        f.sync()
    st = f.status()
    assert st.state is FollowerState.ERROR and st.commits == 0
    assert st.version is None and f.version is None  # never the unverified version


class StalledStore(FlakyStore):
    """Object gets stall until ``release`` is set (a store that stops answering)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner, failures=0)
        self.release = threading.Event()
        self.started = self.finished = 0

    def _get(self, key: str) -> bytes:
        if "/objects/" in key:
            self.started += 1
            self.release.wait(60)
            self.finished += 1
        return super()._get(key)


def test_fetch_timeout(board: Board, published: Published) -> None:
    stalled = StalledStore(board.store)
    f = Follower(Board(stalled), RUN, engine_at(published, 19), FollowerConfig(timeout_s=0.1))
    try:
        with pytest.raises(TransientStoreError, match="timed out"):
            f.sync()
        # the stalled gets were abandoned, not awaited: none had returned when sync gave up
        assert stalled.started >= 1 and stalled.finished == 0
    finally:
        stalled.release.set()
    assert f.status().state is FollowerState.ERROR and f.version == 19


class LyingEngine(ViewEngine):
    """Reports a stale digest until its next load (an adapter with a cached, wrong digest)."""

    claim: str | None = None

    @property
    def digest(self) -> str | None:
        return self.claim if self.claim is not None else super().digest

    def load(self, view: View, version: int) -> None:
        self.claim = None
        super().load(view, version)


def test_base_mismatch_while_staging_reboots(board: Board, published: Published) -> None:
    engine = LyingEngine()
    engine.load(published.views[19].copy(), 19)
    engine.claim = published.views[19].digest()
    engine.view["layers.1.w"].data[0] ^= 1
    engine.view.invalidate()
    f = Follower(board, RUN, engine, FAST)
    assert f.sync() == LAST
    assert f.status().reboots == 1 and f.last_plan is not None
    assert f.last_plan.steps[0].is_keyframe
    assert_holds(engine, published.views[LAST])


def test_keyframe_failure_leaves_version_unknown(board: Board, published: Published) -> None:
    engine = engine_at(published, 19)
    engine.view["layers.0.w"].data[3] ^= 1
    engine.view.invalidate()
    f = Follower(board, RUN, engine, FAST)
    for key in step_objects(board, None, LAST, 0):
        board.store.delete(key)
    with pytest.raises(NotFoundError):
        f.sync()
    assert f.status().version is None  # bits known bad: no version is claimed
    assert f.status().state is FollowerState.ERROR


def test_bad_latest_is_refused_and_a_repaired_one_honoured(
    board: Board, published: Published
) -> None:
    from rollpatch.errors import VersionNotFoundError

    follower = Follower(board, RUN, ViewEngine(), FAST)
    set_latest(board, 10**12)  # no manifest: refused from the listing, no walk
    with pytest.raises(VersionNotFoundError):
        follower.sync()
    assert follower.status().latest == 10**12
    for raw in (b'{"run": "rl", "version": 1e400}', b"[" * 10_000, b'{"version": "7"}'):
        set_latest(board, raw)
        with pytest.raises(ManifestError, match="LATEST"):
            follower.sync()
    set_latest(board, 20)  # repaired (by hand: below the bad maximum)
    assert follower.sync() == 20 and follower.status().latest == 20
    # the background loop: a bad maximum is an ERROR, and it does not stick
    set_latest(board, 10**12)
    follower.start()
    try:
        until(lambda: follower.status().state is FollowerState.ERROR, "the bad LATEST")
        set_latest(board, LAST)
        until(lambda: follower.version == LAST, "the repaired LATEST")
        until(lambda: follower.status().state is FollowerState.IDLE, "recovery")
        assert follower.status().latest == LAST
    finally:
        follower.stop()
    assert follower.engine.digest == published.views[LAST].digest()


def test_latest_naming_another_target_than_its_manifest_is_refused(
    board: Board, published: Published
) -> None:
    """A manifest that is not the one LATEST points at (a relay caching an earlier run of the
    same name, a board edited by hand) is refused before anything is fetched: the engine
    keeps its version."""
    from rollpatch.board import pointer_key, version_key

    engine = engine_at(published, 19)
    follower = Follower(board, RUN, engine, FAST)
    other = published.views[LAST - 1].digest()
    raw = (
        f'{{"run": "{RUN}", "version": {LAST}, "manifest": "{version_key(RUN, LAST)}", '
        f'"target": "{other}"}}'
    ).encode()
    board.store.put(pointer_key(RUN), raw, if_absent=False)
    with pytest.raises(ManifestError, match="different target digests") as e:
        follower.sync()
    assert "clear the relay's cache" in str(e.value)
    st = follower.status()
    assert (engine.version, st.version, st.bytes_fetched) == (19, 19, 0)
    set_latest(board, LAST)  # repaired
    assert follower.sync() == LAST


def test_with_nothing_held_an_unreachable_newest_version_falls_back_to_an_older_one(
    board: Board, published: Published
) -> None:
    """Every object of the newest version corrupt (a relay serving a rotten copy): an engine
    that holds nothing used to stay at none, every request refused, though the versions
    before were whole (an audit's MEDIUM finding). It now serves the newest one it reaches,
    labelled as what it is, and moves on once the object is whole again. An engine that
    holds a version keeps it (the test above)."""
    engine = engine_at(published, None)
    f = Follower(board, RUN, engine, FAST)
    keys = [o.key for o in board.manifest(RUN, LAST).objects()]
    good = {k: board.store.get(k) for k in keys}
    for k in keys:
        bad = bytearray(good[k])
        bad[len(bad) // 2] ^= 0x40
        board.store.put(k, bytes(bad), if_absent=False)
    assert f.sync() == LAST - 1
    assert (engine.version, f.version) == (LAST - 1, LAST - 1)
    assert_holds(engine, published.views[LAST - 1])
    for k in keys:
        board.store.put(k, good[k], if_absent=False)  # repaired
    deadline = time.monotonic() + 30  # the remembered objects are re-checked on a backoff
    while True:
        try:
            assert f.sync() == LAST
            break
        except ObjectIntegrityError:
            assert time.monotonic() < deadline, "the repaired objects were never re-checked"
            time.sleep(0.2)
    assert_holds(engine, published.views[LAST])


def test_a_file_board_that_goes_away_is_an_outage_not_an_empty_board(
    published: Published, tmp_path: Path
) -> None:
    """A file:// board moved away (an unmounted NFS path): its reads answered "no such
    object", so the follower read "nothing published", forgot LATEST and counted no failure;
    a sidecar then served ``max_lag`` unchecked (an audit's MEDIUM finding, session 39). Now
    the missing store directory is a transient store error: the sync fails, LATEST stays the
    last one read (its age grows: max_lag is refused past --latest-max-age), and the follower
    moves on once the board is back."""
    from rollpatch.errors import TransientStoreError
    from rollpatch.store import FileStore

    root = tmp_path / "board"
    store = FileStore(root, fsync=False)
    for k in published.store.list(""):
        store.put(k, published.store.get(k))
    engine = engine_at(published, None)
    f = Follower(Board(store), RUN, engine, FAST)
    assert f.sync() == LAST
    root.rename(tmp_path / "away")
    with pytest.raises(TransientStoreError, match="store directory is gone"):
        store.get(pointer_key(RUN))
    with pytest.raises(TransientStoreError):
        f.sync()
    st = f.status()
    assert (st.latest, st.version, st.error_type) == (LAST, LAST, "TransientStoreError")
    assert st.failures >= 1
    (tmp_path / "away").rename(root)
    assert f.sync() == LAST and f.status().last_error is None
