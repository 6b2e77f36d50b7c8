"""A corrupt object at the origin, read through a relay (docs/store.md, "Corrupt at the origin").

The relay refuses an object whose upstream bytes fail the BLAKE3 in its key with ``409`` and
``{"code": "object_corrupt", "key": ...}``; the ``http://`` client raises
``ObjectIntegrityError`` for it at once (a 5xx would be retried as transient forever), so a
follower behind a relay plans around the object as it does reading the store directly. A relay
is untrusted: one that calls sound objects corrupt only causes a detour, never other bits.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from rollpatch.board import Board
from rollpatch.errors import ObjectIntegrityError, StoreError, TransientStoreError
from rollpatch.follower import Follower, FollowerState
from rollpatch.relay import RelayConfig, RelayServer
from rollpatch.store import open_store
from rollpatch.store.http_client import CORRUPT_CODE, CORRUPT_STATUS
from tests.followfix import (
    FAST,
    LAST,
    RUN,
    Published,
    _build,
    assert_holds,
    copy_board,
    engine_at,
    step_objects,
)

KEY = "runs/r/objects/" + "b" * 64 + ".rpatch"
Answer = tuple[int, dict[str, str], bytes]
Respond = Callable[[str, str, dict[str, str]], Answer]


@pytest.fixture(scope="module")
def published() -> Published:
    return _build(LAST, None, 0)


@pytest.fixture
def board(published: Published) -> Board:
    return copy_board(published)


class _Canned(ThreadingHTTPServer):
    """A loopback HTTP server whose answer to every request is
    ``answer(method, path, headers)``; counts the requests it got."""

    daemon_threads = True

    def __init__(self, answer: Respond) -> None:
        self.answer, self.requests = answer, 0
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self) -> None:
                with lock:
                    outer.requests += 1
                status, headers, body = outer.answer(self.command, self.path, dict(self.headers))
                self.send_response(status)
                for k, v in {"Content-Length": str(len(body)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_HEAD = _reply

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


@pytest.fixture
def canned() -> Iterator[Callable[[Respond], _Canned]]:
    servers: list[_Canned] = []

    def start(answer: Respond) -> _Canned:
        servers.append(_Canned(answer))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def _json(status: int, doc: object) -> Answer:
    return status, {"Content-Type": "application/json"}, json.dumps(doc).encode()


# -- the client's mapping -----------------------------------------------------------------------


def test_client_maps_the_corrupt_answer_to_object_integrity_error(canned) -> None:
    body = {"error": "bad \x1b[31m bytes", "hint": "h", "code": CORRUPT_CODE, "key": KEY}
    server = canned(lambda *_: _json(CORRUPT_STATUS, body))
    store = open_store(server.url, retries=3, backoff=0.001)
    with pytest.raises(ObjectIntegrityError) as e:
        store.get(KEY)
    assert e.value.context["key"] == KEY and e.value.context["store"] == server.url
    assert "\x1b" not in str(e.value)  # the relay's text is repr'd, never printed raw
    assert server.requests == 1  # not retried: the same bytes are at the origin
    with pytest.raises(ObjectIntegrityError):
        store.get_range(KEY, 0, 10)
    assert server.requests == 2


@pytest.mark.parametrize(
    "answer",
    [
        _json(409, {"error": "conflict", "hint": None}),  # a 409 without the code
        _json(409, {"code": CORRUPT_CODE, "key": "runs/r/objects/other"}),  # another key
        _json(409, ["object_corrupt"]),
        (409, {}, b"{not json"),
        (409, {}, b"[" * 100_000),  # over the size and depth bounds
        _json(422, {"code": CORRUPT_CODE, "key": KEY}),  # the code under another status
    ],
    ids=["no-code", "other-key", "not-object", "not-json", "too-large", "other-status"],
)
def test_other_answers_are_store_errors_not_integrity_errors(canned, answer: Answer) -> None:
    server = canned(lambda *_: answer)
    store = open_store(server.url, retries=2, backoff=0.001)
    with pytest.raises(StoreError) as e:
        store.get(KEY)
    assert not isinstance(e.value, (ObjectIntegrityError, TransientStoreError))
    assert server.requests == 1


def test_a_corrupt_code_on_a_5xx_is_still_transient(canned) -> None:
    server = canned(lambda *_: _json(502, {"code": CORRUPT_CODE, "key": KEY}))
    store = open_store(server.url, retries=2, backoff=0.001)
    with pytest.raises(TransientStoreError):
        store.get(KEY)
    assert server.requests == 3


# -- the relay and a follower behind it ---------------------------------------------------------


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[Callable[..., RelayServer]]:
    servers: list[RelayServer] = []

    def start(upstream: object, name: str = "cache") -> RelayServer:
        server = RelayServer(upstream, RelayConfig(cache_dir=tmp_path / name))  # type: ignore[arg-type]
        server.start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()


def _corrupt(board: Board, key: str) -> bytes:
    good = board.store.get(key)
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x40  # same size: only a hash can tell
    board.store.put(key, bytes(bad), if_absent=False)
    return good


def test_relay_answers_409_object_corrupt_and_passes_it_down_a_chain(board: Board, relay) -> None:
    key = step_objects(board, 19, LAST, 0)[0]
    good = _corrupt(board, key)
    near = relay(board.store, "near")
    far = relay(near.url, "far")
    for server in (near, far):
        r = httpx.get(f"{server.url}/v1/objects/{key}")
        assert r.status_code == CORRUPT_STATUS, r.text
        doc = r.json()
        assert (doc["code"], doc["key"]) == (CORRUPT_CODE, key)
        # the edge kit's error body (one shape for sidecar, gateway and relay)
        assert (doc["error"]["type"], doc["error"]["code"]) == (CORRUPT_CODE, CORRUPT_STATUS)
        assert ("BLAKE3" if server is near else "corrupt") in doc["error"]["message"]
        with pytest.raises(ObjectIntegrityError) as e:
            open_store(server.url, retries=0).get(key)
        assert e.value.context["key"] == key
        # the client quotes the relay's message from the edge kit's body
        assert ("BLAKE3" if server is near else "corrupt") in str(e.value.context["relay_error"])
        assert key not in server.relay.cache
    metric = near.relay.metrics.value
    # the near relay pulled the bad bytes once; the three later requests cost a HEAD each
    # (the origin's ETag unchanged: the same bad copy), not another transfer
    assert metric("rollpatch_relay_refused_total", reason="hash_mismatch") == 1
    assert metric("rollpatch_relay_refused_total", reason="known_corrupt") == 3
    assert metric("rollpatch_relay_upstream_bytes_total") == len(good)
    board.store.put(key, good, if_absent=False)  # repaired at the origin: served at once
    assert open_store(far.url, retries=0).get(key) == good
    assert key in near.relay.cache and key in far.relay.cache


def test_an_object_larger_than_its_manifest_names_is_refused_unread(board: Board, relay) -> None:
    """A store writer swaps a patch object for a much larger one: the relay read objects
    whole before it hashed them (a follower's reads are bounded since session 40; the relay
    did not know an object's size). It now reads no more than the size a manifest it checked
    names: refused as corrupt before the body crosses (nothing of it counted upstream), and
    its followers plan around it as around any corrupt object."""
    from rollpatch.layout import version_key

    key = step_objects(board, 19, LAST, 0)[0]
    near = relay(board.store, "near")
    man = next(
        version_key(RUN, v)
        for v in board.versions(RUN)
        if key in {o.key for o in board.manifest(RUN, v).objects()}
    )
    assert httpx.get(f"{near.url}/v1/objects/{man}").status_code == 200  # checked: size noted
    good = board.store.get(key)
    board.store.put(key, good + bytes(8 << 20), if_absent=False)
    before = near.relay.metrics.value("rollpatch_relay_upstream_bytes_total")
    r = httpx.get(f"{near.url}/v1/objects/{key}")
    assert r.status_code == CORRUPT_STATUS and r.json()["code"] == CORRUPT_CODE, r.text
    assert "larger than its manifest names" in r.json()["error"]["message"]
    metric = near.relay.metrics.value
    assert metric("rollpatch_relay_refused_total", reason="too_large") == 1
    assert metric("rollpatch_relay_upstream_bytes_total") == before  # nothing of it came
    board.store.put(key, good, if_absent=False)
    assert open_store(near.url, retries=0).get(key) == good  # repaired: served


def test_a_remembered_refusal_can_be_turned_off(board: Board, tmp_path: Path) -> None:
    key = step_objects(board, 19, LAST, 0)[0]
    _corrupt(board, key)
    server = RelayServer(board.store, RelayConfig(cache_dir=tmp_path / "c", corrupt_ttl=0))
    server.start()
    try:
        for _ in range(3):
            assert httpx.get(f"{server.url}/v1/objects/{key}").status_code == CORRUPT_STATUS
        metric = server.relay.metrics.value
        assert metric("rollpatch_relay_refused_total", reason="hash_mismatch") == 3
        assert metric("rollpatch_relay_refused_total", reason="known_corrupt") == 0
    finally:
        server.stop()


@pytest.mark.parametrize("have", [None, 19], ids=["keyframe", "patch"])
def test_a_follower_behind_a_relay_plans_around_a_corrupt_origin_object(
    board: Board, published: Published, relay, have: int | None
) -> None:
    key = step_objects(board, have, LAST, 0)[0]  # newest keyframe / first patch on the path
    _corrupt(board, key)
    server = relay(board.store)
    engine = engine_at(published, have)
    f = Follower(Board(open_store(server.url, retries=0)), RUN, engine, FAST)
    assert f.sync() == LAST
    assert_holds(engine, published.views[LAST])
    used = [o.key for s in (f.last_plan.steps if f.last_plan else ()) for o in s.objects]
    assert key not in used
    assert f.status().state is FollowerState.IDLE


class _LyingRelay:
    """Forwards to a real relay, but calls the objects in ``lies`` corrupt (409)."""

    def __init__(self, canned, upstream: str, lies: Callable[[str], bool]) -> None:
        def answer(method: str, path: str, asked: dict[str, str]) -> Answer:
            key = path.removeprefix("/v1/objects/")
            if path.startswith("/v1/objects/") and method == "GET" and lies(key):
                return _json(CORRUPT_STATUS, {"error": "lie", "code": CORRUPT_CODE, "key": key})
            forward = {k: v for k, v in asked.items() if k.lower() == "range"}
            request = urllib.request.Request(upstream + path, method=method, headers=forward)
            try:
                with urllib.request.urlopen(request, timeout=10) as r:
                    status, headers, body = r.status, dict(r.headers), r.read()
            except urllib.error.HTTPError as e:
                with e:
                    status, headers, body = e.code, dict(e.headers), e.read()
            keep = ("content-length", "content-type", "content-range", "etag")
            return status, {k.title(): v for k, v in headers.items() if k.lower() in keep}, body

        self.server = canned(answer)
        self.url = self.server.url


def test_a_lying_relay_causes_a_detour_never_other_bits(
    board: Board, published: Published, relay, canned
) -> None:
    honest = relay(board.store)
    sound = step_objects(board, None, LAST, 0)[0]  # nothing is corrupt: the relay lies
    liar = _LyingRelay(canned, honest.url, lambda k: k == sound)
    engine = engine_at(published, None)
    f = Follower(Board(open_store(liar.url, retries=0)), RUN, engine, FAST)
    assert f.sync() == LAST  # a detour: another keyframe and a longer chain
    assert_holds(engine, published.views[LAST])
    assert sound not in [
        o.key for s in (f.last_plan.steps if f.last_plan else ()) for o in s.objects
    ]

    everything = _LyingRelay(canned, honest.url, lambda k: "/objects/" in k)
    engine = engine_at(published, 19)
    g = Follower(Board(open_store(everything.url, retries=0)), RUN, engine, FAST)
    with pytest.raises(ObjectIntegrityError):
        g.sync()  # no way around: the sync fails, the engine keeps its last good version
    assert g.status().state is FollowerState.ERROR
    assert (engine.version, g.version) == (19, 19)
    assert_holds(engine, published.views[19])
