"""The follower's fetch workers are kept from one fetch to the next (FetchPool): no thread is
started on the way to each new version, and a failed fetch, which may leave a store call
running in a worker, drops them so the next fetch starts from fresh ones."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest

from rollpatch.board import Board
from rollpatch.errors import NotFoundError
from rollpatch.follower import Follower, FollowerConfig
from rollpatch.follower.fetch import FetchPool, Retrier, fetch_objects
from rollpatch.store import MemoryStore
from rollpatch.types import ObjectRef
from tests.followfix import (
    FAST,
    RUN,
    SHARDED,
    Published,
    assert_holds,
    engine_at,
    published,
)

_FIXTURES = (published,)  # used by name


class ThreadsStore(MemoryStore):
    """A memory store that records the thread (the object, kept alive: never confused with
    a later thread that reuses an ident) of every object read."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.readers: list[threading.Thread] = []

    def _get(self, key: str) -> bytes:
        if "/objects/" in key:
            self.readers.append(threading.current_thread())
        return super()._get(key)


@pytest.fixture
def store() -> Iterator[ThreadsStore]:
    name = f"fp-{uuid.uuid4().hex[:10]}"
    yield ThreadsStore(name)
    MemoryStore.reset(name)


def _fetch(board: Board, refs: list[ObjectRef], workers: FetchPool | None) -> dict[str, bytes]:
    cfg = FollowerConfig(retries=1, backoff_s=0.001, timeout_s=5.0)
    return fetch_objects(
        board,
        refs,
        Retrier(cfg, threading.Event(), lambda e: None),
        lambda r: None,
        workers=workers,
    )


def test_fetches_with_a_pool_reuse_its_worker(store: ThreadsStore) -> None:
    b = Board(store)
    refs = [b.put_object(RUN, f"object {i}".encode() * 100, "rpatch") for i in range(4)]
    pool = FetchPool(2)
    for ref in refs:  # one object per fetch, as a follower one version behind
        assert _fetch(b, [ref], pool) == {ref.key: f"object {refs.index(ref)}".encode() * 100}
    assert len(set(store.readers)) == 1  # the same worker every time
    store.readers.clear()
    for ref in refs:
        _fetch(b, [ref], None)
    assert len(set(store.readers)) == len(refs)  # a pool of its own: a new thread each
    got = _fetch(b, refs, pool)  # several objects: up to `workers` threads, all correct
    assert set(got) == {r.key for r in refs}
    pool.discard()


def test_a_failed_fetch_drops_the_workers(store: ThreadsStore) -> None:
    b = Board(store)
    ok = b.put_object(RUN, b"present" * 50, "rpatch")
    missing = ObjectRef(ok.key.replace(ok.key.rsplit("/", 1)[1][:8], "00000000"), ok.size, "0" * 64)
    pool = FetchPool(2)
    _fetch(b, [ok], pool)
    first = store.readers[-1]
    with pytest.raises(NotFoundError):
        _fetch(b, [missing], pool)
    assert _fetch(b, [ok], pool) == {ok.key: b"present" * 50}
    assert store.readers[-1] is not first  # new workers after the failure
    pool.discard()


def test_discard_idle_keeps_a_pool_in_use(store: ThreadsStore) -> None:
    b = Board(store)
    ref = b.put_object(RUN, b"kept" * 50, "rpatch")
    pool, busy = FetchPool(2), threading.Lock()
    _fetch(b, [ref], pool)
    first = store.readers[-1]
    with busy:  # a fetch of the owner's in progress: its workers stay
        pool.discard_idle(busy)
        _fetch(b, [ref], pool)
        assert store.readers[-1] is first
    pool.discard_idle(busy)  # the owner idle (stopped): its workers go
    assert not busy.locked()
    _fetch(b, [ref], pool)
    assert store.readers[-1] is not first  # made again by the next fetch
    pool.discard()


def test_a_follower_fetches_every_version_on_one_worker(published: Published) -> None:
    recorded = ThreadsStore(f"fp-{uuid.uuid4().hex[:10]}")
    try:
        for key in published.store.list(""):
            recorded.put(key, published.store.get(key))
        recorded.readers.clear()
        first = 13  # 14, 15, 16: plain step patches (no shards, keyframes or skips)
        assert not {14, 15, 16} & set(SHARDED)
        engine = engine_at(published, first)
        f = Follower(Board(recorded), RUN, engine, FAST)
        for v in range(first + 1, first + 4):  # one version at a time: one object each
            assert f.sync(v) == v
            assert f.last_plan is not None and len(f.last_plan.steps) == 1
        assert_holds(engine, published.views[first + 3])
        assert len(recorded.readers) == 3 and len(set(recorded.readers)) == 1
        f.stop()
    finally:
        MemoryStore.reset(recorded.name)
