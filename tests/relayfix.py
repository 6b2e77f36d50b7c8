"""The relay tests' world: boards in ``memory://`` stores written through :class:`Board`,
:class:`Counting` (a store that wraps the board's and counts upstream reads, and can be
slowed down or cut off), and the ``serve`` fixture: real uvicorn relays on loopback ports,
read through the ``http://`` store client the way followers read them, stopped after the test.
The test_relay*.py modules import its fixtures (``board``, ``objects``, ``serve``) by name.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollpatch.board import Board
from rollpatch.errors import TransientStoreError
from rollpatch.manifest import KeyframeObject, PatchObject
from rollpatch.relay import RelayConfig, RelayServer
from rollpatch.store import ObjectInfo, Store, open_store
from rollpatch.types import ObjectRef
from tests.conftest import make_manifest

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
