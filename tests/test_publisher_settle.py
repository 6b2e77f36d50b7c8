"""The worker composes a version's step patch into the skip accumulators after LATEST moved
(``core.SETTLE_AFTER_S`` later, or first thing in the next build), not in the moments readers
decode the version. Whenever it happens, the skip patches and every other object must be the
bytes a synchronous publisher (which composes at once) writes."""

from __future__ import annotations

import time
import uuid

import pytest

from rollpatch.board import Board
from rollpatch.publisher import Publisher, PublisherConfig, core
from rollpatch.store import MemoryStore
from tests.pubfix import RUN, check_all, copy_masters, nudge, random_masters


def _wait(cond: object) -> None:
    deadline = time.monotonic() + 60
    while not cond() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.01)
    assert cond(), "not within 60 s"  # type: ignore[operator]


def _objects(name: str, versions: int) -> dict[tuple[int, int], bytes]:
    board = Board(f"memory://{name}")
    return {
        (v, p.base): board.store.get(p.ref.key)
        for v in range(versions)
        for p in board.manifest(RUN, v).patches
    }


def _run(name: str, *, asynchronous: bool, wait_settled: bool) -> dict[int, dict]:
    masters = random_masters(21, n=3)
    expected = {}
    cfg = PublisherConfig(format="bf16", skip_strides=(4, 8))
    with Publisher(f"memory://{name}", RUN, cfg, asynchronous=asynchronous) as pub:
        for v in range(13):
            pub.publish(masters, v)
            expected[v] = copy_masters(masters)
            pub.flush()
            if wait_settled:
                _wait(lambda: not pub._writer.pipe.unsettled)
            nudge(masters, v, lr=1e-4)
    return expected


@pytest.mark.parametrize("after_s", [0.0, 3600.0], ids=["settled-after-latest", "in-next-build"])
def test_deferred_compose_writes_the_same_skip_patches(
    after_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(core, "SETTLE_AFTER_S", after_s)
    a, b = f"settle-{uuid.uuid4().hex[:10]}", f"settle-{uuid.uuid4().hex[:10]}"
    try:
        expected = _run(a, asynchronous=True, wait_settled=after_s == 0.0)
        _run(b, asynchronous=False, wait_settled=False)
        got, want = _objects(a, 13), _objects(b, 13)
        assert {(8, 0), (8, 4), (12, 8), (4, 0)} <= set(got)  # skip patches of both strides
        assert got.keys() == want.keys()
        for key, blob in got.items():
            assert blob == want[key], key
        check_all(Board(f"memory://{a}"), expected)
    finally:
        MemoryStore.reset(a)
        MemoryStore.reset(b)


def test_a_failing_settle_stops_the_publisher(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error while composing is kept and raised like a publish's, never lost."""
    monkeypatch.setattr(core, "SETTLE_AFTER_S", 0.0)
    name = f"settle-{uuid.uuid4().hex[:10]}"
    masters = random_masters(22, n=2)
    pub = Publisher(f"memory://{name}", RUN, PublisherConfig(format="bf16"))
    try:
        pub.publish(masters, 0)
        pub.flush()
        _wait(lambda: not pub._writer.pipe.unsettled)
        nudge(masters, 0, lr=1e-4)

        def boom(*args: object) -> None:
            raise RuntimeError("compose failed")

        monkeypatch.setattr(pub._writer.pipe, "_advance_accumulators", boom)
        pub.publish(masters, 1)  # not a skip version: its step is composed after LATEST
        _wait(lambda: pub._error is not None)
        assert pub.board.latest(RUN).version == 1  # the version itself was published
        with pytest.raises(RuntimeError, match="compose failed"):
            pub.flush()
        with pytest.raises(RuntimeError, match="compose failed"):
            pub.publish(masters, 2)
    finally:
        pub.close()  # flush() raised the error: close does not raise it again
        MemoryStore.reset(name)
