"""The follower tests' world: one published board, built with Board.put_object /
put_manifest / advance directly (the publisher is a separate module): a keyframe at 0, step
patches, skip patches 4→8 and 8→12, a 2-shard version 20 (patches + keyframe), a 2-shard
patch-only version 21, then plain steps to 23; and a signed board to 5.

The test_follower*.py modules import its fixtures (``published``, ``signed``, ``board``) by
name, as tests.conftest_s3's are imported.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.engines import ViewEngine
from rollpatch.errors import RollpatchError
from rollpatch.follower import FollowerConfig
from rollpatch.io import view_to_bytes
from rollpatch.kinds import KINDS
from rollpatch.manifest import KeyframeObject, PatchObject
from rollpatch.patch import diff, encode
from rollpatch.store import MemoryStore
from rollpatch.trust import Root, Signer, SigningKey, sign_root
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


def first_view(rng: np.random.Generator) -> View:
    t = {}
    for i in range(6):
        w = (rng.standard_normal(4096) * 0.02).astype(np.float32)
        t[f"layers.{i}.w"] = Tensor(
            KINDS["bf16"], (32, 128), (w.view(np.uint32) >> 16).astype(np.uint16)
        )
    t["layers.q"] = Tensor(KINDS["e4m3"], (64, 64), rng.integers(0, 120, 4096, dtype=np.uint8))
    t["layers.p"] = Tensor(KINDS["e2m1x2"], (16, 64), rng.integers(0, 256, 1024, dtype=np.uint8))
    return View(t)


def next_view(rng: np.random.Generator, prev: View) -> View:
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
    pub.views[0] = first_view(rng)
    publish(board, 0, pub.views, bases=(), keyframe=True)
    for v in range(1, last + 1):
        pub.views[v] = next_view(rng, pub.views[v - 1])
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


def copy_board(pub: Published) -> Board:
    """A private, mutable copy of a published board (tests damage objects)."""
    dst = MemoryStore(f"follower-{uuid.uuid4().hex}")
    for k in pub.store.list(""):
        dst.put(k, pub.store.get(k))
    return Board(dst)


@pytest.fixture
def board(published: Published) -> Board:
    return copy_board(published)


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


def step_objects(board: Board, have: int | None, want: int, step: int) -> list[str]:
    return [o.key for o in board.plan(RUN, have, want).steps[step].objects]


def set_latest(board: Board, raw: bytes | int) -> None:
    from rollpatch.board import pointer_key, version_key

    if isinstance(raw, int):  # the version's own target (followers check it), if it has one
        try:
            target = board.manifest(RUN, raw).target
        except RollpatchError:
            target = "a" * 64
        raw = (
            f'{{"run": "{RUN}", "version": {raw}, "manifest": "{version_key(RUN, raw)}", '
            f'"target": "{target}"}}'
        ).encode()
    board.store.put(pointer_key(RUN), raw, if_absent=False)
