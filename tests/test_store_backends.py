"""Each store backend's specifics (read-only http, unreachable remotes, S3 conditions enforced
by moto's server as a real process, the file store's bookkeeping, URIs, S3 configuration from
the environment) and hostile trees (issue 11: list prefixes validated like keys; links and
special files refused).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Iterator
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
from tests.conftest_s3 import BUCKET, Interloper, MiB, make_s3_store, relay
from tests.s3server import S3Server, free_port

_FIXTURES = (relay,)  # used by name in the tests below (s3_server: tests/conftest.py)


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


def test_file_store_writes_never_follow_a_link_planted_in_the_board(tmp_path: Path) -> None:
    """Someone who can write to a file:// board (a shared folder) plants links: a folder link
    out of the board, a link as an object's name, a link for the lock folder. Before, the
    writer followed them (its objects, pointers and deletions landed outside the board: a
    file written, or removed, anywhere the trainer may write). Now every write works on
    folders reached without following links: a folder link is refused, a name that is a link
    is an existing name (put-if-absent) or is replaced itself, and nothing outside changes."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"precious")
    root = tmp_path / "board"
    store = FileStore(root, fsync=False)
    store.put("runs/r1/ok", b"fine")
    os.symlink(outside, root / "runs" / "r2")  # a folder of the board, pointing out of it
    os.symlink(outside / "keep", root / "runs" / "r1" / "obj")  # an object's name
    for write in (
        lambda: store.put("runs/r2/new", b"x"),
        lambda: store.put("runs/r2/deeper/new", b"x", if_absent=False),
        lambda: store.cas("runs/r2/LATEST", b"x", expected=None),
    ):
        with pytest.raises(StoreError, match="symbolic link where the board needs a folder"):
            write()
    with pytest.raises(AlreadyExistsError):
        store.put("runs/r1/obj", b"forged")  # the link is a name that exists
    store.delete("runs/r2/keep")  # through the folder link: nothing of the board's
    assert sorted(p.name for p in outside.iterdir()) == ["keep"]
    assert (outside / "keep").read_bytes() == b"precious"
    store.put("runs/r1/obj", b"mine", if_absent=False)  # the link itself is replaced
    assert store.get("runs/r1/obj") == b"mine" and not (root / "runs/r1/obj").is_symlink()
    os.symlink(outside / "keep", root / "runs" / "r1" / "obj2")
    store.delete("runs/r1/obj2")  # the link goes, not what it pointed to
    assert not os.path.lexists(root / "runs/r1/obj2")
    lock = root / ".rp-locks"
    if lock.exists():
        shutil.rmtree(lock)
    os.symlink(outside, lock)
    with pytest.raises(StoreError, match="symbolic link"):
        store.cas("runs/r1/LATEST", b"1", expected=None)
    assert sorted(p.name for p in outside.iterdir()) == ["keep"]
    assert (outside / "keep").read_bytes() == b"precious"


@contextlib.contextmanager
def _answering(status: int, body: bytes) -> Iterator[tuple[str, list[str]]]:
    """An HTTP server answering every GET with ``status`` and ``body``: its URL, and the
    paths it was asked for."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    hits: list[str] = []

    class Answer(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", hits
    finally:
        srv.shutdown()


@pytest.mark.parametrize(
    "body,transient",
    [
        (  # the relay's own refusal: its message and hint, not retried
            (
                b'{"error": {"message": "the bucket does not exist", "type": "upstream_error",'
                b' "code": 502}, "hint": "create it, or fix the URI"}'
            ),
            False,
        ),
        (b"<html>502 Bad Gateway</html>", True),  # a proxy in front of a restarting relay
    ],
)
def test_a_relay_refusal_says_what_the_relay_said(body: bytes, transient: bool) -> None:
    with _answering(502, body) as (url, hits):
        store = HttpStore(url, HttpConfig(retries=2, backoff=0))
        with pytest.raises(StoreError) as err:
            store.get("runs/r1/LATEST")
    if transient:
        assert isinstance(err.value, TransientStoreError) and len(hits) == 3
        assert "HTTP 502" in str(err.value)
    else:
        assert not isinstance(err.value, TransientStoreError) and len(hits) == 1
        assert "relay refused: the bucket does not exist" in str(err.value)
        assert err.value.hint == "create it, or fix the URI"


def test_an_endpoint_that_is_not_s3_is_named_not_taken_for_an_empty_board() -> None:
    """Any HTTP server answering 404 (a wrong port, another service) as the S3 endpoint: a
    read and a listing say the endpoint does not look like S3, not "no such object"."""
    pytest.importorskip("boto3")
    with _answering(404, b"<html>Not Found</html>") as (url, _):
        s3 = open_store(
            f"s3://{BUCKET}/p",
            endpoint_url=url,
            access_key_id="a",
            secret_access_key="b",
            max_attempts=1,
        )
        for call in (lambda: s3.get("k"), lambda: s3.list("runs/")):
            with pytest.raises(StoreError, match="does not look like an S3 API") as err:
                call()
            assert not isinstance(err.value, NotFoundError)


def test_a_latest_that_is_not_a_file_is_said_not_taken_for_nothing(tmp_path: Path) -> None:
    """LATEST made a link or a FIFO in a file:// board (an audit, session 40): followers said
    "nothing is published on this run yet" (seven manifests there) and a resuming publisher
    "LATEST kept moving; gave up". Both now say what is there; nothing is followed."""
    import numpy as np

    from rollpatch.board import Board
    from rollpatch.errors import ManifestError, RollpatchError
    from rollpatch.layout import pointer_key
    from rollpatch.publisher import Publisher

    root = tmp_path / "board"
    masters = {"w": np.ones((4, 4), np.float32)}
    with Publisher(f"file://{root}", "r1", asynchronous=False) as pub:
        pub.publish(masters)
    latest = root / pointer_key("r1")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(latest.read_bytes())
    for plant in ("link", "fifo"):
        latest.unlink()
        if plant == "link":
            os.symlink(elsewhere, latest)
        else:
            os.mkfifo(latest)
        with pytest.raises(ManifestError, match="LATEST is unreadable: no such object"):
            Board(f"file://{root}").latest("r1")
        with (
            pytest.raises(RollpatchError) as stopped,
            Publisher(f"file://{root}", "r1", asynchronous=False) as pub,
        ):
            pub.publish({"w": np.full((4, 4), 2.0, np.float32)})
        assert "kept moving" not in str(stopped.value), stopped.value
        assert "has that name" in str(stopped.value), stopped.value
