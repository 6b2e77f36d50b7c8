"""Pushed long-poll answers (docs/relay.md, "Push"): a relay long-polling a relay upstream gets
the announced version's manifest and step patch *in* the answer, checks them as fetched bytes
and caches them, so it asks upstream for nothing more; bytes it refuses are fetched as before;
the framing is parsed strictly; a relay that does not ask gets a plain answer; what the asking
relay says it holds (``have``) is left out, so a version crosses the WAN once.

Real uvicorn relays on loopback in front of a ``file://`` board written by a real
:class:`Publisher` (``tests.relayworld``). No assertion is on wall time.
"""

from __future__ import annotations

import http.client

import pytest

from rollpatch.board import Board
from rollpatch.errors import StoreError
from rollpatch.layout import version_key
from rollpatch.netem import Link
from rollpatch.relay import RelayServer
from rollpatch.relay import watch as relay_watch
from rollpatch.store import open_store
from rollpatch.store.push import (
    MAX_HAVE,
    MAX_PUSHED,
    PUSH_HEADER,
    frame_push,
    have_token,
    parse_have,
    split_push,
)
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


def _pushed(server: RelayServer, outcome: str) -> float:
    return _count(server, f'rollpatch_relay_pushed_total{{outcome="{outcome}"}}')


def test_a_version_crosses_the_wan_once_when_the_watch_asks_again(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The region relay learns v1 in a pushed answer through an emulated WAN link; its watch
    then ends (nobody waits) and a new one asks the origin with ``after=-1``, naming what it
    holds: the origin answers with v1 and pushes nothing, so v1's patch crosses the link once
    (counted by the link), and the region announces v1 from its cache, fetching nothing."""
    monkeypatch.setattr(relay_watch, "LINGER_S", 0.2)
    origin_address = world.origin.url.removeprefix("http://").rsplit(":", 1)
    link = Link(upstream=(origin_address[0], int(origin_address[1])), latency_ms=0).start()
    try:
        region = world.relay(link.url, "region", hold_s=1.0)
        c = client_of(region.url)
        held = c.held()
        # a downstream waits for v1 all along: with nobody waiting, the region's watch would
        # end after LINGER_S, and under load it did so before it long-polled the origin
        t, out = held_in_thread(c, 0, 60.0)
        until(lambda: region.relay.watch.announced(KEY) is not None, "the region to learn v0")
        until(lambda: waiting(world.origin) == 1, "the region to long-poll the origin")
        world.publish()
        t.join(30)
        assert not t.is_alive() and version_of(out[0]) == 1
        (patch,) = Board(open_store(world.uri)).manifest(RUN, 1).patches_from(0)
        size = len(open_store(world.uri).get(patch.ref.key))
        assert _pushed(region, "cached") == 3  # v0's manifest, then v1's and its patch
        until(lambda: KEY not in region.relay.watch._runs, "the region's watch to end")
        down, gets = link.stats().bytes_down, _upstream_gets(region)
        sent = _pushed(world.origin, "sent")

        assert version_of(c.wait_newer(KEY, 0, 1.0, held)) == 1  # a new watch, after=-1
        assert region.relay.watch.announced(KEY) is not None
        assert _pushed(world.origin, "held") == 2 and _pushed(world.origin, "sent") == sent
        assert _pushed(region, "present") == 0  # nothing it held came again
        assert _upstream_gets(region) == gets  # and nothing was fetched
        assert link.stats().bytes_down - down < size, (link.stats(), down, size)
    finally:
        link.close()


def test_the_origin_leaves_out_what_the_downstream_holds(world: World) -> None:
    """``have`` naming v1's manifest: only the patch is pushed; naming both: a plain answer
    with the prefetch hint; a malformed ``have`` is refused with 400."""
    world.publish()
    c = client_of(world.origin.url)
    held = c.held()
    assert version_of(c.wait_newer(KEY, 0, 30.0, held)) == 1
    (patch,) = Board(open_store(world.uri)).manifest(RUN, 1).patches_from(0)
    manifest = have_token(version_key(RUN, 1))
    assert manifest == "1" and have_token(patch.ref.key) == patch.ref.key.split("/")[-1][:64]
    for have, expect in (
        ([manifest], [patch.ref.key]),
        ([manifest, have_token(patch.ref.key)], []),
    ):
        pushed: list[tuple[str, bytes]] = []
        headers: dict[str, str] = {}
        body = c.wait_newer(
            KEY, 0, 30.0, held, headers, push_bytes=1 << 20, pushed_out=pushed, have=have
        )
        assert version_of(body) == 1 and [k for k, _ in pushed] == expect
        assert (PUSH_HEADER.lower() in {h.lower() for h in headers}) == bool(expect)
    host, port = world.origin.url.removeprefix("http://").rsplit(":", 1)
    for bad in ("x", "1,,2", "ab" * 31, ",".join(["1"] * (MAX_HAVE + 1)), "1" * 17):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", f"/v1/objects/{KEY}?after=0&wait=0&push=100&have={bad}")
        assert conn.getresponse().status == 400, bad
        conn.close()


def test_have_lists_are_parsed_strictly() -> None:
    h = "ab" * 32
    assert parse_have("") == frozenset()
    assert parse_have(f"12,{h},0012") == {"12", h}
    assert have_token(f"runs/r/objects/{h}.rpatch") == h and have_token("runs/r/LATEST") is None
    for bad in ("-1", "AB" * 32, f"{h}0", "1 2", ",".join(["1"] * (MAX_HAVE + 1))):
        with pytest.raises(ValueError):
            parse_have(bad)
