"""bench/peers.py's rollpatch island under ``--island-commit fused``: a real Follower over a
real file board hands a one-step update over encoded, the island decodes it straight into its
live words (``apply_encoded``), bit for bit; chains fall back to the follower's decode; a
corrupt or foreign object leaves the held version's words and version untouched."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from _peers_island import ENGINES

from rollpatch.board import Board
from rollpatch.engines.staged import EncodedStep
from rollpatch.errors import BaseMismatchError, PatchDecodeError
from rollpatch.follower import Follower, FollowerConfig
from rollpatch.formats import cast_view
from rollpatch.patch import encode_views
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.store import open_store

RUN = "r"


def _masters(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    m = {f"layer{i}.w": rng.standard_normal((96, 130)).astype(np.float32) for i in range(4)}
    out = [m]
    for _ in range(n):
        m = {
            k: v + np.float32(3e-3) * rng.standard_normal(v.shape).astype(np.float32)
            for k, v in m.items()
        }
        out.append(m)
    return out


class _Counting:
    """Counts how often the engine was handed an encoded step and took it."""

    def __init__(self, engine: object) -> None:
        self.engine, self.taken, self.declined = engine, 0, 0
        inner = engine.stage_encoded  # type: ignore[attr-defined]

        def stage_encoded(steps: object, version: int) -> object:
            out = inner(steps, version)
            self.taken += out is not None
            self.declined += out is None
            return out

        engine.stage_encoded = stage_encoded  # type: ignore[attr-defined]


def test_fused_island_follows_bit_exact_and_chains_fall_back(tmp_path: Path) -> None:
    masters = _masters(4)
    uri = f"file://{tmp_path / 'board'}"
    with Publisher(uri, RUN, PublisherConfig(format="bf16")) as pub:
        for v, m in enumerate(masters):
            pub.publish(m, v)
            pub.flush()  # one at a time: a waiting snapshot may be dropped
    engine = ENGINES["fused"]()
    engine.load(cast_view(masters[0], "bf16"), 0)
    count = _Counting(engine)
    follower = Follower(Board(open_store(uri)), RUN, engine, FollowerConfig(timeout_s=60.0))
    assert follower.sync(1) == 1
    assert count.taken == 1  # decoded in place, not by the follower
    assert engine.view.digest() == cast_view(masters[1], "bf16").digest()
    assert follower.sync(4) == 4  # a chain 1 -> 4: the engine declines, the follower decodes
    assert count.declined == 1
    fresh = cast_view(masters[4], "bf16")
    for name, t in fresh.items():  # every word, not only the cached digests
        assert np.array_equal(engine.view[name].data, t.data)
    assert engine.version == 4


def test_fused_island_refuses_corrupt_and_foreign_objects() -> None:
    a, b, c = (cast_view(m, "bf16") for m in _masters(2))
    engine = ENGINES["fused"]()
    engine.load(a.copy(), 0)
    before = {k: t.data.copy() for k, t in engine.view.items()}
    blob = encode_views(a, b)
    bad = bytearray(blob)
    bad[-5] ^= 0x40  # inside the last tensor's payload
    staged = engine.stage_encoded([EncodedStep((bytes(bad),), a.digest(), b.digest())], 1)
    with pytest.raises(PatchDecodeError, match="checksum"):
        engine.commit_staged(staged, 1)
    assert engine.version == 0
    for k, t in engine.view.items():
        assert np.array_equal(t.data, before[k])
    foreign = encode_views(b, c)  # starts at another version
    with pytest.raises(BaseMismatchError):
        engine.stage_encoded([EncodedStep((foreign,), b.digest(), c.digest())], 2)
    staged = engine.stage_encoded([EncodedStep((blob,), a.digest(), b.digest())], 1)
    engine.commit_staged(staged, 1)
    assert engine.version == 1 and engine.view.digest() == b.digest()
