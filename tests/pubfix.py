"""The publisher tests' helpers: small master checkpoints and their nudges, stores that are
slow or fail, and :func:`check_all` (every published version reconstructs to the cast of
its masters, bit for bit). The test_publisher*.py modules import the ``board`` fixture by
name.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.errors import TransientStoreError
from rollpatch.formats import cast_view
from rollpatch.publisher import reconstruct
from rollpatch.store import MemoryStore
from rollpatch.store.base import ObjectInfo

RUN = "r1"


def copy_masters(masters: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in masters.items()}


def random_masters(seed: int, n: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {
        f"model.layers.{i}.mlp.up_proj.weight": (rng.standard_normal((64, 128)) * 0.02).astype(
            np.float32
        )
        for i in range(n)
    }
    out["model.norm.weight"] = np.ones(128, np.float32)
    return out


def nudge(masters: dict[str, np.ndarray], seed: int, lr: float = 3e-4) -> None:
    rng = np.random.default_rng(seed)
    for v in masters.values():
        v += (lr * rng.standard_normal(v.shape)).astype(v.dtype)


class SlowStore(MemoryStore):
    """A memory store whose puts take ``delay`` seconds (an uplink slower than training)."""

    def __init__(self, name: str, delay: float) -> None:
        super().__init__(name)
        self.delay = delay

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        time.sleep(self.delay)
        super()._put(key, data, if_absent=if_absent)


class FailingStore(MemoryStore):
    """Fails every put after the first ``ok`` puts; with ``gate``, every put first waits for
    it to be set (so a test decides when the failures may happen)."""

    def __init__(self, name: str, ok: int, gate: threading.Event | None = None) -> None:
        super().__init__(name)
        self.ok = ok
        self.gate = gate

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        if self.gate is not None and not self.gate.wait(60):
            raise AssertionError("FailingStore: the gate was never opened")
        if self.ok <= 0:
            raise TransientStoreError("injected upload failure", key=key)
        self.ok -= 1
        super()._put(key, data, if_absent=if_absent)


class OutageStore(MemoryStore):
    """A memory store that is down while ``down`` is set: every call on a key ``only`` accepts
    (default: every key) raises :class:`TransientStoreError`, as a store client does once its
    own retries are spent; ``failures`` counts them."""

    def __init__(self, name: str, only: Callable[[str], bool] | None = None) -> None:
        super().__init__(name)
        self.down = threading.Event()
        self.only = only
        self.failures = 0
        self.failed: list[str] = []  # the keys, in order

    def _check(self, key: str) -> None:
        if self.down.is_set() and (self.only is None or self.only(key)):
            self.failures += 1
            self.failed.append(key)
            raise TransientStoreError("injected outage: connection refused", key=key)

    def _lookup(self, key: str) -> bytes:
        self._check(key)
        return super()._lookup(key)

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        self._check(key)
        super()._put(key, data, if_absent=if_absent)

    def _cas(self, key: str, data: bytes, *, expected: bytes | None) -> None:
        self._check(key)
        super()._cas(key, data, expected=expected)

    def _list(self, prefix: str) -> list[str]:
        self._check(prefix)
        return super()._list(prefix)

    def _head(self, key: str) -> ObjectInfo | None:
        self._check(key)
        return super()._head(key)


def into_outage(
    seed: int, config: Any, *, asynchronous: bool = True
) -> tuple[OutageStore, Board, Any, dict[str, np.ndarray]]:
    """A publisher (``config``) on a fresh :class:`OutageStore` that made version 0 durable,
    then the store goes down and the masters take a step: (store, board, publisher, masters)."""
    from rollpatch.publisher import Publisher

    store = OutageStore(f"outage-{uuid.uuid4().hex[:12]}")
    board = Board(store)
    masters = random_masters(seed=seed)
    pub = Publisher(board, RUN, config, asynchronous=asynchronous)
    pub.publish(copy_masters(masters))
    pub.flush(timeout=30)
    store.down.set()
    nudge(masters, seed=seed + 1000)
    return store, board, pub, masters


@pytest.fixture
def board(memory_board: Board) -> Board:
    return memory_board


def check_all(board: Board, expected: dict[int, dict[str, np.ndarray]], fmt: str = "bf16") -> None:
    """Every published version reconstructs to the cast of its masters, bit for bit."""
    for n in board.versions(RUN):
        view = reconstruct(board, RUN, n)
        want = cast_view(expected[n], fmt)
        assert view.digest() == want.digest() == board.manifest(RUN, n).target, n
        for name, t in want.items():
            assert np.array_equal(view[name].data, t.data), (n, name)


def run_ranks(body: Callable[[int, Any], Any], size: int = 2, timeout_s: float = 60) -> list:
    """``body(rank, exchange)`` on ``size`` threads of one ``ThreadGroup``; each rank's
    result or exception."""
    from rollpatch.publisher.sharded import ThreadGroup

    g = ThreadGroup(size, timeout_s=timeout_s)
    out: list[Any] = [None] * size

    def one(r: int) -> None:
        try:
            out[r] = body(r, g.member(r))
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            out[r] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


class ScriptedPeer:
    """Rank 0 of two; rank 1's message is scripted."""

    rank, size = 0, 2

    def __init__(self, other: dict[str, Any]) -> None:
        self.other = other

    def allgather(self, message: Any) -> list[Any]:
        import json

        return [json.loads(json.dumps(message)), self.other]
