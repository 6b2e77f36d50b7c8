"""A relay announces a version (answers long-polls of LATEST, refreshes its cached LATEST) only
once the version's manifest and step patch objects are fetched, verified and cached
(docs/relay.md, "Long-poll"); a version whose patch fails verification is never announced,
is counted and logged, and the next sound version is announced as usual.

Real uvicorn relays on loopback in front of a ``file://`` board written by a real
:class:`Publisher` (``tests.relayworld``). No assertion is on wall time.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from rollpatch.board import Board
from rollpatch.layout import object_hash, version_key
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.store import ObjectInfo, Store, open_store
from rollpatch.store.base import Keys
from tests.conftest import masters, until
from tests.relayworld import (
    KEY,
    RUN,
    World,
    client_of,
    held_in_thread,
    version_of,
    waiting,
    world,
)


class Corrupting(Store):
    """A writable store that flips one byte of every object put while ``armed``."""

    def __init__(self, inner: Store) -> None:
        self.inner, self.uri, self.writable = inner, inner.uri, True
        self.armed = False

    def _get(self, key: str) -> bytes:
        return self.inner.get(key)

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        return self.inner.get_range(key, start, end)

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        raw = bytearray(data)
        if self.armed and object_hash(key) is not None:
            raw[len(raw) // 2] ^= 0x01
        self.inner.put(key, bytes(raw), if_absent=if_absent)

    def _list(self, prefix: str) -> Keys:
        return self.inner.list(prefix)

    def _head(self, key: str) -> ObjectInfo | None:
        return self.inner.head(key)

    def _delete(self, key: str) -> None:
        self.inner.delete(key)

    def _cas(self, key: str, data: bytes, *, expected: bytes | None) -> None:
        self.inner.cas(key, data, expected=expected)

    def close(self) -> None:
        self.inner.close()


_FIXTURES = (world,)  # used by name


def _cached(server: object, key: str) -> bool:
    return server.relay.cache.lookup(key) is not None  # type: ignore[attr-defined]


def test_announced_only_once_manifest_and_patch_are_cached(world: World) -> None:
    """The held answer from each relay of a chain comes after that relay cached the manifest
    and the step patch (checked the moment the answer arrives, no waiting); a follower then
    reads them from the region's cache: the region asks upstream for nothing more."""
    region = world.relay(world.origin.url, "region")
    c = client_of(region.url)
    t, out = held_in_thread(c, 0, 60.0)
    until(lambda: waiting(region) == 1, "the long-poll to be held at the region")
    until(lambda: waiting(world.origin) == 1, "the region to long-poll the origin")
    world.publish()
    t.join(30)
    assert not t.is_alive() and version_of(out[0]) == 1
    m = Board(open_store(world.uri)).manifest(RUN, 1)
    (patch,) = m.patches_from(0)
    for server in (world.origin, region):
        assert _cached(server, version_key(RUN, 1)), "announced before its manifest was cached"
        assert _cached(server, patch.ref.key), "announced before its patch was cached"
    upstream = region.relay.metrics.render()
    board = Board(c)
    assert version_of(c.get(KEY)) == 1  # plain GETs see it (the TTL cache was refreshed)
    assert board.manifest(RUN, 1).target == m.target
    assert board.fetch(patch.ref)  # BLAKE3 checked against the manifest
    after = region.relay.metrics.render()
    for op in ("get", "head"):  # nothing more went upstream for them
        line = f'rollpatch_relay_upstream_requests_total{{op="{op}"}}'
        before_n = [x for x in upstream.splitlines() if x.startswith(line)]
        after_n = [x for x in after.splitlines() if x.startswith(line)]
        assert before_n == after_n, op


def test_a_version_whose_patch_is_corrupt_is_not_announced(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """v1's step patch is written corrupt: the relay refuses it, holds v1 back from every
    long-poll (a held one that times out gets v0, the version announced), counts and logs
    it; v2, sound, is announced as usual and a follower-side read of it succeeds."""
    caplog.set_level(logging.DEBUG, logger="rollpatch.relay")
    store = Corrupting(open_store(world.uri))
    world.pub.close()
    world.pub = Publisher(Board(store), RUN, PublisherConfig(format="bf16"), asynchronous=False)
    c = client_of(world.origin.url)
    held = c.held()
    assert version_of(c.wait_newer(KEY, -1, 30.0, held)) == 0  # the watch runs, v0 announced
    t, out = held_in_thread(c, 0, 3.0)
    until(lambda: waiting(world.origin) == 1, "the long-poll to be held")
    store.armed = True
    assert world.publish() == 1
    store.armed = False
    metric = "rollpatch_relay_unannounced_total"
    until(lambda: metric in world.origin.relay.metrics.render(), "the prefetch to refuse v1")
    t.join(30)
    assert not t.is_alive() and version_of(out[0]) == 0, "v1 was announced"
    assert version_of(c.wait_newer(KEY, 0, 0.5, held)) == 0  # held back, still
    rendered = world.origin.relay.metrics.render()
    assert f'{metric}{{reason="corrupt"}}' in rendered
    assert 'rollpatch_relay_refused_total{reason="hash_mismatch"}' in rendered
    warned = [r for r in caplog.records if getattr(r, "rp_event", None) == "unannounced"]
    assert warned and warned[0].levelno == logging.WARNING
    assert sum(r.levelno == logging.WARNING for r in warned) == 1  # retries log at DEBUG
    # the next sound version is announced; its own step patch (from v1) is sound
    t, out = held_in_thread(c, 0, 60.0)
    assert world.publish() == 2
    t.join(30)
    assert not t.is_alive() and version_of(out[0]) == 2
    m = Board(open_store(world.uri)).manifest(RUN, 2)
    (patch,) = m.patches_from(1)
    assert _cached(world.origin, patch.ref.key)
    assert Board(c).fetch(patch.ref)


def test_without_prefetch_versions_are_announced_at_once(tmp_path: Path) -> None:
    """``prefetch=False``: the answer does not wait for the objects (nothing is fetched
    before a follower asks), and a follower still reaches the version."""
    w = World(tmp_path, prefetch=False)
    try:
        c = client_of(w.origin.url)
        t, out = held_in_thread(c, 0, 60.0)
        until(lambda: waiting(w.origin) == 1, "the long-poll to be held")
        w.pub.publish(masters(7, 0.1))
        t.join(30)
        assert version_of(out[0]) == 1
        m = Board(open_store(w.uri)).manifest(RUN, 1)
        (patch,) = m.patches_from(0)
        assert not _cached(w.origin, patch.ref.key)
        assert Board(c).fetch(patch.ref)
    finally:
        w.close()


def test_held_answers_carry_the_prefetch_hint_and_only_sound_hints_are_taken(
    world: World,
) -> None:
    """Each relay's held answer names the announced version's manifest and step patch
    (``X-Rollpatch-Prefetch``), so the relay downstream fetches both at once; a hint naming
    another run's objects, another version's manifest or non-board keys starts no fetch."""
    from rollpatch.relay.watch import PREFETCH_HEADER

    region = world.relay(world.origin.url, "region")
    c = client_of(region.url)
    held = c.held()
    headers: dict[str, str] = {}
    assert version_of(c.wait_newer(KEY, -1, 30.0, held, headers)) == 0
    until(lambda: waiting(world.origin) == 1, "the region to long-poll the origin")
    assert world.publish() == 1
    headers.clear()
    assert version_of(c.wait_newer(KEY, 0, 30.0, held, headers)) == 1
    m = Board(open_store(world.uri)).manifest(RUN, 1)
    (patch,) = m.patches_from(0)
    want = f"{version_key(RUN, 1)} {patch.ref.key}"
    got = {k.lower(): v for k, v in headers.items()}
    assert got[PREFETCH_HEADER.lower()] == want
    origin_headers: dict[str, str] = {}
    o = client_of(world.origin.url)
    assert version_of(o.wait_newer(KEY, 0, 30.0, o.held(), origin_headers)) == 1
    assert {k.lower(): v for k, v in origin_headers.items()}[PREFETCH_HEADER.lower()] == want
    before = _counted(region.relay.metrics.render())
    bogus = " ".join(
        [
            patch.ref.key.replace(f"runs/{RUN}/", "runs/other/"),  # another run's object
            version_key(RUN, 7),  # not the version announced
            KEY,  # LATEST: not an immutable board key
            "../../etc/passwd",
        ]
    )
    region.relay.watch._start_hinted(RUN, 2, bogus)
    assert _counted(region.relay.metrics.render()) == before  # nothing fetched or counted


def _counted(rendered: str) -> list[str]:
    """The lines of a metrics text but the age of LATEST (a gauge of time, new each render)."""
    age = "rollpatch_relay_upstream_latest_age_seconds "
    return [x for x in rendered.splitlines() if not x.startswith(age)]
