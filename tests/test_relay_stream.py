"""Upstream objects larger than ``stream_chunk_bytes`` reach the relay's cache in ranges,
hashed as they arrive, never whole in memory (session 43: each miss was one ``Store.get`` of
the whole object, a multi-GB keyframe held in memory per fetch); a copy that is different,
short or long upstream is refused as corrupt and nothing of it is kept."""

from __future__ import annotations

import errno
import gc
import math
import os
from pathlib import Path

import pytest

from rollpatch.board import Board
from rollpatch.errors import ObjectIntegrityError, TransientStoreError
from rollpatch.manifest import KeyframeObject
from rollpatch.relay.uncached import MemoryBudget
from rollpatch.store import Store, open_store
from tests.conftest import make_manifest
from tests.relayfix import RUN, Counting, client, serve

_FIXTURES = (serve,)  # used by name

CHUNK = 4096
SIZE = 10 * CHUNK + 123  # 11 ranges


class Ranged(Counting):
    """Records whole reads and ranges of each key (then reads as :class:`Counting`)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.whole: list[str] = []
        self.ranges: list[tuple[str, int, int]] = []

    def _get(self, key: str) -> bytes:
        self.whole.append(key)
        return super()._get(key)

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        self.ranges.append((key, start, end))
        return super()._get_range(key, start, end)


def _published(board: Board) -> tuple[str, bytes]:
    """A version whose keyframe object is SIZE bytes; its key and bytes."""
    data = os.urandom(SIZE)
    ref = board.put_object(RUN, data, "safetensors")
    board.put_manifest(make_manifest(RUN, 0, view_bytes=SIZE, keyframes=(KeyframeObject(ref),)))
    board.advance(RUN, 0)
    return ref.key, data


def _cache_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.name != "trust-state.json"]


def test_a_large_object_reaches_the_cache_in_ranges(any_board: Board, serve) -> None:
    """On every backend a board is kept on (S3: ranged GETs of a real server process)."""
    key, data = _published(any_board)
    upstream = Ranged(any_board.store)
    relay = serve(upstream, stream_chunk_bytes=CHUNK)
    c = client(relay)
    c.get(f"runs/{RUN}/versions/000000000000.json")  # its manifest names the object's size
    assert c.get(key) == data
    assert key not in upstream.whole  # never read whole
    got = [(s, e) for k, s, e in upstream.ranges if k == key]
    assert len(got) == math.ceil(SIZE / CHUNK) and got[-1][1] == SIZE
    assert all(e - s <= CHUNK for s, e in got)
    assert c.get_range(key, 5, 9) == data[5:9]  # served from the cache: no new upstream read
    assert len([k for k, _, _ in upstream.ranges if k == key]) == len(got)


@pytest.mark.parametrize("damage", ["different", "short", "long"])
def test_a_damaged_large_object_is_refused_and_nothing_of_it_kept(
    memory_board: Board, serve, tmp_path: Path, damage: str
) -> None:
    key, data = _published(memory_board)
    bad = {
        "different": data[:-1] + bytes([data[-1] ^ 1]),
        "short": data[: SIZE - 100],
        "long": data + b"tail",  # the named size is read: the object as named is sound
    }[damage]
    memory_board.store.put(key, bad, if_absent=False)
    relay = serve(memory_board.store, stream_chunk_bytes=CHUNK)
    c = client(relay)
    c.get(f"runs/{RUN}/versions/000000000000.json")
    files = _cache_files(tmp_path / "cache")
    if damage == "long":
        assert c.get(key) == data
        return
    with pytest.raises(ObjectIntegrityError):
        c.get(key)
    assert _cache_files(tmp_path / "cache") == files  # no entry, no temp file left
    refused = relay.relay.metrics.value("rollpatch_relay_refused_total", reason="hash_mismatch")
    assert refused == 1


def test_an_object_no_manifest_named_yet_is_streamed_by_its_stored_size(
    memory_board: Board, serve
) -> None:
    """A follower asking for an object before this relay read its manifest: the size comes
    from a HEAD, and the object is streamed and checked against its key's BLAKE3 as well
    (before, such a read was unbounded: whoever can write to the store chose the memory)."""
    key, data = _published(memory_board)
    upstream = Ranged(memory_board.store)
    relay = serve(upstream, stream_chunk_bytes=CHUNK)
    assert client(relay).get(key) == data
    assert key not in upstream.whole
    assert len([k for k, _, _ in upstream.ranges if k == key]) == math.ceil(SIZE / CHUNK)


def test_a_relay_streams_from_a_relay_upstream(memory_board: Board, serve) -> None:
    """A region relay behind an origin relay: its ranges are Range requests to the origin."""
    key, data = _published(memory_board)
    origin = serve(memory_board.store, cache="origin")
    region = serve(open_store(origin.url, retries=0), cache="region", stream_chunk_bytes=CHUNK)
    c = client(region)
    c.get(f"runs/{RUN}/versions/000000000000.json")
    assert c.get(key) == data
    assert region.relay.cache.peek(key) is not None and origin.relay.cache.peek(key) is not None


def _disk_full(*_: object, **__: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("fits", [True, False])
def test_a_large_object_the_cache_disk_refuses_is_served_from_bounded_memory(
    memory_board: Board, serve, monkeypatch: pytest.MonkeyPatch, fits: bool
) -> None:
    """A full cache disk: a large object is served from memory while the relay's budget for
    such objects holds it, else refused with a 503 before it is read (before session 44 each
    was read whole, up to ``upstream_workers`` multi-GB keyframes in memory at once)."""
    key, data = _published(memory_board)
    upstream = Ranged(memory_board.store)
    budget = SIZE if fits else SIZE - 1
    relay = serve(upstream, stream_chunk_bytes=CHUNK, uncached_bytes=budget, prefetch=False)
    c = client(relay)
    c.get(f"runs/{RUN}/versions/000000000000.json")  # cached; then the disk fills up
    monkeypatch.setattr(relay.relay.cache, "insert_chunks", _disk_full)
    if fits:
        assert c.get(key) == data
        assert c.get_range(key, 5, 9) == data[5:9]  # not cached: read again, within bounds
        gc.collect()
        assert relay.relay.uncached.held == 0  # given back once the answers were sent
        assert relay.relay.metrics.value("rollpatch_relay_cache_write_errors_total") == 2
        return
    with pytest.raises(TransientStoreError, match="does not fit in its memory"):
        c.get(key)
    assert key not in upstream.whole  # refused before it was read whole
    assert relay.relay.uncached.held == 0
    assert relay.relay.metrics.value("rollpatch_relay_cache_write_errors_total") == 1


def test_the_memory_budget_holds_bytes_while_what_holds_them_lives() -> None:
    class Held:
        pass

    budget = MemoryBudget(100)
    one = budget.held_while("k1", 60, Held)
    assert budget.held == 60
    with pytest.raises(TransientStoreError, match="60 of 100 bytes held"):
        budget.held_while("k2", 41, Held)
    with pytest.raises(ZeroDivisionError):  # a failed fetch gives its bytes back
        budget.held_while("k3", 40, lambda: 1 // 0)
    two = budget.held_while("k4", 40, Held)
    assert budget.held == 100
    del one
    gc.collect()
    assert budget.held == 40
    del two
    gc.collect()
    assert budget.held == 0


def test_an_upstream_socket_error_mid_stream_is_not_taken_for_a_full_disk(
    memory_board: Board, serve
) -> None:
    """A reset connection while a large object streams in is the upstream's failure (a 503
    the client retries), not the cache disk refusing it: nothing is read whole into memory
    and no cache write error is counted."""
    key, _ = _published(memory_board)

    class Resets(Ranged):
        def _get_range(self, key: str, start: int, end: int) -> bytes:
            if start > 0:
                raise ConnectionResetError(104, "Connection reset by peer")
            return super()._get_range(key, start, end)

    upstream = Resets(memory_board.store)
    relay = serve(upstream, stream_chunk_bytes=CHUNK, prefetch=False)
    c = client(relay)
    c.get(f"runs/{RUN}/versions/000000000000.json")
    with pytest.raises(TransientStoreError, match="upstream read failed"):
        c.get(key)
    assert key not in upstream.whole
    assert relay.relay.metrics.value("rollpatch_relay_cache_write_errors_total") == 0
    assert relay.relay.uncached.held == 0
