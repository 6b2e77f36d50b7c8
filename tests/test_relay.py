"""The regional relay: protocol, freshness, coalescing, verification, cache, chains, CLI.

Boards live in ``memory://`` stores written through :class:`Board`; relays are real uvicorn
servers on loopback ports, read through the ``http://`` store client, the same way followers
read them. Upstream reads are counted by :class:`Counting`, a store that wraps the board's.
"""

from __future__ import annotations

import collections
import http.client
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rollpatch.board import Board, version_key
from rollpatch.errors import (
    ConfigError,
    NotFoundError,
    ObjectIntegrityError,
    StoreError,
    TransientStoreError,
)
from rollpatch.manifest import KeyframeObject, PatchObject
from rollpatch.relay import KeyKind, RelayConfig, RelayServer, classify
from rollpatch.relay.server import RangeNotSatisfiable, parse_range
from rollpatch.store import ObjectInfo, Store, open_store
from rollpatch.types import ObjectRef
from tests.conftest import free_port, make_manifest

D = "d" * 64
RUN = "r1"


class Counting(Store):
    """Delegates to ``inner`` and counts reads per (op, key); can be slowed down or cut off."""

    def __init__(self, inner: Store, delay: float = 0.0) -> None:
        self.inner, self.delay, self.offline = inner, delay, False
        self.uri = f"counting+{inner.uri}"
        self.reads: collections.Counter[tuple[str, str]] = collections.Counter()
        self._lock = threading.Lock()

    def count(self, op: str, key: str) -> None:
        with self._lock:
            self.reads[(op, key)] += 1
        if self.offline:
            raise TransientStoreError("upstream is offline (test)", key=key)
        time.sleep(self.delay)

    def gets(self, key: str) -> int:
        return self.reads[("get", key)]

    def _get(self, key: str) -> bytes:
        self.count("get", key)
        return self.inner.get(key)

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        self.count("get", key)
        return self.inner.get_range(key, start, end)

    def _list(self, prefix: str) -> list[str]:
        self.count("list", prefix)
        return self.inner.list(prefix)

    def _head(self, key: str) -> ObjectInfo | None:
        self.count("head", key)
        return self.inner.head(key)

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        self.inner.put(key, data, if_absent=if_absent)

    def _delete(self, key: str) -> None:
        self.inner.delete(key)

    def _cas(self, key: str, data: bytes, *, expected: bytes | None) -> None:
        self.inner.cas(key, data, expected=expected)


def publish(board: Board, n: int, *, keyframe: bool = False, size: int = 3000) -> list[ObjectRef]:
    """Publish version ``n`` of RUN (a patch from n-1, a keyframe if asked); its objects."""
    pats, kfs = [], []
    if n > 0:
        pats.append(PatchObject(board.put_object(RUN, os.urandom(size), "rpatch"), n - 1, D))
    if keyframe:
        kfs.append(KeyframeObject(board.put_object(RUN, os.urandom(size * 4), "safetensors")))
    m = make_manifest(
        RUN, n, target=D, view_bytes=size * 4, patches=tuple(pats), keyframes=tuple(kfs)
    )
    board.put_manifest(m)
    board.advance(RUN, n)
    return m.objects()


@pytest.fixture
def board(memory_board: Board) -> Board:
    return memory_board


@pytest.fixture
def objects(board: Board) -> list[ObjectRef]:
    return [ref for n in range(5) for ref in publish(board, n, keyframe=n in (0, 3))]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[object]:
    """``serve(upstream, **config) -> RelayServer`` (started); every server is stopped after."""
    servers: list[RelayServer] = []

    def start(upstream: Store | str, cache: str = "cache", **options: object) -> RelayServer:
        server = RelayServer(upstream, RelayConfig(cache_dir=tmp_path / cache, **options))
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def client(server: RelayServer) -> Store:
    return open_store(server.url, retries=0, timeout=10)


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
    with pytest.raises(TransientStoreError):  # 502: clients retry 5xx, then give up
        c.get(bad_manifest)
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
