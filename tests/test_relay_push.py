"""Pushed long-poll answers (docs/relay.md, "Push"): a relay long-polling a relay upstream gets
the announced version's manifest and step patch *in* the answer, checks them as fetched bytes
and caches them, so it asks upstream for nothing more; bytes it refuses are fetched as before;
the framing is parsed strictly; a relay that does not ask gets a plain answer.

Real uvicorn relays on loopback in front of a ``file://`` board written by a real
:class:`Publisher` (``tests.relayworld``). No assertion is on wall time.
"""

from __future__ import annotations

import pytest

from rollpatch.board import Board
from rollpatch.errors import StoreError
from rollpatch.layout import version_key
from rollpatch.relay import RelayServer
from rollpatch.store import open_store
from rollpatch.store.push import MAX_PUSHED, PUSH_HEADER, frame_push, split_push
from tests.conftest import until
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

_FIXTURES = (world,)  # used by name


def _count(server: RelayServer, series: str) -> float:
    for line in server.relay.metrics.render().splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def _upstream_gets(server: RelayServer) -> float:
    return _count(server, 'rollpatch_relay_upstream_requests_total{op="get"}')


def test_a_relay_downstream_gets_the_version_in_the_answer(world: World) -> None:
    """The region relay's long-poll of the origin brings v1's manifest and step patch along:
    both are cached at the region when it announces v1, and it made no GET upstream for
    them; a follower-side read through the region is served from that cache."""
    region = world.relay(world.origin.url, "region")
    c = client_of(region.url)
    t, out = held_in_thread(c, 0, 60.0)
    until(lambda: region.relay.watch.announced(KEY) is not None, "the region to announce v0")
    until(lambda: waiting(world.origin) == 1, "the region to long-poll the origin")
    cached, sent = 'rollpatch_relay_pushed_total{outcome="cached"}', '{outcome="sent"}'
    sent = "rollpatch_relay_pushed_total" + sent
    gets, before = _upstream_gets(region), (_count(region, cached), _count(world.origin, sent))
    world.publish()
    t.join(30)
    assert not t.is_alive() and version_of(out[0]) == 1
    m = Board(open_store(world.uri)).manifest(RUN, 1)
    (patch,) = m.patches_from(0)
    for key in (version_key(RUN, 1), patch.ref.key):
        assert region.relay.cache.lookup(key) is not None, key
    assert _upstream_gets(region) == gets  # nothing fetched: both came pushed
    assert _count(region, cached) == before[0] + 2
    assert _count(world.origin, sent) == before[1] + 2
    board = Board(c)
    assert board.manifest(RUN, 1).target == m.target
    assert board.fetch(patch.ref)  # BLAKE3 checked against the manifest
    assert _upstream_gets(region) == gets


def test_without_push_the_hinted_objects_are_fetched(world: World) -> None:
    """``push_bytes=0``: the region asks for nothing pushed, fetches the hinted manifest and
    patch after the answer, and still announces v1 with both cached."""
    region = world.relay(world.origin.url, "region", push_bytes=0)
    c = client_of(region.url)
    t, out = held_in_thread(c, 0, 60.0)
    until(lambda: region.relay.watch.announced(KEY) is not None, "the region to announce v0")
    until(lambda: waiting(world.origin) == 1, "the region to long-poll the origin")
    gets = _upstream_gets(region)
    world.publish()
    t.join(30)
    assert not t.is_alive() and version_of(out[0]) == 1
    assert _upstream_gets(region) >= gets + 2
    assert _count(region, 'rollpatch_relay_pushed_total{outcome="cached"}') == 0
    (patch,) = Board(open_store(world.uri)).manifest(RUN, 1).patches_from(0)
    assert region.relay.cache.lookup(patch.ref.key) is not None


def test_push_only_when_asked_newer_and_within_the_limit(world: World) -> None:
    """The origin pushes to a waiter behind the announced version, within the bytes it
    accepts; a waiter already holding it, or accepting too few bytes, gets a plain answer."""
    world.publish()
    c = client_of(world.origin.url)
    held = c.held()
    assert version_of(c.wait_newer(KEY, 0, 30.0, held)) == 1  # the watch runs, v1 announced
    pushed: list[tuple[str, bytes]] = []
    headers: dict[str, str] = {}
    body = c.wait_newer(KEY, 0, 30.0, held, headers, push_bytes=1 << 20, pushed_out=pushed)
    assert version_of(body) == 1 and PUSH_HEADER.lower() in {h.lower() for h in headers}
    (patch,) = Board(open_store(world.uri)).manifest(RUN, 1).patches_from(0)
    assert [k for k, _ in pushed] == [version_key(RUN, 1), patch.ref.key]
    assert pushed[1][1] == open_store(world.uri).get(patch.ref.key)
    for after, limit in ((1, 1 << 20), (0, 64)):  # holds v1 already; too small to fit
        pushed, headers = [], {}
        body = c.wait_newer(KEY, after, 0.2, held, headers, push_bytes=limit, pushed_out=pushed)
        assert version_of(body) == 1 and not pushed
        assert PUSH_HEADER.lower() not in {h.lower() for h in headers}


def test_pushed_bytes_are_checked_like_fetched_ones(world: World) -> None:
    """A pushed object whose bytes do not match its key, or a manifest that fails its
    checks, is refused and counted, never cached; sound bytes are cached once."""
    world.publish()
    relay = world.origin.relay
    m = Board(open_store(world.uri)).manifest(RUN, 1)
    (patch,) = m.patches_from(0)
    good = open_store(world.uri).get(patch.ref.key)
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 1
    assert not relay.accept(patch.ref.key, bytes(bad))
    assert relay.cache.lookup(patch.ref.key) is None
    assert not relay.accept(version_key(RUN, 1), b'{"not": "a manifest"}')
    assert relay.cache.lookup(version_key(RUN, 1)) is None
    rendered = relay.metrics.render()
    assert 'rollpatch_relay_refused_total{reason="hash_mismatch"}' in rendered
    assert 'rollpatch_relay_refused_total{reason="invalid_manifest"}' in rendered
    assert relay.accept(patch.ref.key, good)
    assert relay.cache.lookup(patch.ref.key) is not None
    assert relay.accept(patch.ref.key, good)  # present: nothing written again
    assert _count(world.origin, 'rollpatch_relay_pushed_total{outcome="present"}') == 1
    assert not relay.accept(KEY, b"latest")  # only manifests and objects are accepted


def test_the_framing_round_trips_and_malformed_answers_are_refused() -> None:
    key = "runs/r/objects/" + "ab" * 32 + ".rpatch"
    header, pieces = frame_push(b"LATEST", [(key, b"xyz"), (key, b"")])
    assert split_push(header, b"".join(pieces), "s") == (b"LATEST", [(key, b"xyz"), (key, b"")])
    body = b"LATESTxyz"
    for bad in (
        "",  # no LATEST length
        "x 6",
        f"6 {key}=4",  # lengths do not add up
        f"6 {key}",  # no length
        "6 ../etc=3",  # not a key
        f"6 {key}=99999999999999999",
        " ".join(["6", *[f"{key}=0"] * (MAX_PUSHED + 1)]),
        "6 " + "a" * 20_000,
    ):
        with pytest.raises(StoreError):
            split_push(bad, body, "s")
    with pytest.raises(ValueError):
        frame_push(b"", [(key, b"")] * (MAX_PUSHED + 1))
