"""The follower: catch-up bit for bit, keyframes, skips, shards, self-healing, signatures, CLI.

Boards are built here directly with Board.put_object / put_manifest / advance (the publisher
is a separate module): a keyframe at 0, step patches, skip patches 4→8 and 8→12, a 2-shard
version 20 (patches + keyframe), a 2-shard patch-only version 21, then plain steps to 23.
"""

from __future__ import annotations

import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.cli import main
from rollpatch.engines import ViewEngine
from rollpatch.errors import (
    BaseMismatchError,
    ConfigError,
    ManifestError,
    NoPathError,
    NotFoundError,
    ObjectIntegrityError,
    TransientStoreError,
    VerificationError,
)
from rollpatch.follower import Follower, FollowerConfig, FollowerState
from rollpatch.io import load_view, view_to_bytes
from rollpatch.kinds import KINDS
from rollpatch.manifest import KeyframeObject, PatchObject
from rollpatch.patch import Patch, compose, decode, diff, encode
from rollpatch.patch.overlay import Overlay
from rollpatch.store import MemoryStore, ObjectInfo, Store
from rollpatch.trust import Root, Signer, SigningKey, Trust, sign_root
from rollpatch.view import Tensor, View
from tests.conftest import make_manifest

RUN = "rl"
KEY = SigningKey.generate()
ROOT = sign_root(Root.new([KEY.public]), [KEY])
LAST = 23
SHARDED = {20: True, 21: False}  # version -> has a (sharded) keyframe
SKIPS = {8: 4, 12: 8}  # version -> skip-patch base
FAST = FollowerConfig(poll_s=0.01, backoff_s=0.001, retries=3, timeout_s=10.0)


# -- publishing helper ---------------------------------------------------------------------


def _first_view(rng: np.random.Generator) -> View:
    t = {}
    for i in range(6):
        w = (rng.standard_normal(4096) * 0.02).astype(np.float32)
        t[f"layers.{i}.w"] = Tensor(
            KINDS["bf16"], (32, 128), (w.view(np.uint32) >> 16).astype(np.uint16)
        )
    t["layers.q"] = Tensor(KINDS["e4m3"], (64, 64), rng.integers(0, 120, 4096, dtype=np.uint8))
    t["layers.p"] = Tensor(KINDS["e2m1x2"], (16, 64), rng.integers(0, 256, 1024, dtype=np.uint8))
    return View(t)


def _next_view(rng: np.random.Generator, prev: View) -> View:
    out = {}
    for name, t in prev.items():
        data = t.data.copy()
        if rng.random() < 0.7:  # some tensors do not change in a step
            idx = rng.choice(data.size, size=max(1, data.size // 200), replace=False)
            data[idx] ^= np.asarray(0x11 if t.kind.packed else 1, dtype=data.dtype)
        out[name] = Tensor(t.kind, t.shape, data)
    return View(out)


def _shards(view: View, n: int) -> list[View]:
    names = sorted(view)
    return [View({k: view[k] for k in names[s::n]}) for s in range(n)]


def publish(
    board: Board,
    version: int,
    views: dict[int, View],
    *,
    bases: tuple[int, ...],
    keyframe: bool,
    shards: int = 1,
) -> None:
    """Publish ``views[version]``: patches from each of ``bases`` and/or a keyframe."""
    view = views[version]
    patches, kfs = [], []
    for b in bases:
        for s, (sb, st) in enumerate(zip(_shards(views[b], shards), _shards(view, shards))):
            blob = encode(diff(sb, st), sb)
            patches.append(
                PatchObject(board.put_object(RUN, blob, "rpatch"), b, views[b].digest(), s)
            )
    if keyframe:
        for s, part in enumerate(_shards(view, shards)):
            ref = board.put_object(RUN, view_to_bytes(part), "safetensors")
            kfs.append(KeyframeObject(ref, s))
    m = make_manifest(
        RUN,
        version,
        target=view.digest(),
        view_bytes=view.nbytes,
        patches=tuple(patches),
        keyframes=tuple(kfs),
        shards=shards,
    )
    board.put_manifest(m)
    board.advance(RUN, version)


@dataclass
class Published:
    store: MemoryStore
    views: dict[int, View] = field(default_factory=dict)


def _build(last: int, key: SigningKey | None, seed: int) -> Published:
    rng = np.random.default_rng(seed)
    pub = Published(MemoryStore(f"follower-{uuid.uuid4().hex}"))
    board = Board(pub.store, signer=None if key is None else Signer(keys=(key,)))
    pub.views[0] = _first_view(rng)
    publish(board, 0, pub.views, bases=(), keyframe=True)
    for v in range(1, last + 1):
        pub.views[v] = _next_view(rng, pub.views[v - 1])
        bases = (v - 1, SKIPS[v]) if v in SKIPS else (v - 1,)
        publish(
            board,
            v,
            pub.views,
            bases=bases,
            keyframe=SHARDED.get(v, False),
            shards=2 if v in SHARDED else 1,
        )
    return pub


@pytest.fixture(scope="module")
def published() -> Published:
    return _build(LAST, None, 0)


@pytest.fixture(scope="module")
def signed() -> Published:
    return _build(5, KEY, 1)


def _copy(pub: Published) -> Board:
    """A private, mutable copy of a published board (tests damage objects)."""
    dst = MemoryStore(f"follower-{uuid.uuid4().hex}")
    for k in pub.store.list(""):
        dst.put(k, pub.store.get(k))
    return Board(dst)


@pytest.fixture
def board(published: Published) -> Board:
    return _copy(published)


def engine_at(pub: Published, v: int | None) -> ViewEngine:
    e = ViewEngine()
    if v is not None:
        e.load(pub.views[v].copy(), v)
    return e


def assert_holds(engine: ViewEngine, view: View) -> None:
    held = engine.view
    assert sorted(held) == sorted(view)
    for name in view:
        assert held[name].kind == view[name].kind and held[name].shape == view[name].shape
        assert np.array_equal(held[name].data, view[name].data), name
    held.invalidate()
    assert held.digest() == view.digest()


def _step_objects(board: Board, have: int | None, want: int, step: int) -> list[str]:
    return [o.key for o in board.plan(RUN, have, want).steps[step].objects]


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
        views[LAST + 1] = _next_view(np.random.default_rng(9), views[LAST])
        publish(board, LAST + 1, views, bases=(LAST,), keyframe=False)
        assert f.wait_for(LAST + 1, timeout=20)
        assert_holds(engine, views[LAST + 1])
        assert not f.wait_for(LAST + 2, timeout=0.05)
    finally:
        f.stop()
    assert seen == [LAST, LAST + 1]
    assert not f._watcher.alive and f.status().state is FollowerState.IDLE


# -- self-healing --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "damage,error",
    [("flip", ObjectIntegrityError), ("truncate", ObjectIntegrityError), ("delete", NotFoundError)],
)
def test_damaged_object_refused_then_recovered(
    board: Board, published: Published, damage: str, error: type
) -> None:
    engine = engine_at(published, 19)
    f = Follower(board, RUN, engine, FAST)
    key = _step_objects(board, 19, LAST, 1)[0]
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
    key = _step_objects(board, None, LAST, 0)[0]  # the newest keyframe's first object
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
    for key in _step_objects(board, None, LAST, 0):
        board.store.delete(key)
    with pytest.raises(NotFoundError):
        f.sync()
    assert f.status().version is None  # bits known bad: no version is claimed
    assert f.status().state is FollowerState.ERROR


# -- signatures, limits, config ------------------------------------------------------------


def test_signature_required_and_checked(signed: Published, published: Published) -> None:
    ok = Follower(_copy(signed), RUN, ViewEngine(), trust=Trust(ROOT))
    assert ok.sync() == 5
    assert_holds(ok.engine, signed.views[5])  # type: ignore[arg-type]
    other = SigningKey.generate()
    wrong = sign_root(Root.new([other.public]), [other])
    for pub, root, msg in [(signed, wrong, "valid signature"), (published, ROOT, "not signed")]:
        engine = ViewEngine()
        f = Follower(_copy(pub), RUN, engine, trust=Trust(root))
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


# -- overlay and memory --------------------------------------------------------------------


def test_overlay_copies_only_touched_tensors(published: Published) -> None:
    views = published.views
    v = next(
        i for i in range(LAST - 1) if len(diff(views[i], views[i + 1]).tensors) < len(views[i])
    )
    v0, v1, v2 = views[v], views[v + 1], views[v + 2]
    p1 = diff(v0, v1)
    ov = Overlay(v0, p1)
    untouched = next(n for n in v0 if n not in p1.tensors)
    assert ov[untouched] is v0[untouched]
    assert ov.copied_tensors == 0
    touched = next(iter(p1.tensors))
    before = v0[touched].data.copy()
    got = ov[touched]
    assert got is not v0[touched] and np.array_equal(got.data, v1[touched].data)
    assert (ov.copied_tensors, ov.copied_bytes) == (1, v0[touched].nbytes)
    assert np.array_equal(v0[touched].data, before)  # the base is never written
    # decoding step 2 against the overlay equals decoding it against the materialised view
    blob = encode(diff(v1, v2), v1)
    ov = Overlay(v0, p1)
    step = decode(blob, ov, check_base=False)
    assert step.equals(decode(blob, v1))
    both = set(p1.tensors) & set(step.tensors)
    assert ov.copied_tensors == len(both)
    assert ov.copied_bytes == sum(v0[n].nbytes for n in both) < v0.nbytes
    assert compose(p1, step).equals(diff(v0, v2))


def test_overlay_drop_full_and_wrong_base() -> None:
    a = View(
        {
            "x": Tensor.from_array(np.arange(8, dtype=np.uint16), "u16"),
            "y": Tensor.from_array(np.arange(4, dtype=np.uint16), "u16"),
        }
    )
    b = View(
        {
            "x": Tensor.from_array(np.arange(8, dtype=np.uint16) + 1, "u16"),
            "z": Tensor.from_array(np.arange(3, dtype=np.uint32), "u32"),
        }
    )
    ov = Overlay(a, diff(a, b))
    assert "y" not in ov and "z" in ov and ov["z"].shape == (3,)
    with pytest.raises(KeyError):
        ov["y"]
    wrong = a.copy()
    wrong["x"].data[0] = 99
    with pytest.raises(BaseMismatchError):
        Overlay(wrong, diff(a, b))["x"]


class TrackingOverlay(Overlay):
    """Records every tensor an overlay lends, whether it was a copy, and peak live copies."""

    live = 0
    peak = 0
    lent: ClassVar[list[tuple[str, bool, bool]]] = []  # (name, copied, touched by the patch)
    lock = threading.Lock()

    def __getitem__(self, name: str) -> Tensor:
        t = super().__getitem__(name)
        copied = name in self.base and t is not self.base[name]
        cls = TrackingOverlay
        with cls.lock:
            cls.lent.append((name, copied, name in self.patch.tensors))
            if copied:
                cls.live += 1
                cls.peak = max(cls.peak, cls.live)
        if copied:
            weakref.finalize(t, cls._release)
        return t

    @staticmethod
    def _release() -> None:
        with TrackingOverlay.lock:
            TrackingOverlay.live -= 1


def test_catch_up_holds_patches_not_a_model_copy(
    board: Board, published: Published, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollpatch.follower import stage

    monkeypatch.setattr(stage, "Overlay", TrackingOverlay)
    TrackingOverlay.lent = []
    engine = engine_at(published, 4)
    f = Follower(board, RUN, engine, FAST)
    assert f.sync(19) == 19
    assert_holds(engine, published.views[19])
    lent = TrackingOverlay.lent
    assert any(copied for _, copied, _ in lent)
    assert all(touched for _, copied, touched in lent if copied)  # untouched: never copied
    assert TrackingOverlay.live == 0
    # the decoder's pool (4 threads) holds at most one lent tensor each
    assert TrackingOverlay.peak <= 4 < len(published.views[4])


# -- CLI -----------------------------------------------------------------------------------


def test_cli_pull_round_trip(board: Board, published: Published, tmp_path, capsys) -> None:
    uri = board.store.uri
    out = tmp_path / "v.safetensors"
    assert main(["pull", "--board", uri, "--run", RUN, "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "plan rl" in text and "keyframe 20" in text and "(verified)" in text
    got = load_view(out)
    assert got.digest() == published.views[LAST].digest()
    assert main(["pull", "--board", uri, "--run", RUN, "--version", "8", "-o", str(out)]) == 0
    assert load_view(out).digest() == published.views[8].digest()


def test_cli_pull_refuses_with_exit_2(board: Board, tmp_path, capsys) -> None:
    for k in board.keyframes(RUN):  # every keyframe corrupt: no way around
        for obj in board.manifest(RUN, k).keyframes:
            data = bytearray(board.store.get(obj.ref.key))
            data[-1] ^= 1
            board.store.put(obj.ref.key, bytes(data), if_absent=False)
    out = tmp_path / "v.safetensors"
    code = main(
        ["pull", "--board", board.store.uri, "--run", RUN, "--retries", "0", "-o", str(out)]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not out.exists()
    # one line per corrupt object it planned around (warnings), then the error, no traceback
    assert err[-1].startswith("rollpatch: error:") and "corrupt" in err[-1]
    assert all("corrupt; planning around it" in line for line in err[:-1])
    assert not any("Traceback" in line for line in err)


# -- a bad LATEST (issue 11) ---------------------------------------------------------------------


def _set_latest(board: Board, raw: bytes | int) -> None:
    from rollpatch.board import pointer_key, version_key

    if isinstance(raw, int):
        raw = (
            f'{{"run": "{RUN}", "version": {raw}, "manifest": "{version_key(RUN, raw)}", '
            f'"target": "{"a" * 64}"}}'
        ).encode()
    board.store.put(pointer_key(RUN), raw, if_absent=False)


def _until(cond: object, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_bad_latest_is_refused_and_a_repaired_one_honoured(
    board: Board, published: Published
) -> None:
    from rollpatch.errors import VersionNotFoundError

    follower = Follower(board, RUN, ViewEngine(), FAST)
    _set_latest(board, 10**12)  # no manifest: refused from the listing, no walk
    with pytest.raises(VersionNotFoundError):
        follower.sync()
    assert follower.status().latest == 10**12
    for raw in (b'{"run": "rl", "version": 1e400}', b"[" * 10_000, b'{"version": "7"}'):
        _set_latest(board, raw)
        with pytest.raises(ManifestError, match="LATEST"):
            follower.sync()
    _set_latest(board, 20)  # repaired (by hand: below the bad maximum)
    assert follower.sync() == 20 and follower.status().latest == 20
    # the background loop: a bad maximum is an ERROR, and it does not stick
    _set_latest(board, 10**12)
    follower.start()
    try:
        _until(lambda: follower.status().state is FollowerState.ERROR, "the bad LATEST")
        _set_latest(board, LAST)
        _until(lambda: follower.version == LAST, "the repaired LATEST")
        _until(lambda: follower.status().state is FollowerState.IDLE, "recovery")
        assert follower.status().latest == LAST
    finally:
        follower.stop()
    assert follower.engine.digest == published.views[LAST].digest()


def test_cli_pull_bad_latest_exits_2_with_one_line(board: Board, tmp_path, capsys) -> None:
    out = tmp_path / "v.safetensors"
    for raw in (10**12, b'{"run": "rl", "version": 1e400}', b"[" * 100_000):
        _set_latest(board, raw)
        code = main(["pull", "--board", board.store.uri, "--run", RUN, "-o", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and not out.exists()
        assert len(err) == 1 and err[0].startswith("rollpatch: error:"), err
