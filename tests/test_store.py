"""Contract tests for rollpatch.store, run against every backend.

file and memory run in-process; s3 runs against moto's standalone server as a real process on
loopback (tests/s3server.py); http reads through a stdlib relay that serves a FileStore by the
protocol in docs/store.md. Without moto the S3 tests fail at setup, unless ROLLPATCH_SKIP_S3=1.
Each backend's specifics and hostile trees: test_store_backends.py; concurrent writers:
test_store_concurrency.py.
"""

from __future__ import annotations

import os

import pytest

from rollpatch.errors import (
    AlreadyExistsError,
    ConfigError,
    ConflictError,
    NotFoundError,
    TooLargeError,
)
from rollpatch.store import Store
from tests.conftest_s3 import MiB, pair, relay, store

_FIXTURES = (pair, relay, store)  # used by name in the tests below (s3_server: tests/conftest.py)


# -- the contract -----------------------------------------------------------------------------


@pytest.mark.parametrize("data", [b"", b"x", bytes(range(256)) * 41])
def test_put_get_roundtrip(pair: tuple[Store, Store], data: bytes) -> None:
    writer, reader = pair
    writer.put("a/b/obj", data)
    assert reader.get("a/b/obj") == data
    info = reader.head("a/b/obj")
    assert info is not None and info.size == len(data) and info.key == "a/b/obj"


def test_a_bounded_get_refuses_a_larger_object(pair: tuple[Store, Store]) -> None:
    """``get(key, max_bytes=)``: what a reader expects at most (a manifest entry's size); a
    larger object is refused (every backend here before its body is read: the file's size,
    S3's first part, the relay's Content-Length), so a store writer cannot pick what a
    reader allocates (an audit, session 40: a 4 GB object took 8.4 GB of a follower)."""
    writer, reader = pair
    writer.put("a/big", b"x" * (3 * MiB))
    writer.put("a/small", b"y" * 10)
    writer.put("a/empty", b"")
    assert reader.get("a/small", max_bytes=10) == reader.get("a/small", max_bytes=11) == b"y" * 10
    assert reader.get("a/empty", max_bytes=0) == b""
    for key, bound in (("a/big", 1024), ("a/small", 9)):
        with pytest.raises(TooLargeError) as refused:
            reader.get(key, max_bytes=bound)
        assert refused.value.context["max_bytes"] == bound
        assert refused.value.context["size"] == len(writer.get(key)), refused.value.context
    with pytest.raises(NotFoundError):
        reader.get("a/none", max_bytes=1)
    with pytest.raises(ConfigError):
        reader.get("a/small", max_bytes=-1)


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
