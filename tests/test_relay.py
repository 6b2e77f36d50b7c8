"""The regional relay: protocol, freshness, coalescing, metrics, configuration, CLI.

The relays are real uvicorn servers on loopback ports, read through the ``http://`` store
client (tests/relayfix.py). Its cache, verification and chains: test_relay_cache.py.
"""

from __future__ import annotations

import http.client
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import httpx
import pytest

from rollpatch.board import Board, version_key
from rollpatch.errors import ConfigError, NotFoundError
from rollpatch.relay import KeyKind, RelayConfig, classify
from rollpatch.relay.server import RangeNotSatisfiable, parse_range
from rollpatch.store import open_store
from rollpatch.types import ObjectRef
from tests.conftest import free_port
from tests.relayfix import RUN, Counting, board, client, objects, publish, serve

_FIXTURES = (board, objects, serve)  # used by name


def test_reads_through_the_relay(board: Board, objects: list[ObjectRef], serve) -> None:
    relay = serve(board.store, list_page=3)
    c = client(relay)
    ref = objects[1]
    data = board.store.get(ref.key)
    assert c.get(ref.key) == data
    assert c.get_range(ref.key, 10, 50) == data[10:50]
    assert c.get_range(ref.key, ref.size - 5, ref.size) == data[-5:]
    assert c.get_range(ref.key, 7, 7) == b""
    info = c.head(ref.key)
    assert info is not None and info.size == ref.size and info.etag == f'"{ref.b3}"'
    assert c.head(objects[2].key) is not None  # uncached: answered by a HEAD upstream
    assert c.list("runs/") == board.store.list("runs/")  # paged by 3: the client follows next
    assert c.list(f"runs/{RUN}/versions/") == [version_key(RUN, n) for n in range(5)]
    assert c.list("nothing/") == []
    marker = f"runs/{RUN}/keyframes/{0:012d}"  # empty objects work too
    assert c.get(marker) == b"" and c.get_range(marker, 0, 0) == b"" and c.head(marker)
    with pytest.raises(NotFoundError):
        c.get(f"runs/{RUN}/objects/{'0' * 64}.rpatch")
    assert c.head(f"runs/{RUN}/objects/{'0' * 64}.rpatch") is None
    with pytest.raises(ConfigError):
        c.get_range(ref.key, 0, ref.size + 1)
    odd = "misc/a key with spaces, % and é"  # outside the layout: relayed with a short TTL
    board.store.put(odd, b"odd bytes")
    assert c.get(odd) == b"odd bytes" and classify(odd) is KeyKind.OTHER


def test_raw_protocol_answers(board: Board, objects: list[ObjectRef], serve) -> None:
    relay = serve(board.store)
    ref = objects[0]
    url = f"{relay.url}/v1/objects/{ref.key}"
    with httpx.Client() as h:
        r = h.get(url, headers={"Range": "bytes=5-"})
        assert r.status_code == 206 and len(r.content) == ref.size - 5
        assert r.headers["content-range"] == f"bytes 5-{ref.size - 1}/{ref.size}"
        r = h.get(url, headers={"Range": f"bytes=0-{ref.size + 100}"})
        assert r.status_code == 206 and len(r.content) == ref.size
        for bad in (f"bytes={ref.size}-", "bytes=-10", "bytes=0-1,5-6"):
            r = h.get(url, headers={"Range": bad})
            assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{ref.size}"
        r = h.head(url)
        assert r.status_code == 200 and r.headers["content-length"] == str(ref.size)
        assert "immutable" in r.headers["cache-control"]
        assert h.get(f"{relay.url}/v1/list", params={"prefix": "/abs"}).status_code == 400
        assert h.get(f"{relay.url}/health").json()["status"] == "ok"
        # a board URL without the relay's /v1/objects (a path of the store's own): named
        r = h.get(f"{relay.url}/runs/r/LATEST")
        assert r.status_code == 404 and "GET /v1/objects/{key}" in r.json()["error"]["message"]
        r = h.post(f"{relay.url}/v1/list")
        assert r.status_code == 405 and "does not take POST" in r.json()["error"]["message"]
    conn = http.client.HTTPConnection("127.0.0.1", relay.port, timeout=10)
    for path in ("/v1/objects/runs//x", "/v1/objects/runs/../x", "/v1/objects/"):
        conn.request("GET", path)
        r = conn.getresponse()
        assert r.status == 400 and b"error" in r.read(), path
    conn.close()


def test_latest_and_listings_stay_fresh(board: Board, objects: list[ObjectRef], serve) -> None:
    relay = serve(board.store, pointer_ttl=0.3, list_ttl=0.3)
    follower = Board(client(relay))
    assert follower.latest(RUN).version == 4  # type: ignore[union-attr]
    assert follower.versions(RUN)[-1] == 4
    publish(board, 5)
    time.sleep(0.35)
    assert follower.latest(RUN).version == 5  # type: ignore[union-attr]
    assert follower.versions(RUN)[-1] == 5
    with httpx.Client() as h:
        r = h.get(f"{relay.url}/v1/objects/runs/{RUN}/LATEST")
        assert "immutable" not in r.headers["cache-control"] and r.headers["etag"]


def test_concurrent_requests_coalesce(board: Board, objects: list[ObjectRef], serve) -> None:
    upstream = Counting(board.store, delay=0.2)
    relay = serve(upstream)
    wanted = objects[:5]
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def island() -> None:
        c = client(relay)
        barrier.wait()
        try:
            for ref in wanted:
                assert c.get(ref.key) == board.store.get(ref.key)
        except Exception as e:  # noqa: BLE001 (asserted empty below)
            errors.append(e)

    threads = [threading.Thread(target=island) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [upstream.gets(ref.key) for ref in wanted] == [1] * 5
    metrics = relay.relay.metrics
    assert metrics.total("rollpatch_relay_coalesced_waits_total") > 0
    assert metrics.value("rollpatch_relay_cache_misses_total", kind="object") == 5
    assert metrics.total("rollpatch_relay_upstream_bytes_total") == sum(r.size for r in wanted)


def test_a_waiter_giving_up_leaves_the_flight_alone(
    board: Board, objects: list[ObjectRef], serve
) -> None:
    upstream = Counting(board.store, delay=0.5)
    relay = serve(upstream)
    ref = objects[0]
    assert relay.relay.resolve(ref.key).cancel() is False  # shared futures are not cancellable
    with pytest.raises(httpx.ReadTimeout):
        httpx.get(f"{relay.url}/v1/objects/{objects[1].key}", timeout=0.1)
    assert client(relay).get(objects[1].key) == board.store.get(objects[1].key)
    assert upstream.gets(ref.key) == 1 and upstream.gets(objects[1].key) == 1


def test_metrics_text(board: Board, objects: list[ObjectRef], serve) -> None:
    relay = serve(board.store)
    client(relay).get(objects[0].key)
    text = urllib.request.urlopen(f"{relay.url}/metrics", timeout=10).read().decode()
    for line in (
        'rollpatch_relay_requests_total{method="GET",route="objects",status="200"} 1',
        'rollpatch_relay_cache_misses_total{kind="object"} 1',
        f"rollpatch_relay_served_bytes_total {objects[0].size}",
        f"rollpatch_relay_upstream_bytes_total {objects[0].size}",
        "rollpatch_relay_cache_entries 1",
        "# TYPE rollpatch_relay_cache_bytes gauge",
    ):
        assert line in text.splitlines(), line


def test_answers_of_one_chunk_are_sent_whole_larger_ones_streamed(
    board: Board, objects: list[ObjectRef], serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cached object's answer of at most ``chunk_bytes`` is read at once (no thread hop per
    chunk); a larger one is streamed; the bytes, ranges and counters are the same either
    way, and a cache file shorter than its index is a clean error answer when sent whole."""
    from rollpatch.relay import server as relay_server

    streamed: list[int] = []
    real = relay_server._stream

    def spy(relay: object, f: object, length: int) -> object:
        streamed.append(length)
        return real(relay, f, length)  # type: ignore[arg-type]

    monkeypatch.setattr(relay_server, "_stream", spy)
    ref = max(objects, key=lambda r: r.size)
    chunk = ref.size // 3
    relay = serve(board.store, chunk_bytes=chunk)
    c = client(relay)
    data = board.store.get(ref.key)
    assert c.get(ref.key) == data == c.get(ref.key)  # cached, then served from its file
    assert streamed == [ref.size, ref.size]
    assert c.get_range(ref.key, 5, 5 + chunk) == data[5 : 5 + chunk]  # one chunk: whole
    assert c.get_range(ref.key, 0, chunk + 1) == data[: chunk + 1]  # streamed
    assert streamed == [ref.size, ref.size, chunk + 1]
    small = min(objects, key=lambda r: r.size)
    assert small.size <= chunk
    assert c.get(small.key) == board.store.get(small.key) == c.get(small.key)
    assert len(streamed) == 3
    f, entry = relay.relay.cache.open(small.key)
    f.close()
    with open(entry.path, "r+b") as g:  # shorter than the index says (a stray truncation)
        g.truncate(entry.offset + small.size - 1)
    r = httpx.get(f"{relay.url}/v1/objects/{small.key}")
    assert r.status_code >= 500 and b"shorter" in r.content


def test_config_and_ranges_are_validated(tmp_path: Path) -> None:
    from rollpatch.cli.relay import parse_size

    for bad in (
        {"cache_bytes": 0},
        {"pointer_ttl": -1},
        {"list_ttl": float("nan")},
        {"upstream_workers": 0},
        {"cache_bytes": True},
    ):
        with pytest.raises(ConfigError):
            RelayConfig(cache_dir=tmp_path, **bad)  # type: ignore[arg-type]
    assert [parse_size(s) for s in ("10G", "512MiB", "1000")] == [10 << 30, 512 << 20, 1000]
    assert parse_range(None, 10) is None and parse_range("items=0-1", 10) is None
    assert parse_range("bytes=2-4", 10) == (2, 4) and parse_range("bytes=2-", 10) == (2, 9)
    assert parse_range("bytes=5-2", 10) is None and parse_range("bytes=x-", 10) is None
    with pytest.raises(RangeNotSatisfiable):
        parse_range("bytes=0-0", 0)


def test_cli_serves_until_terminated(
    board: Board, objects: list[ObjectRef], tmp_path: Path
) -> None:
    root = tmp_path / "board"
    disk = Board(f"file://{root}")
    refs = [disk.put_object(RUN, board.store.get(ref.key), "rpatch") for ref in objects[:2]]
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollpatch",
            "relay",
            "--board",
            f"file://{root}",
            "--port",
            str(port),
            "--cache",
            str(tmp_path / "cli-cache"),
            "--cache-bytes",
            "64M",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline, "relay did not come up"
                time.sleep(0.1)
        c = open_store(f"http://127.0.0.1:{port}", retries=0)
        assert [c.get(r.key) for r in refs] == [disk.store.get(r.key) for r in refs]
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0 and f"at http://127.0.0.1:{port}" in out, out
