"""The long-poll relay tests' world (test_relay_longpoll, test_relay_prefetch, test_relay_push):
a ``file://`` board written by a real :class:`Publisher` with v0 published, real uvicorn relays
on loopback in front of it, read through the ``http://`` store client as followers read them;
the ``world`` fixture stops them after the test. Modules import ``world`` by name.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollpatch.latest import read_latest
from rollpatch.layout import pointer_key
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.relay import RelayConfig, RelayServer
from rollpatch.store import open_store
from rollpatch.store.http_client import HttpStore
from tests.conftest import masters

RUN = "lp"
KEY = pointer_key(RUN)


class World:
    """A file board with v0 published, and a relay in front of it."""

    def __init__(self, tmp: Path, **relay: object) -> None:
        self.uri = f"file://{tmp / 'board'}"
        self.pub = Publisher(self.uri, RUN, PublisherConfig(format="bf16"), asynchronous=False)
        self.step = 0
        self.publish()
        self.tmp = tmp
        self.servers: list[RelayServer] = []
        self.origin = self.relay(self.uri, "origin", **relay)

    def publish(self) -> int:
        self.step += 1
        return self.pub.publish(masters(self.step, 1e-2 * self.step))

    def relay(self, board: str, name: str, **cfg: object) -> RelayServer:
        server = RelayServer(
            board,
            RelayConfig(cache_dir=self.tmp / name, **cfg),  # type: ignore[arg-type]
        )
        server.start()
        self.servers.append(server)
        return server

    def close(self) -> None:
        for s in reversed(self.servers):
            s.stop()
        self.pub.close()


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    yield w
    w.close()


def client_of(url: str) -> HttpStore:
    store = open_store(url, retries=0)
    assert isinstance(store, HttpStore)
    return store


def version_of(body: bytes | None) -> int:
    assert body is not None
    return read_latest(body, RUN, None)[0].version


def held_in_thread(c: HttpStore, after: int, wait_s: float) -> tuple[threading.Thread, list]:
    out: list = []
    held = c.held()
    t = threading.Thread(target=lambda: out.append(c.wait_newer(KEY, after, wait_s, held)))
    t.start()
    return t, out


def waiting(server: RelayServer) -> int:
    watch = server.relay.watch
    with watch._lock:
        return sum(len(st.waiters) for st in watch._runs.values())
