"""The relay's cache: corrupt upstream objects refused and never cached, a bounded LRU, a
restart served from the warm cache, chained relays fetching once, boards planned through a
relay, and hostile input (issue 11: list prefixes, links, FIFOs, corrupt cache files).
The relays: tests/relayfix.py.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollpatch.board import Board, pointer_key, version_key
from rollpatch.errors import ObjectIntegrityError, StoreError, TransientStoreError
from rollpatch.types import ObjectRef
from tests.relayfix import RUN, Counting, board, client, objects, publish, serve

_FIXTURES = (board, objects, serve)  # used by name


def test_corrupt_upstream_is_refused_never_cached(
    board: Board, objects: list[ObjectRef], serve
) -> None:
    relay = serve(board.store)
    c = client(relay)
    ref = objects[0]
    good = board.store.get(ref.key)
    board.store.put(ref.key, good[:-1] + bytes([good[-1] ^ 1]), if_absent=False)
    with pytest.raises(ObjectIntegrityError):  # 409 object_corrupt: final, not retried
        c.get(ref.key)
    with httpx.Client() as h:
        r = h.get(f"{relay.url}/v1/objects/{ref.key}")
        assert r.status_code == 409 and "BLAKE3" in r.json()["error"]["message"]
        assert (r.json()["code"], r.json()["key"]) == ("object_corrupt", ref.key)
    assert ref.key not in relay.relay.cache and relay.relay.cache.total_bytes == 0
    refused = relay.relay.metrics.value  # checked once; then refused on a HEAD (same ETag)
    assert refused("rollpatch_relay_refused_total", reason="hash_mismatch") == 1
    assert refused("rollpatch_relay_refused_total", reason="known_corrupt") == 1
    board.store.put(ref.key, good, if_absent=False)  # repaired upstream
    assert c.get(ref.key) == good and ref.key in relay.relay.cache
    bad_manifest = version_key(RUN, 99)
    board.store.put(bad_manifest, b'{"schema": "nope"}')
    with pytest.raises(StoreError, match="relay refused: upstream manifest refused") as err:
        c.get(bad_manifest)  # 502 with the relay's reason: final, not retried as a 5xx
    assert not isinstance(err.value, TransientStoreError)
    assert bad_manifest not in relay.relay.cache


def test_cache_is_bounded_lru(board: Board, serve) -> None:
    refs = [board.put_object(RUN, os.urandom(1000), "rpatch") for _ in range(6)]
    upstream = Counting(board.store)
    relay = serve(upstream, cache_bytes=3 * 1300)  # three 1000-byte objects with headers
    c = client(relay)
    cache = relay.relay.cache
    for ref in refs[:3]:
        c.get(ref.key)
    c.get(refs[0].key)  # refs[0] is now the most recently used
    c.get(refs[3].key)  # evicts refs[1], the least recently used
    assert refs[0].key in cache and refs[1].key not in cache and cache.total_bytes <= 3 * 1300
    for ref in refs[4:]:
        c.get(ref.key)
    assert len(cache) == 3 and cache.total_bytes <= 3 * 1300
    assert len(list((relay.relay.config.cache_dir).glob("??/*.blob"))) == 3
    assert c.get(refs[1].key) == board.store.get(refs[1].key)
    assert upstream.gets(refs[1].key) == 2 and upstream.gets(refs[0].key) == 1
    assert relay.relay.metrics.total("rollpatch_relay_evictions_total") >= 3
    big = board.put_object(RUN, os.urandom(5000), "rpatch")  # over the bound: kept alone
    assert c.get(big.key) == board.store.get(big.key) and list(cache._index) == [big.key]
    blob = relay.relay.resolve(big.key).result()
    cache.discard(big.key)  # evicted between resolve and open: the server resolves again
    assert relay.relay.open(blob) is None and c.get(big.key) == board.store.get(big.key)


def test_restart_serves_from_the_warm_cache(
    board: Board, objects: list[ObjectRef], serve, tmp_path: Path
) -> None:
    first = serve(board.store, cache="warm")
    for ref in objects:
        client(first).get(ref.key)
    first.stop()
    files = sorted((tmp_path / "warm").glob("??/*.blob"))
    assert len(files) == len(objects)
    damaged, truncated = files[0], files[1]
    raw = bytearray(damaged.read_bytes())
    raw[-1] ^= 0xFF  # same length: only the lazy re-hash can tell
    damaged.write_bytes(bytes(raw))
    truncated.write_bytes(truncated.read_bytes()[:-3])
    (tmp_path / "warm" / ".tmp-leftover").write_bytes(b"partial")
    upstream = Counting(board.store)
    second = serve(upstream, cache="warm")
    assert len(second.relay.cache) == len(objects) - 1  # truncated: dropped while indexing
    assert not (tmp_path / "warm" / ".tmp-leftover").exists()
    c = client(second)
    for ref in objects:
        assert c.get(ref.key) == board.store.get(ref.key)
    refetched = {k for (op, k), n in upstream.reads.items() if op == "get"}
    assert len(refetched) == 2  # the damaged and the truncated file, nothing else
    upstream.offline = True
    for ref in objects:
        assert c.get(ref.key) == board.store.get(ref.key)


def test_chained_relays_fetch_once(board: Board, objects: list[ObjectRef], serve) -> None:
    upstream = Counting(board.store)
    near_board = serve(upstream, cache="a")
    regional = serve(near_board.url, cache="b")
    for _ in range(3):
        c = client(regional)
        for ref in objects:
            assert c.get(ref.key) == board.store.get(ref.key)
    assert all(upstream.gets(ref.key) == 1 for ref in objects)
    for hop in (near_board, regional):
        m = hop.relay.metrics
        assert m.value("rollpatch_relay_cache_misses_total", kind="object") == len(objects)
    assert near_board.relay.metrics.value("rollpatch_relay_cache_hits_total", kind="object") == 0


def test_board_plans_and_fetches_through_a_relay(
    board: Board, objects: list[ObjectRef], serve
) -> None:
    relay = serve(board.store)
    follower = Board(client(relay))
    for have in (None, 1, 3):
        plan = follower.plan(RUN, have, 4)
        assert plan == board.plan(RUN, have, 4)
        for step in plan.steps:
            for ref in step.objects:
                assert follower.fetch(ref) == board.store.get(ref.key)
    with pytest.raises(StoreError):
        follower.put_object(RUN, b"x", "rpatch")  # read-only


# -- hostile input (issue 11) -------------------------------------------------------------------


def test_hostile_list_prefixes_links_and_fifos_are_refused(tmp_path: Path, serve) -> None:
    root = tmp_path / "board"
    board = Board(f"file://{root}")
    publish(board, 0, keyframe=True)
    secret = tmp_path / "passwd"
    secret.write_bytes(b"root:x:0:0")
    os.symlink(secret, root / "runs" / RUN / "objects" / "passwd")
    os.symlink(tmp_path, root / "runs" / RUN / "up")
    os.mkfifo(root / "runs" / RUN / "fifo")
    relay = serve(f"file://{root}")
    with httpx.Client(timeout=30) as h:
        for prefix in (
            "../../..",
            "..",
            "runs/../..",
            "runs/..",
            "./runs",
            "runs//x",
            "..\\..\\etc",
            "/etc",
            "runs/\x00",
            "runs/\n",
        ):
            r = h.get(f"{relay.url}/v1/list", params={"prefix": prefix})
            assert r.status_code == 400 and r.json()["error"], prefix
        for key in (f"runs/{RUN}/objects/passwd", f"runs/{RUN}/up/passwd", f"runs/{RUN}/fifo"):
            r = h.get(f"{relay.url}/v1/objects/{key}")
            assert r.status_code == 404 and b"root:" not in r.content, key
        listed = h.get(f"{relay.url}/v1/list", params={"prefix": "runs/"}).json()["keys"]
    assert listed == board.store.list("runs/")
    assert not any(k.endswith(("passwd", "fifo")) for k in listed)


def test_corrupt_cache_files_do_not_stop_the_relay(
    board: Board, objects: list[ObjectRef], serve, tmp_path: Path
) -> None:
    import struct

    first = serve(board.store, cache="c")
    for ref in objects:
        client(first).get(ref.key)
    first.stop()
    cache = tmp_path / "c"
    files = sorted(cache.glob("??/*.blob"))

    def header(doc: bytes) -> bytes:
        return struct.pack("<8sI", b"RPRELAY1", len(doc)) + doc

    files[0].write_bytes(header(b"[" * 10_000) + b"x")  # RecursionError before
    files[1].write_bytes(header(b'{"key": "\\ud800", "size": 1, "b3": "' + b"a" * 64 + b'"}'))
    files[2].write_bytes(header(b'{"key": "k", "size": 1e400, "b3": 1}') + b"x")
    (cache / "zz").mkdir()
    (cache / "zz" / "folder.blob").mkdir()
    os.mkfifo(cache / "zz" / "fifo.blob")
    os.symlink(files[3], cache / "zz" / "link.blob")
    upstream = Counting(board.store)
    second = serve(upstream, cache="c")  # starts: every unusable file is discarded and logged
    assert len(second.relay.cache) == len(objects) - 3
    assert second.relay.metrics.value("rollpatch_relay_cache_discarded_total") == 6
    assert sorted(p.name for p in (cache / "zz").iterdir()) == []
    c = client(second)
    for ref in objects:
        assert c.get(ref.key) == board.store.get(ref.key)
    assert len({k for (op, k), n in upstream.reads.items() if op == "get"}) == 3


def test_upstream_failures_are_logged_once_per_kind(
    board: Board, serve, caplog: pytest.LogCaptureFixture
) -> None:
    """A relay whose upstream fails says so in its log (once per status and message, not per
    request); before, it answered 503/502 and logged nothing."""
    upstream = Counting(board.store)
    relay = serve(upstream)
    upstream.offline = True
    with caplog.at_level(logging.WARNING, logger="rollpatch.relay"), httpx.Client() as h:
        for _ in range(3):
            assert h.get(f"{relay.url}/v1/objects/{pointer_key(RUN)}").status_code == 503
    said = [r for r in caplog.records if getattr(r, "rp_event", None) == "relay_error_answer"]
    assert len(said) == 1, [r.getMessage() for r in said]
    fields = said[0].rp_fields  # type: ignore[attr-defined]
    assert fields["status"] == 503 and "offline" in fields["error"], fields


def test_a_cache_file_rotted_on_disk_is_said_counted_and_fetched_again(
    board: Board, objects: list[ObjectRef], serve, caplog: pytest.LogCaptureFixture
) -> None:
    first = serve(board.store, cache="c")
    ref = objects[0]
    client(first).get(ref.key)
    path = first.relay.cache.peek(ref.key).path
    first.stop()
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1  # one bit of the object's bytes, the header intact
    path.write_bytes(bytes(raw))
    upstream = Counting(board.store)
    second = serve(upstream, cache="c")
    with caplog.at_level(logging.WARNING, logger="rollpatch.relay"):
        assert client(second).get(ref.key) == board.store.get(ref.key)
    assert any("does not match its BLAKE3" in r.getMessage() for r in caplog.records)
    assert second.relay.metrics.value("rollpatch_relay_cache_discarded_total") == 1
    assert upstream.gets(ref.key) == 1


def test_a_run_published_again_under_its_name_is_not_served_from_stale_manifests(
    board: Board, serve, caplog: pytest.LogCaptureFixture
) -> None:
    """A run deleted upstream and published again under the same name: the relay's cached
    manifest of the earlier run names another target than the new LATEST, so it is dropped
    and fetched again (followers would refuse it: docs/follower.md)."""
    from rollpatch.manifest import KeyframeObject
    from rollpatch.types import Pointer
    from tests.conftest import make_manifest

    def version0(target: str) -> None:  # a publisher process of its own each time
        b = Board(board.store)
        kf = KeyframeObject(b.put_object(RUN, os.urandom(64), "safetensors"))
        b.put_manifest(make_manifest(RUN, 0, target=target, keyframes=(kf,)))
        b.advance(RUN, 0)

    version0("a" * 64)
    relay = serve(board.store)
    c = Board(client(relay))
    assert c.manifest(RUN, 0).target == "a" * 64  # cached by the relay
    for key in board.store.list(f"runs/{RUN}/"):  # deleted, and published again
        board.store.delete(key)
    version0("b" * 64)
    time.sleep(relay.relay.config.pointer_ttl + 0.1)
    with caplog.at_level(logging.WARNING, logger="rollpatch.relay"):
        p = c.latest(RUN)
    assert isinstance(p, Pointer) and p.target == "b" * 64
    assert any("published again under its name" in r.getMessage() for r in caplog.records)
    assert Board(client(relay)).manifest(RUN, 0).target == "b" * 64  # fetched again


def test_a_cache_file_that_rots_under_a_running_relay_is_found_and_fetched_again(
    board: Board, objects: list[ObjectRef], serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cached object is re-hashed before it is served once its last check is ``recheck_s``
    old: before session 38 only a restart re-hashed, and a file that rotted under a running
    relay was served on every read (an audit's MEDIUM finding: an island refused it each time
    and never booted), with nothing logged or counted."""
    upstream = Counting(board.store)
    relay = serve(upstream, cache="rot", recheck_s=600.0)
    c = client(relay)
    ref = objects[0]
    assert c.get(ref.key) == board.store.get(ref.key)
    (path,) = [e.path for e in [relay.relay.cache.peek(ref.key)] if e is not None]
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0xFF  # one byte of the object, behind the relay's back
    path.write_bytes(bytes(raw))
    assert c.get(ref.key) != board.store.get(ref.key)  # within recheck_s: served as cached
    import rollpatch.relay.cache as cache_mod

    now = time.monotonic()
    monkeypatch.setattr(cache_mod, "_now", lambda: now + 601.0)  # recheck_s later
    assert c.get(ref.key) == board.store.get(ref.key)  # re-hashed, dropped, fetched again
    assert relay.relay.metrics.value("rollpatch_relay_cache_discarded_total") == 1
    assert upstream.reads[("get", ref.key)] == 2
    assert c.get(ref.key) == board.store.get(ref.key)  # the new copy, checked afresh


def test_a_cache_disk_that_cannot_take_an_object_does_not_fail_the_read(
    board: Board, objects: list[ObjectRef], serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full (or read-only) cache disk made every uncached object a 503 (an audit's MEDIUM
    finding): the verified bytes are now served from memory, uncached, counted and logged."""
    import errno

    relay = serve(board.store, cache="full")

    def full(*_: object, **__: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(relay.relay.cache, "insert", full)
    c = client(relay)
    for ref in objects[:2]:
        assert c.get(ref.key) == board.store.get(ref.key)
        assert relay.relay.cache.peek(ref.key) is None  # not cached
    assert relay.relay.metrics.value("rollpatch_relay_cache_write_errors_total") == 2


def test_a_disk_that_fills_below_the_bound_is_made_room_on(
    board: Board, objects: list[ObjectRef], serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache's disk fills up before ``cache_bytes`` (a smaller disk, or one shared):
    before, every object after that was served uncached for good. Now the least recently
    used entries are dropped to make room and the object is cached (the disk here: a quota
    of about two objects, enforced where the cache writes a file)."""
    import errno

    relay = serve(board.store, cache="quota")
    cache = relay.relay.cache
    sizes = {ref.key: len(board.store.get(ref.key)) for ref in objects[:4]}
    quota = sum(sorted(sizes.values())[-2:]) + 2 * 1024  # two of the largest, and headers
    write = cache._insert

    def on_a_small_disk(key: str, size: int, b3: str, chunks: Any, check: bool) -> object:
        used = sum(e.file_bytes for e in cache._index.values())
        if used + size + 1024 > quota:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(key, size, b3, chunks, check)

    monkeypatch.setattr(cache, "_insert", on_a_small_disk)
    c = client(relay)
    for ref in objects[:4]:
        assert c.get(ref.key) == board.store.get(ref.key)
        assert cache.peek(ref.key) is not None  # cached, room made for it
    assert relay.relay.metrics.value("rollpatch_relay_cache_write_errors_total") == 0
    assert relay.relay.metrics.value("rollpatch_relay_evictions_total") >= 2
    assert cache.peek(objects[0].key) is None  # the least recently used went first
    assert sum(e.file_bytes for e in cache._index.values()) <= quota


@pytest.mark.parametrize("new_versions", [6, 9])
def test_a_run_published_again_drops_every_cached_manifest_of_the_earlier_run(
    board: Board, serve, caplog: pytest.LogCaptureFixture, new_versions: int
) -> None:
    """An audit (session 41): after a run name was reused, `pull --version 3` through the
    relay rebuilt the earlier run's weights, verified against its cached manifest; only the
    manifest LATEST names was dropped. Now the whole run's cached manifests go, found either
    by LATEST (6 new versions: v5 was cached) or by a new manifest whose patch starts at
    another digest than the cached manifest of its base (9: v6 onwards were never cached)."""
    import numpy as np

    from rollpatch.publisher import Publisher, PublisherConfig

    def publish_run(seed: int, n: int) -> dict[int, str]:
        rng = np.random.default_rng(seed)
        w = {"a.weight": rng.standard_normal((64, 64)).astype(np.float32)}
        pub_board = Board(board.store)  # a publisher process of its own each time
        with Publisher(pub_board, RUN, PublisherConfig(skip_strides=()), asynchronous=False) as p:
            for _ in range(n):
                w["a.weight"] += (rng.standard_normal((64, 64)) * 1e-3).astype(np.float32)
                p.publish(w)
        fresh = Board(board.store)  # a board caches the manifests it read
        return {v: fresh.manifest(RUN, v).target for v in range(n)}

    first = publish_run(1, 6)
    relay = serve(board.store)
    c = Board(client(relay))
    assert [c.manifest(RUN, v).target for v in range(6)] == [first[v] for v in range(6)]
    for key in board.store.list(f"runs/{RUN}/"):  # deleted, and published again
        board.store.delete(key)
    second = publish_run(2, new_versions)
    assert second[3] != first[3]
    time.sleep(relay.relay.config.pointer_ttl + 0.1)
    c = Board(client(relay))  # a new reader (a board caches the manifests it read)
    with caplog.at_level(logging.WARNING, logger="rollpatch.relay"):
        assert c.latest(RUN).target == second[new_versions - 1]
        for v in range(new_versions - 1, -1, -1):  # a follower walking back from LATEST
            assert c.manifest(RUN, v).target == second[v], v
    said = [r.getMessage() for r in caplog.records if "published again" in r.getMessage()]
    assert said, [r.getMessage() for r in caplog.records]
    assert "manifest(s) and marker(s) are dropped" in said[0]


@pytest.mark.parametrize("restart", [False, True])
def test_a_fixed_version_asked_first_after_a_run_was_published_again_is_the_new_runs(
    board: Board, serve, restart: bool
) -> None:
    """G-F5's rest (session 41): a version asked for before anything read LATEST, right after
    the run name was reused (or after the relay restarted on its cache), was served from the
    earlier run. Now a cached manifest of a run whose LATEST the relay has not read lately is
    served after one read of it (relay/lineage.py)."""
    import numpy as np

    from rollpatch.publisher import Publisher, PublisherConfig
    from rollpatch.relay import lineage

    def publish_run(seed: int, n: int) -> dict[int, str]:
        rng = np.random.default_rng(seed)
        w = {"a.weight": rng.standard_normal((64, 64)).astype(np.float32)}
        with Publisher(
            Board(board.store), RUN, PublisherConfig(skip_strides=()), asynchronous=False
        ) as p:
            for _ in range(n):
                w["a.weight"] += (rng.standard_normal((64, 64)) * 1e-3).astype(np.float32)
                p.publish(w)
        fresh = Board(board.store)
        return {v: fresh.manifest(RUN, v).target for v in range(n)}

    first = publish_run(1, 6)
    relay = serve(board.store)
    c = Board(client(relay))
    assert [c.manifest(RUN, v).target for v in range(6)] == [first[v] for v in range(6)]
    for key in board.store.list(f"runs/{RUN}/"):
        board.store.delete(key)
    second = publish_run(2, 4)
    if restart:  # a new relay process on the same cache directory
        relay.stop()
        relay = serve(board.store)
    else:  # the relay read the run's LATEST more than LINEAGE_S ago
        relay.relay.lineage.every_s = 0.2
        time.sleep(0.3)
    assert lineage.LINEAGE_S >= relay.relay.config.pointer_ttl
    c = Board(client(relay))  # pull --version 3: no LATEST read by the reader
    assert c.manifest(RUN, 3).target == second[3] != first[3]
    assert c.manifest(RUN, 1).target == second[1]


def test_a_plan_behind_a_relay_whose_listing_lags_its_latest_reads_the_versions_by_key(
    board: Board, serve
) -> None:
    """Audit I, M1 (session 42): a relay keeps LATEST for ``pointer_ttl`` and listings for
    ``list_ttl`` (longer by default; one more of each per relay in a chain), so a follower
    more than one version behind planned from a listing without LATEST's version and failed:
    "version N is not on the board ... not published yet". The versions past the listing are
    now read by key."""
    for n in range(3):
        publish(board, n, keyframe=n == 0)
    relay = serve(board.store, pointer_ttl=0.0, list_ttl=3600.0)
    c = Board(client(relay))
    assert c.plan(RUN, None, 2).want == 2  # the listing (v0..v2) is cached now
    for n in range(3, 6):
        publish(board, n, keyframe=n == 4)
    c = Board(client(relay))
    latest = c.latest(RUN)
    assert latest is not None and latest.version == 5
    assert c.versions(RUN)[-1] == 2  # the relay's listing lags
    plan = c.plan(RUN, 1, 5)
    assert [(s.base, s.to) for s in plan.steps] in (
        [(1, 2), (2, 3), (3, 4), (4, 5)],
        [(None, 4), (4, 5)],
    )
    assert [s.to for s in c.plan(RUN, None, 5).steps] == [4, 5]  # the keyframe past it too
