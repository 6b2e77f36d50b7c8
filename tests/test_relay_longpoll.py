"""Long-polls of LATEST through relays (docs/relay.md, "Long-poll"): a held GET answered when
a newer version exists, chains of relays passing it on, prefetch of the version's manifest and
step patch, followers that notice a version through the hint alone and stop at once while
held, a relay without long-polls falling back to polling; and TCP_NODELAY on served sockets.

Boards are ``file://`` directories written by a real :class:`Publisher`; relays are real
uvicorn servers on loopback, read through the ``http://`` store client as followers read them.
No assertion is on wall time: "held" is shown by the answer naming the version published
*after* the request was sent, and liveness bounds only fail hung tests.
"""

from __future__ import annotations

import http.client
import socket
import threading
from pathlib import Path

import pytest

from rollpatch.board import Board
from rollpatch.engines.view_engine import ViewEngine
from rollpatch.errors import NotFoundError, ObjectIntegrityError
from rollpatch.follower import Follower, FollowerConfig
from rollpatch.layout import pointer_key, version_key
from rollpatch.store import open_store
from rollpatch.store.http_client import HELD_HEADER, HttpStore
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


def test_held_until_a_newer_version_then_answered_with_it(world: World) -> None:
    c = client_of(world.origin.url)
    t, out = held_in_thread(c, 0, 60.0)
    until(lambda: waiting(world.origin) == 1, "the long-poll to be held")
    assert t.is_alive()
    world.publish()
    t.join(30)
    assert not t.is_alive()
    assert version_of(out[0]) == 1  # published after the request was sent: it was held
    assert version_of(c.get(KEY)) == 1  # plain GETs see it too (the TTL cache was refreshed)


def test_answered_at_once_when_newer_and_after_the_wait_when_not(world: World) -> None:
    world.publish()
    c = client_of(world.origin.url)
    held = c.held()
    assert version_of(c.wait_newer(KEY, 0, 60.0, held)) == 1  # newer than 0: not held
    # nothing newer than 1: held for the wait, then the LATEST it has
    assert version_of(c.wait_newer(KEY, 1, 0.2, held)) == 1
    assert c._pool.opened == 1  # both long-polls on the one connection the Held keeps


def test_bad_long_poll_arguments_are_400(world: World) -> None:
    host, port = world.origin.url.removeprefix("http://").split(":")

    def get(query: str) -> tuple[http.client.HTTPResponse, bytes]:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", f"/v1/objects/{KEY}?{query}")
        r = conn.getresponse()
        body = r.read()
        conn.close()
        return r, body

    for query in ("after=x", "after=1.5", "after=-2", "after=1&wait=nan", "after=1&wait=-1"):
        r, body = get(query)
        assert r.status == 400, query
        assert b"after=N" in body
    r, body = get("after=-1&wait=5")
    assert r.status == 200 and r.getheader(HELD_HEADER) == "1" and version_of(body) == 0


def test_a_relay_without_long_polls_answers_plainly(tmp_path: Path) -> None:
    w = World(tmp_path, hold_s=0.0)
    try:
        c = client_of(w.origin.url)
        with pytest.raises(NotImplementedError):
            c.wait_newer(KEY, 0, 5.0, c.held())
        # a follower over it polls instead, and still follows
        engine = ViewEngine()
        f = Follower(w.origin.url, RUN, engine, FollowerConfig(poll_s=0.05, audit_bytes_per_s=None))
        f.start()
        try:
            w.publish()
            until(lambda: f.version == 1, "the polling follower to reach v1")
        finally:
            f.stop()
    finally:
        w.close()


def test_chained_relays_pass_a_version_on_and_prefetch_it(world: World) -> None:
    region = world.relay(world.origin.url, "region")
    c = client_of(region.url)
    t, out = held_in_thread(c, 0, 60.0)
    until(lambda: waiting(region) == 1, "the long-poll to be held at the region")
    until(lambda: waiting(world.origin) == 1, "the region to long-poll the origin")
    world.publish()
    t.join(30)
    assert version_of(out[0]) == 1
    m = Board(open_store(world.uri)).manifest(RUN, 1)
    (patch,) = m.patches_from(0)
    # the region fetched the manifest and the step patch before anyone asked for them
    until(lambda: region.relay.cache.lookup(version_key(RUN, 1)) is not None, "manifest prefetch")
    until(lambda: region.relay.cache.lookup(patch.ref.key) is not None, "patch prefetch")
    metrics = region.relay.metrics.render()
    assert 'rollpatch_relay_upstream_requests_total{op="wait"}' in metrics


def test_a_follower_notices_a_version_through_the_hint(world: World) -> None:
    region = world.relay(world.origin.url, "region")
    engine = ViewEngine()
    # polls every 10 minutes: only the long-poll can make it notice v1 and v2 in this test
    f = Follower(region.url, RUN, engine, FollowerConfig(poll_s=600.0, audit_bytes_per_s=None))
    f.sync()
    f.start()
    try:
        for v in (1, 2):
            until(lambda: waiting(region) == 1, "the follower's long-poll to be held")
            assert world.publish() == v
            until(lambda v=v: f.version == v, f"the follower to serve v{v}")
        assert engine.digest == Board(open_store(world.uri)).manifest(RUN, 2).target
    finally:
        f.stop()


def test_a_follower_stops_at_once_while_held(tmp_path: Path) -> None:
    w = World(tmp_path, hold_s=600.0)
    try:
        f = Follower(
            w.origin.url,
            RUN,
            ViewEngine(),
            FollowerConfig(poll_s=600.0, timeout_s=1.0, audit_bytes_per_s=None),
        )
        f.sync()
        f.start()
        until(lambda: waiting(w.origin) == 1, "the follower's long-poll to be held")
        thread = f._watcher.thread
        f.stop()  # joins for timeout_s + 5 s at most; the relay would hold for 600 s
        assert thread is not None and not thread.is_alive()
    finally:
        w.close()


def test_cancel_ends_a_held_request(world: World) -> None:
    c = client_of(world.origin.url)
    held = c.held()
    out: list = []
    t = threading.Thread(target=lambda: out.append(c.wait_newer(KEY, 0, 600.0, held)))
    t.start()
    until(lambda: waiting(world.origin) == 1, "the long-poll to be held")
    held.cancel()
    t.join(30)
    assert not t.is_alive() and out == [None]
    # the next wait opens a new connection and works
    world.publish()
    assert version_of(c.wait_newer(KEY, 0, 60.0, held)) == 1


def test_served_sockets_have_no_nagle_delay(world: World) -> None:
    """h11 writes an answer's head and body separately: without TCP_NODELAY the body waits
    for the client's delayed ACK. Checked on the server's accepted socket."""
    from rollpatch.serving.server import _no_delay

    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server_side, _ = listener.accept()

    class Transport:
        def get_extra_info(self, name: str) -> object:
            return server_side if name == "socket" else None

    try:
        assert server_side.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
        _no_delay(Transport())
        assert server_side.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        for s in (client, server_side, listener):
            s.close()


def test_runs_watched_at_once_are_bounded(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each watched run costs a thread: past MAX_RUNS, a long-poll is answered at once."""
    from rollpatch.relay import watch

    monkeypatch.setattr(watch, "MAX_RUNS", 1)
    c = client_of(world.origin.url)
    t, out = held_in_thread(c, 0, 600.0)
    until(lambda: waiting(world.origin) == 1, "the first run's long-poll to be held")
    other = open_store(world.origin.url, retries=0)
    assert isinstance(other, HttpStore)
    # not held for its 600 s: answered at once, as a plain GET of a LATEST nobody published
    with pytest.raises(NotFoundError):
        other.wait_newer(pointer_key("other"), 0, 600.0, other.held())
    world.publish()
    t.join(30)
    assert version_of(out[0]) == 1


def test_a_relay_hinting_without_news_cannot_make_a_follower_spin() -> None:
    """An untrusted relay answering every long-poll at once: every other wait is poll_s."""
    from rollpatch.follower.watch import LatestHint

    class Eager(HttpStore):
        calls = 0

        def wait_newer(  # type: ignore[override]
            self, key: str, after: int, wait_s: float, held: object, **_: object
        ) -> bytes:
            Eager.calls += 1
            return b"{}"  # a hint, whatever it says: LATEST is read and verified anyway

    hint = LatestHint(Eager("http://127.0.0.1:9"), RUN)
    wake = threading.Event()
    for _ in range(4):
        hint.wait(5, 0.01, wake)  # LATEST stays at 5 (the follower's next read says so)
    assert Eager.calls == 2  # hint, poll_s, hint, poll_s
    hint.wait(None, 0.01, wake)  # nothing read yet: poll_s, no long-poll
    assert Eager.calls == 2


@pytest.mark.parametrize("push_bytes", [64 << 20, 0])
def test_a_follower_reads_the_new_version_from_the_answer(
    world: World, monkeypatch: pytest.MonkeyPatch, push_bytes: int
) -> None:
    """By default a follower's long-poll accepts the announced version's manifest and step
    patch in the answer (docs/relay.md, "Push"): it then reads LATEST, the manifest and the
    patch without another request, checked as fetched bytes, and serves the version;
    ``push_bytes=0`` fetches them after the answer."""
    asked: list[str] = []
    real = HttpStore._request

    def counted(self: HttpStore, key: str, **kw: object) -> object:
        asked.append(key)
        return real(self, key, **kw)  # type: ignore[arg-type]

    relay = world.origin
    engine = ViewEngine()
    cfg = FollowerConfig(poll_s=600.0, audit_bytes_per_s=None, push_bytes=push_bytes)
    f = Follower(relay.url, RUN, engine, cfg)
    f.sync()
    f.start()
    try:
        until(lambda: waiting(relay) == 1, "the follower's long-poll to be held")
        monkeypatch.setattr(HttpStore, "_request", counted)
        assert world.publish() == 1
        until(lambda: f.version == 1, "the follower to serve v1")
        m = Board(open_store(world.uri)).manifest(RUN, 1)
        assert engine.digest == m.target
        (patch,) = m.patches_from(0)
        wanted = {pointer_key(RUN), version_key(RUN, 1), patch.ref.key}
        if push_bytes:
            assert not wanted & set(asked), asked
        else:
            assert wanted <= set(asked), asked
    finally:
        f.stop()


def test_pushed_bytes_are_checked_as_fetched_ones(world: World) -> None:
    """A corrupt object held from an answer is refused by its BLAKE3 like a fetched one (the
    reader then fetches it from the relay), and held bytes expire unread."""
    from rollpatch.store import push

    c = client_of(world.origin.url)
    world.publish()
    m = Board(open_store(world.uri)).manifest(RUN, 1)
    (patch,) = m.patches_from(0)
    assert isinstance(c, HttpStore)
    c.hold_pushed(pointer_key(RUN), b"{}", [(patch.ref.key, b"forged")])
    board = Board(c)
    with pytest.raises(ObjectIntegrityError):
        board.fetch(patch.ref)
    assert board.fetch(patch.ref)  # the next read asks the relay: the real bytes
    c.hold_pushed(pointer_key(RUN), b"stale", [])
    push.PUSHED_TTL_S, ttl = 0.0, push.PUSHED_TTL_S
    try:
        assert c.get(pointer_key(RUN)) != b"stale"
    finally:
        push.PUSHED_TTL_S = ttl
