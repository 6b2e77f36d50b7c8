"""Fixtures for the store tests: every backend behind one parametrised fixture.

- ``s3_server``: moto's standalone S3 server as a real process on loopback (see s3server.py).
  Without moto the S3 tests fail at setup with a clear message, unless ROLLPATCH_SKIP_S3=1.
- ``relay``: a stdlib HTTP server that speaks the relay protocol of docs/store.md over a
  FileStore, and an HttpStore reading through it.
- ``store``: each writable backend; ``pair``: (writer, reader) for every backend, where the
  http reader reads what a FileStore wrote.

test_store.py imports these fixtures by name (this module is not a conftest.py on purpose, so
other test modules do not pay for a moto server).
"""

from __future__ import annotations

import http.server
import json
import os
import threading
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollpatch.store import FileStore, HttpStore, MemoryStore, Store, open_store
from rollpatch.store.config import HttpConfig
from tests.s3server import S3Server, moto_available, run_moto_server

__all__ = [
    "BUCKET",
    "S3_SMALL_PARTS",
    "MiB",
    "make_s3_store",
    "pair",
    "relay",
    "s3_server",
    "store",
]

MiB = 1024 * 1024
BUCKET = "rollpatch-test"
S3_SMALL_PARTS = {
    "part_size": 5 * MiB,
    "multipart_threshold": 5 * MiB,
    "max_workers": 4,
    "max_attempts": 3,
    "connect_timeout": 5.0,
    "read_timeout": 30.0,
}


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server in its own process, with the test bucket created."""
    if os.environ.get("ROLLPATCH_SKIP_S3") == "1":
        pytest.skip("S3 backend tests skipped on request (ROLLPATCH_SKIP_S3=1)")
    if not moto_available():
        pytest.fail(
            "the S3 backend tests need moto's standalone server: "
            "pip install 'moto[server]' boto3 (or set ROLLPATCH_SKIP_S3=1 to skip them "
            "explicitly)",
            pytrace=False,
        )
    import boto3

    with run_moto_server() as server:
        boto3.client(
            "s3",
            endpoint_url=server.endpoint_url,
            region_name=server.region,
            aws_access_key_id=server.access_key_id,
            aws_secret_access_key=server.secret_access_key,
        ).create_bucket(Bucket=BUCKET)
        yield server


def make_s3_store(request: pytest.FixtureRequest, **extra: Any) -> Store:
    """A store under a fresh prefix of the test bucket, with small multipart parts."""
    server: S3Server = request.getfixturevalue("s3_server")
    return open_store(
        f"s3://{BUCKET}/t-{uuid.uuid4().hex[:12]}", **server.options(**{**S3_SMALL_PARTS, **extra})
    )


class _Relay(http.server.BaseHTTPRequestHandler):
    """The relay protocol of docs/store.md over a FileStore, mounted at /relay (test double)."""

    store: Store
    page = 2  # small pages, so clients must follow "next"

    def log_message(self, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        self.do_GET(body=False)

    def do_GET(self, body: bool = True) -> None:
        url = urllib.parse.urlsplit(self.path)
        if url.path == "/relay/v1/list":
            q = urllib.parse.parse_qs(url.query)
            after = q.get("start_after", [""])[0]
            keys = [k for k in self.store.list(q.get("prefix", [""])[0]) if k > after]
            nxt = keys[self.page - 1] if len(keys) > self.page else None
            return self._send(200, json.dumps({"keys": keys[: self.page], "next": nxt}).encode())
        key = urllib.parse.unquote(url.path.removeprefix("/relay/v1/objects/"))
        info = self.store.head(key) if url.path.startswith("/relay/v1/objects/") else None
        if info is None:
            return self._send(404, b"{}")
        rng = self.headers.get("Range")
        if rng is None:
            return self._send(200, self.store.get(key) if body else b"", size=info.size)
        a, b = (int(x) for x in rng.removeprefix("bytes=").split("-"))
        if a >= info.size:
            return self._send(416, b"", {"Content-Range": f"bytes */{info.size}"})
        b = min(b, info.size - 1)
        self._send(
            206,
            self.store.get_range(key, a, b + 1),
            {"Content-Range": f"bytes {a}-{b}/{info.size}"},
        )

    def _send(
        self,
        status: int,
        data: bytes,
        headers: dict[str, str] | None = None,
        size: int | None = None,
    ) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data) if size is None else size))
        self.send_header("ETag", '"t"')
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[tuple[Store, HttpStore]]:
    """(FileStore to write, HttpStore reading the same objects through the relay protocol)."""
    backing = FileStore(tmp_path / "relay")
    handler = type("Relay", (_Relay,), {"store": backing})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield (
            backing,
            HttpStore(
                f"http://127.0.0.1:{server.server_port}/relay", HttpConfig(retries=0, timeout=5)
            ),
        )
    finally:
        server.shutdown()
        server.server_close()


def _make(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Store, Store]:
    if kind == "file":
        s: Store = FileStore(tmp_path / "store")
    elif kind == "memory":
        s = MemoryStore(f"t-{uuid.uuid4().hex}")
    elif kind == "s3":
        s = make_s3_store(request)
    else:
        return request.getfixturevalue("relay")
    return s, s


@pytest.fixture(params=["file", "memory", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """Each writable backend."""
    s, _ = _make(request.param, request, tmp_path)
    with s:
        yield s


@pytest.fixture(params=["file", "memory", "s3", "http"])
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Store, Store]]:
    """(writer, reader) for every backend; for http the reader is the relay client."""
    writer, reader = _make(request.param, request, tmp_path)
    with writer:
        yield writer, reader


class Interloper:
    """Wraps a boto3 client: right after cas reads the pointer, another writer moves it."""

    def __init__(self, client: Any, move: Any) -> None:
        self._client, self._move = client, move

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def get_object(self, **kwargs: Any) -> Any:
        response = self._client.get_object(**kwargs)
        self._move()
        return response
