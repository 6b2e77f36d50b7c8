"""A follower whose cached manifests no longer describe the board (audit I, session 42): the
run deleted and published again under its name (or versions replaced after a key rotation)
left the follower in ERROR for ever on the earlier run's bits, reporting their version. Now it
re-reads the manifests, finds its bits are not the board's version, and boots from a keyframe."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.engines import ViewEngine
from rollpatch.follower import Follower, FollowerConfig
from rollpatch.formats import cast_view
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.store import MemoryStore

RUN = "r"


def _publish(store: MemoryStore, seed: int, n: int) -> list[str]:
    rng = np.random.default_rng(seed)
    w = {"a.weight": rng.standard_normal((64, 64)).astype(np.float32)}
    digests = []
    with Publisher(Board(store), RUN, PublisherConfig(skip_strides=()), asynchronous=False) as p:
        for _ in range(n):
            w["a.weight"] += (rng.standard_normal((64, 64)) * 1e-3).astype(np.float32)
            p.publish(w)
            digests.append(cast_view(w, "bf16").digest())
    return digests


def test_a_follower_on_a_run_published_again_boots_from_a_keyframe(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore("lineage")
    first = _publish(store, 1, 8)
    f = Follower(Board(store), RUN, ViewEngine(), FollowerConfig(retries=0, backoff_s=0.0))
    assert f.sync() == 7 and f.engine.digest == first[7]
    for key in store.list(f"runs/{RUN}/"):
        store.delete(key)
    second = _publish(store, 2, 11)
    with caplog.at_level(logging.WARNING, logger="rollpatch.follower"):
        assert f.sync() == 10
    assert f.engine.digest == second[10] != first[7]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "is not the one this follower verified" in said and "booting from a keyframe" in said
    assert f.status().reboots >= 1
