"""Contract tests for rollpatch.store, run against every backend.

file and memory run in-process; s3 runs against moto's standalone server as a real process on
loopback (tests/s3server.py); http reads through a stdlib relay that serves a FileStore by the
protocol in docs/store.md. Without moto the S3 tests fail at setup, unless ROLLPATCH_SKIP_S3=1.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from rollpatch.errors import (
    AlreadyExistsError,
    ConfigError,
    ConflictError,
    NotFoundError,
    StoreError,
    TransientStoreError,
)
from rollpatch.store import FileStore, HttpStore, Store, open_store
from rollpatch.store.config import HttpConfig, s3_config_from
from tests.conftest_s3 import BUCKET, Interloper, MiB, make_s3_store, pair, relay, store
from tests.s3server import S3Server, free_port

_FIXTURES = (pair, relay, store)  # used by name in the tests below (s3_server: tests/conftest.py)


# -- the contract -----------------------------------------------------------------------------


@pytest.mark.parametrize("data", [b"", b"x", bytes(range(256)) * 41])
def test_put_get_roundtrip(pair: tuple[Store, Store], data: bytes) -> None:
    writer, reader = pair
    writer.put("a/b/obj", data)
    assert reader.get("a/b/obj") == data
    info = reader.head("a/b/obj")
    assert info is not None and info.size == len(data) and info.key == "a/b/obj"


def test_put_accepts_bytes_like(store: Store) -> None:
    store.put("ba", bytearray(b"abc"))
    store.put("mv", memoryview(b"xabcx")[1:4])
    assert store.get("ba") == store.get("mv") == b"abc"


def test_missing_key(pair: tuple[Store, Store]) -> None:
    _, reader = pair
    with pytest.raises(NotFoundError):
        reader.get("no/such")
    with pytest.raises(KeyError):  # NotFoundError is a KeyError too
        reader.get_range("no/such", 0, 1)
    with pytest.raises(NotFoundError):
        reader.get_range("no/such", 0, 0)
    assert reader.head("no/such") is None


def test_put_if_absent_refuses_overwrite(store: Store) -> None:
    store.put("v/1", b"first")
    with pytest.raises(AlreadyExistsError):
        store.put("v/1", b"second")
    assert store.get("v/1") == b"first"
    store.put("v/1", b"third", if_absent=False)
    assert store.get("v/1") == b"third"


def test_list_sorted_and_string_prefix(pair: tuple[Store, Store]) -> None:
    writer, reader = pair
    keys = ["b/2", "a/x", "a/b/c", "ab", "a/bc", "b/10", "é/1", "Z"]
    for k in keys:
        writer.put(k, k.encode())
    assert reader.list() == sorted(keys)
    assert reader.list("a/") == ["a/b/c", "a/bc", "a/x"]
    assert reader.list("a/b") == ["a/b/c", "a/bc"]  # a string prefix, not a folder
    assert reader.list("a") == ["a/b/c", "a/bc", "a/x", "ab"]
    assert reader.list("b/1") == ["b/10"]
    assert reader.list("nothing") == [] and reader.list("a/b/c/") == []


def test_get_range_bounds(pair: tuple[Store, Store]) -> None:
    writer, reader = pair
    data = bytes(range(100))
    writer.put("r", data)
    assert reader.get_range("r", 0, 100) == data
    assert reader.get_range("r", 10, 20) == data[10:20]
    assert reader.get_range("r", 99, 100) == data[99:]
    assert reader.get_range("r", 100, 100) == b"" and reader.get_range("r", 5, 5) == b""
    for start, end in [(0, 101), (50, 200), (100, 101), (150, 160), (-1, 5), (5, 4)]:
        with pytest.raises(ConfigError, match="range"):
            reader.get_range("r", start, end)
    with pytest.raises(ConfigError, match="size=100"):
        reader.get_range("r", 90, 101)


def test_delete_is_idempotent(store: Store) -> None:
    store.put("d/1", b"x")
    store.put("d/2", b"y")
    store.delete("d/1")
    assert store.head("d/1") is None and store.list("d/") == ["d/2"]
    with pytest.raises(NotFoundError):
        store.get("d/1")
    store.delete("d/1")
    store.delete("never/was")
    store.put("d/1", b"again")  # a deleted key can be published anew
    assert store.get("d/1") == b"again"


def test_cas(store: Store) -> None:
    store.cas("LATEST", b"1", expected=None)
    with pytest.raises(ConflictError):
        store.cas("LATEST", b"9", expected=None)
    store.cas("LATEST", b"2", expected=b"1")
    with pytest.raises(ConflictError):
        store.cas("LATEST", b"3", expected=b"1")
    assert store.get("LATEST") == b"2"
    with pytest.raises(ConflictError):
        store.cas("other", b"1", expected=b"0")  # expected content, but the key is absent
    assert store.head("other") is None
    with pytest.raises(AlreadyExistsError):
        store.put("LATEST", b"x")


def test_head_etag_changes_with_content(store: Store) -> None:
    store.put("h", b"one")
    first = store.head("h")
    store.cas("h", b"two!", expected=b"one")
    second = store.head("h")
    assert first is not None and second is not None and second.size == 4
    if first.etag is not None:
        assert first.etag != second.etag


def test_large_object(store: Store) -> None:
    data = os.urandom(12 * MiB + 123)  # > the 5 MiB multipart threshold set for s3
    store.put("big/obj", data)
    assert store.get("big/obj") == data
    for a, b in [(0, 1), (5 * MiB - 3, 5 * MiB + 3), (MiB, 11 * MiB), (len(data) - 7, len(data))]:
        assert store.get_range("big/obj", a, b) == data[a:b]
    info = store.head("big/obj")
    assert info is not None and info.size == len(data)
    if store.uri.startswith("s3://"):
        assert info.etag is not None and info.etag.strip('"').endswith("-3")  # 3 parts
    with pytest.raises(AlreadyExistsError):
        store.put("big/obj", data[: 6 * MiB])
    store.put("big/obj", data[: 6 * MiB], if_absent=False)
    assert store.get("big/obj") == data[: 6 * MiB]


BAD_KEYS = [
    "",
    "/a",
    "a/",
    "a//b",
    "..",
    "../a",
    "a/../b",
    "./a",
    "a/.",
    "a\nb",
    "a\x00b",
    "tab\tkey",
    "x" * 1025,
    "é" * 513,
    ".rp-tmp-1",
    "a/.rp-locks/b",
]


@pytest.mark.parametrize("key", BAD_KEYS, ids=range(len(BAD_KEYS)))
def test_invalid_keys(pair: tuple[Store, Store], key: str) -> None:
    writer, reader = pair
    for call in (
        lambda: reader.get(key),
        lambda: reader.get_range(key, 0, 1),
        lambda: reader.head(key),
        lambda: writer.put(key, b"x"),
        lambda: writer.delete(key),
        lambda: writer.cas(key, b"x", expected=None),
    ):
        with pytest.raises(ConfigError):
            call()
    for prefix in ["/a", "a\nb", "x" * 1025]:
        with pytest.raises(ConfigError):
            reader.list(prefix)


def test_odd_but_valid_keys(pair: tuple[Store, Store]) -> None:
    writer, reader = pair
    keys = ["sp ace/x%20y+z?#&=", "ü/ñ/中文", ".hidden/ok", "a..b/c.d", "x" * 200 + "/" + "y" * 200]
    for k in keys:
        writer.put(k, k.encode())
    assert reader.list() == sorted(keys)
    assert all(reader.get(k) == k.encode() for k in keys)


# -- backend specifics ------------------------------------------------------------------------


def test_http_store_is_read_only(relay: tuple[Store, HttpStore]) -> None:
    backing, reader = relay
    backing.put("k", b"v")
    for call in (
        lambda: reader.put("k2", b"v"),
        lambda: reader.delete("k"),
        lambda: reader.cas("k", b"w", expected=b"v"),
    ):
        with pytest.raises(StoreError, match="read-only") as err:
            call()
        assert type(err.value) is StoreError
    assert reader.get("k") == b"v" and not reader.writable


def test_unreachable_remotes_are_transient() -> None:
    port = free_port()  # nothing listens there
    with pytest.raises(TransientStoreError):
        HttpStore(f"http://127.0.0.1:{port}", HttpConfig(retries=1, backoff=0)).get("k")
    pytest.importorskip("boto3")
    s3 = open_store(
        f"s3://{BUCKET}/p",
        endpoint_url=f"http://127.0.0.1:{port}",
        access_key_id="a",
        secret_access_key="b",
        max_attempts=1,
        connect_timeout=1.0,
    )
    with pytest.raises(TransientStoreError):
        s3.get("k")


def test_s3_missing_bucket_is_not_a_missing_key(request: pytest.FixtureRequest) -> None:
    server: S3Server = request.getfixturevalue("s3_server")
    s3 = open_store("s3://no-such-bucket-rp/p", **server.options(max_attempts=1))
    with pytest.raises(StoreError, match="bucket") as err:
        s3.get("k")
    assert not isinstance(err.value, NotFoundError)


def test_s3_conditions_are_enforced_by_the_server(request: pytest.FixtureRequest) -> None:
    """Bypass the client-side checks: the refusals must come from the server (412)."""
    s3: Any = make_s3_store(request)
    s3.put("k", b"v1")
    stale = s3.head("k").etag
    s3.cas("k", b"v2", expected=b"v1")
    with pytest.raises(ConflictError, match="412"):  # If-Match with a stale ETag
        s3._put_single("k", b"v3", {"IfMatch": stale}, on_fail=ConflictError)
    with pytest.raises(AlreadyExistsError):  # If-None-Match: * on PutObject
        s3._put_single("k", b"v3", {"IfNoneMatch": "*"}, on_fail=AlreadyExistsError)
    big = os.urandom(11 * MiB)
    s3.put("big", big)
    with pytest.raises(AlreadyExistsError):  # If-None-Match: * on CompleteMultipartUpload
        s3._put_multipart("big", memoryview(big[::-1]), if_absent=True)
    assert s3.get("k") == b"v2" and s3.get("big") == big
    s3.close()


def test_s3_cas_loses_to_a_write_between_read_and_swap(request: pytest.FixtureRequest) -> None:
    s3: Any = make_s3_store(request)
    s3.put("LATEST", b"1")
    real = s3._client
    s3._client = Interloper(
        real, lambda: real.put_object(Bucket=BUCKET, Key=s3.config.prefix + "LATEST", Body=b"7")
    )
    with pytest.raises(ConflictError):
        s3.cas("LATEST", b"2", expected=b"1")  # read 1, then If-Match on the stale ETag
    s3._client = real
    assert s3.get("LATEST") == b"7"
    s3.close()


def test_file_store_key_clash_and_bookkeeping(tmp_path: Path) -> None:
    s = FileStore(tmp_path / "st")
    s.put("a", b"1")
    with pytest.raises(StoreError, match="clashes"):
        s.put("a/b", b"2")
    s.put("c/d", b"3")
    with pytest.raises(StoreError, match="clashes") as err:
        s.put("c", b"4")
    assert not isinstance(err.value, AlreadyExistsError)
    assert s.head("c") is None and s.get("c/d") == b"3"
    s.cas("p", b"1", expected=None)
    (tmp_path / "st" / "c" / ".rp-tmp-deadbeef").write_bytes(b"crash leftover")
    assert s.list() == ["a", "c/d", "p"]


def test_open_store_uris(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(open_store(str(tmp_path / "s1")), FileStore)
    f = open_store((tmp_path / "s2").as_uri(), fsync=False)
    assert isinstance(f, FileStore) and f.uri == (tmp_path / "s2").as_uri()
    monkeypatch.chdir(tmp_path)
    assert open_store("rel/dir").uri == (tmp_path / "rel" / "dir").as_uri()
    m1, m2 = open_store("memory://shared-name"), open_store("memory://shared-name")
    m1.put("k", b"v", if_absent=False)
    assert m2.get("k") == b"v"
    assert open_store("http://h:1/relay/").uri == "http://h:1/relay"
    for uri, options in [
        ("ftp://x", {}),
        ("memory://", {}),
        ("file://host/x", {}),
        ("s3:///p", {}),
        ("s3://b/../x", {}),
        ("memory://x", {"a": 1}),
        ("/tmp/x", {"bogus": 1}),
        ("http://h/x?q=1", {}),
        ("http://h", {"timeout": 0}),
        ("s3://b", {"part_size": 1}),
        ("s3://b", {"bogus": 1}),
    ]:
        with pytest.raises(ConfigError):
            open_store(uri, **options)


def test_s3_config_reads_environment_in_one_place() -> None:
    env = {
        "AWS_ENDPOINT_URL": "http://aws-env",
        "ROLLPATCH_S3_ENDPOINT_URL": "http://rp-env",
        "AWS_REGION": "",
        "AWS_DEFAULT_REGION": "eu-west-1",
    }
    c = s3_config_from("b", "p/", {}, env)
    assert (c.endpoint_url, c.region, c.prefix) == ("http://rp-env", "eu-west-1", "p/")
    c = s3_config_from("b", "", {"endpoint_url": "http://explicit", "part_size": 8 * MiB}, env)
    assert c.endpoint_url == "http://explicit" and c.part_size == 8 * MiB
    with pytest.raises(ConfigError, match="part_size"):
        s3_config_from("b", "", {"part_size": MiB}, {})
    with pytest.raises(ConfigError, match="go together"):
        s3_config_from("b", "", {"access_key_id": "a"}, {})


# -- concurrency ------------------------------------------------------------------------------


def test_threads_race_put_if_absent(store: Store) -> None:
    winners: list[int] = []
    barrier = threading.Barrier(8)

    def worker(i: int) -> None:
        barrier.wait()
        try:
            store.put("race", str(i).encode())
            winners.append(i)
        except AlreadyExistsError:
            pass

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1 and store.get("race") == str(winners[0]).encode()


def _race_put(root: str, n_keys: int, worker: int, barrier: Any, out: Any) -> None:
    s = FileStore(root)
    barrier.wait()
    won = []
    for k in range(n_keys):
        try:
            s.put(f"d{k}/e/obj", f"{worker}".encode() * 1000)  # folders race too
            won.append(k)
        except AlreadyExistsError:
            pass
    out.put((worker, won))


def _race_cas(root: str, rounds: int, worker: int, barrier: Any, out: Any) -> None:
    s = FileStore(root)
    barrier.wait()
    seen = []
    for _ in range(rounds):
        while True:
            cur = s.get("counter")
            try:
                s.cas("counter", str(int(cur) + 1).encode(), expected=cur)
                seen.append(int(cur))
                break
            except ConflictError:
                continue
    out.put((worker, seen))


def _worker(body: str, root: str, arg: int, worker: int, barrier: Any, out: Any) -> None:
    """Process entry point: run ``_race_<body>``; on failure send the traceback instead."""
    try:
        {"put": _race_put, "cas": _race_cas}[body](root, arg, worker, barrier, out)
    except BaseException:  # noqa: BLE001 (the parent fails the test with this traceback)
        import traceback

        out.put((worker, traceback.format_exc()))


def _run_procs(body: str, root: Path, n: int, arg: int) -> list[tuple[int, list[int]]]:
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(body, str(root), arg, i, barrier, out)) for i in range(n)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    failures = [r for _, r in results if isinstance(r, str)]
    assert not failures, failures[0]
    return results


def test_file_processes_race_put_if_absent(tmp_path: Path) -> None:
    """8 processes publish the same 40 keys, each in folders nobody created yet: each key has
    exactly one winner, whose bytes stay, and no process trips over another's new folders."""
    results = _run_procs("put", tmp_path / "st", 8, 40)
    s = FileStore(tmp_path / "st")
    for k in range(40):
        owners = [w for w, won in results if k in won]
        assert len(owners) == 1, (k, owners)
        assert s.get(f"d{k}/e/obj") == f"{owners[0]}".encode() * 1000
    assert len(s.list()) == 40
    assert not any(".rp-tmp" in p.name for p in (tmp_path / "st").rglob("*"))


def test_file_processes_race_cas_no_lost_update(tmp_path: Path) -> None:
    """4 processes increment one counter 25 times each through cas: the total is exact."""
    FileStore(tmp_path / "st").cas("counter", b"0", expected=None)
    results = _run_procs("cas", tmp_path / "st", 4, 25)
    assert FileStore(tmp_path / "st").get("counter") == b"100"
    transitions = sorted(v for _, seen in results for v in seen)
    assert transitions == list(range(100))  # every old value was swapped out exactly once


# -- hostile trees (issue 11) -------------------------------------------------------------------

HOSTILE_PREFIXES = [
    "../../..",
    "..",
    "a/../b",
    "a/..",
    "./a",
    "a/./",
    "a//b",
    "/etc",
    "a\\..\\b",
    "..\\x",
    "a\x00b",
    "a\nb",
    "\ud800",
    ".rp-locks/",
]


@pytest.mark.parametrize("prefix", HOSTILE_PREFIXES, ids=range(len(HOSTILE_PREFIXES)))
def test_list_prefixes_are_validated_like_keys(tmp_path: Path, prefix: str) -> None:
    store = FileStore(tmp_path / "board", fsync=False)
    with pytest.raises(ConfigError):
        store.list(prefix)
    with pytest.raises(ConfigError):
        store.get(prefix.rstrip("/") or "x/..")
    assert store.list("a/") == [] and store.list("a/b") == []  # partial segments are fine


def _read_in_thread(call: Any) -> BaseException | None:
    """Run ``call`` in a thread so a store that blocks (a FIFO) fails the test, not hangs it."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            out.append(None)
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert out, "the read blocked"
    return out[0]


def test_file_store_refuses_links_and_special_files(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"root:x:0:0")
    root = tmp_path / "board"
    store = FileStore(root, fsync=False)
    store.put("runs/r1/ok", b"fine")
    os.symlink(secret, root / "runs" / "r1" / "link")  # a file outside the board
    os.symlink(tmp_path, root / "runs" / "r1" / "dirlink")  # a folder outside it
    os.symlink(root / "runs" / "r1" / "ok", root / "runs" / "r1" / "inside")  # even inside
    os.mkfifo(root / "runs" / "r1" / "fifo")
    for key in ("runs/r1/link", "runs/r1/dirlink/secret", "runs/r1/inside", "runs/r1/fifo"):
        for call in (lambda k=key: store.get(k), lambda k=key: store.get_range(k, 0, 1)):
            err = _read_in_thread(call)
            assert isinstance(err, NotFoundError), (key, err)
        assert store.head(key) is None, key
    assert store.list("") == store.list("runs/") == ["runs/r1/ok"]
    assert store.list("runs/r1/dirlink/") == [] and store.list("runs/r1/l") == []
    assert store.get("runs/r1/ok") == b"fine" and store.head("runs/r1/ok") is not None
