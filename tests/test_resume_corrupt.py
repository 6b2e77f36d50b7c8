"""A publisher resuming over corrupt objects (an attacker or a bad disk overwrote them on the
store; re-putting identical bytes is a no-op, so they stay corrupt): the rebuild plans around
them, and when no sound path is left, the next version starts a new lineage from a keyframe.
Found by bench/soak.py: a publisher restarted after its `corrupt` fault never published again,
and the fleet never moved."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from rollpatch import avoid
from rollpatch.board import Board
from rollpatch.engines.view_engine import ViewEngine
from rollpatch.errors import ObjectIntegrityError
from rollpatch.follower import Follower, FollowerConfig
from rollpatch.formats import cast_view
from rollpatch.publisher import Publisher, PublisherConfig, reconstruct
from rollpatch.publisher.keyframe import reconstruct_shard
from rollpatch.view import View

RUN = "r1"
FAST = FollowerConfig(poll_s=0.01, backoff_s=0.001, retries=2, timeout_s=10.0)


def _masters(v: int) -> dict[str, np.ndarray]:
    """The trainer's weights at version ``v`` (only the first tensor moves)."""
    rng = np.random.default_rng(0)
    out = {
        f"layers.{i}.w": (rng.standard_normal((32, 64)) * 0.02).astype(np.float32) for i in range(3)
    }
    out["layers.0.w"] += (1e-3 * np.random.default_rng(100 + v).standard_normal((32, 64))).astype(
        np.float32
    )
    return out


def _served(v: int) -> View:
    return cast_view(_masters(v), "bf16")


def _publish(board: Board, versions: range, config: PublisherConfig) -> None:
    """A publisher that publishes ``versions`` and stops (the next one resumes: one publisher
    per run, publisher/lease.py)."""
    with Publisher(board, RUN, config, asynchronous=False) as pub:
        for v in versions:
            pub.publish(_masters(v), version=v)


def _corrupt(board: Board, version: int, *, keyframe: bool, patches: bool) -> list[str]:
    """Overwrite (same size, bypassing put-if-absent) the chosen objects of ``version``."""
    m = board.manifest(RUN, version)
    refs = [k.ref for k in m.keyframes] if keyframe else []
    refs += [p.ref for p in m.patches] if patches else []
    for ref in refs:
        board.store.put(ref.key, b"\x5a" * ref.size, if_absent=False)
    return [r.key for r in refs]


def test_reconstruct_plans_around_a_corrupt_keyframe(memory_board: Board) -> None:
    """The newest keyframe is corrupt: the rebuild goes from the older keyframe through
    the patches, bit-exact."""
    _publish(memory_board, range(14), PublisherConfig(keyframe_every=5, skip_strides=()))
    bad = _corrupt(memory_board, 10, keyframe=True, patches=False)
    view = reconstruct(memory_board, RUN, 13)
    assert view.digest() == _served(13).digest()
    with pytest.raises(ObjectIntegrityError) as e:  # the object really is corrupt
        memory_board.fetch(memory_board.manifest(RUN, 10).keyframes[0].ref)
    assert e.value.context["key"] == bad[0]


def test_reconstruct_shard_falls_back_when_an_object_is_corrupt(memory_board: Board) -> None:
    _publish(memory_board, range(4), PublisherConfig(keyframe_every=10, skip_strides=()))
    _corrupt(memory_board, 0, keyframe=True, patches=False)
    assert reconstruct_shard(memory_board, RUN, 3, 0, 1) is None


def test_a_resume_with_no_sound_path_publishes_a_keyframe_with_no_parent(
    memory_board: Board, caplog: pytest.LogCaptureFixture
) -> None:
    """The newest keyframe and the newest patches are corrupt (what the soak's fault does):
    the restarted publisher cannot rebuild LATEST, says so, and publishes the next version as a
    keyframe with no parent; followers behind and from nothing reach it, verified."""
    config = PublisherConfig(keyframe_every=10, skip_strides=(8,))
    _publish(memory_board, range(14), config)
    held = {v: ViewEngine() for v in (9, 11, 12)}
    followers = {v: Follower(memory_board, RUN, e, FAST) for v, e in held.items()}
    for v, f in followers.items():
        assert f.sync(v) == v
    _corrupt(memory_board, 10, keyframe=True, patches=True)
    for v in (12, 13):
        _corrupt(memory_board, v, keyframe=False, patches=True)
    with pytest.raises(ObjectIntegrityError):
        reconstruct(memory_board, RUN, 13)

    with caplog.at_level(logging.WARNING, logger="rollpatch.publisher"):
        pub = Publisher(memory_board, RUN, config, asynchronous=False)
        assert pub.last_durable == 13
        assert pub.publish(_masters(14), version=14) == 14
    assert pub.resume_scope == "keyframe"
    assert any("cannot rebuild version 13" in r.getMessage() for r in caplog.records)
    m = memory_board.manifest(RUN, 14)
    assert m.parent is None and m.keyframes and not m.patches
    assert pub.publish(_masters(15), version=15) == 15  # the lineage goes on with patches
    assert memory_board.manifest(RUN, 15).parent == 14
    assert memory_board.manifest(RUN, 15).patches

    for v, f in followers.items():
        assert f.sync() == 15, v
        assert held[v].view.digest() == _served(15).digest()
    boot = ViewEngine()
    assert Follower(memory_board, RUN, boot, FAST).sync() == 15
    assert boot.view.digest() == _served(15).digest()
    assert reconstruct(memory_board, RUN, 15).digest() == _served(15).digest()


def test_followers_that_met_the_corruption_reach_the_new_lineage(
    memory_board: Board, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The soak's ``corrupt`` fault as the islands see it: they try to sync while the newest
    keyframe and patches are corrupt and no sound path exists (each attempt refused, the
    objects remembered and not downloaded again on every sync: avoid.BadObjects' backoff),
    then the restarted publisher's keyframe with no parent appears; the next sync reaches it
    at once, verified."""
    config = PublisherConfig(keyframe_every=10, skip_strides=(8,))
    _publish(memory_board, range(14), config)
    held = {v: ViewEngine() for v in (9, 11, 12)}
    followers = {v: Follower(memory_board, RUN, e, FAST) for v, e in held.items()}
    for v, f in followers.items():
        assert f.sync(v) == v
    bad = set(_corrupt(memory_board, 10, keyframe=True, patches=True))
    for v in (12, 13):
        bad |= set(_corrupt(memory_board, v, keyframe=False, patches=True))
    gets: list[str] = []
    real_get = memory_board.store.get

    def counting_get(key: str, **bounds: int) -> bytes:
        gets.append(key)
        return real_get(key, **bounds)

    monkeypatch.setattr(memory_board.store, "get", counting_get)
    monkeypatch.setattr(avoid, "time", SimpleNamespace(monotonic=lambda: 1000.0))  # frozen
    for f in followers.values():
        for _ in range(2):  # meets the corrupt objects; re-checks them (due at once)
            with pytest.raises(ObjectIntegrityError):
                f.sync()
        before = len(gets)
        for _ in range(3):  # the next re-check is due a second later: no download meanwhile
            with pytest.raises(ObjectIntegrityError) as e:
                f.sync()
            assert e.value.context["avoiding"]
        assert not bad & set(gets[before:])
    assert bad & set(gets)
    pub = Publisher(memory_board, RUN, config, asynchronous=False)
    assert pub.publish(_masters(14), version=14) == 14 and pub.resume_scope == "keyframe"
    assert pub.publish(_masters(15), version=15) == 15
    for v, f in followers.items():
        assert f.sync() == 15, v
        assert held[v].view.digest() == _served(15).digest()
