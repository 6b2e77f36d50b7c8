"""bench/sidecar.py's relay fan-out part."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _sidecar_load import BenchError
from _sidecar_world import RUN, World
from _util import log

from rollpatch.board import Board
from rollpatch.follower import Follower
from rollpatch.store import ObjectInfo, Store, open_store
from rollpatch.view import View, root_digest

FOLLOWERS = 8


class CountingStore(Store):
    """A read-only view of a store that counts the bytes and calls it answers."""

    writable = False

    def __init__(self, inner: Store) -> None:
        self.inner, self.uri = inner, inner.uri
        self._lock = threading.Lock()
        self.counts = {"bytes": 0, "object_bytes": 0, "gets": 0, "heads": 0, "lists": 0}

    def _add(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self.counts[k] += v

    def _get(self, key: str) -> bytes:
        data = self.inner.get(key)
        self._add(bytes=len(data), gets=1, object_bytes=len(data) * ("/objects/" in key))
        return data

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        data = self.inner.get_range(key, start, end)
        self._add(bytes=len(data), gets=1, object_bytes=len(data) * ("/objects/" in key))
        return data

    def _head(self, key: str) -> ObjectInfo | None:
        self._add(heads=1)
        return self.inner.head(key)

    def _list(self, prefix: str) -> list[str]:
        self._add(lists=1)
        return self.inner.list(prefix)

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        raise NotImplementedError

    def _delete(self, key: str) -> None:
        raise NotImplementedError

    def _cas(self, key: str, data: bytes, *, expected: bytes | None) -> None:
        raise NotImplementedError


def _fan_out(world: World, boards: list[Board], counter: CountingStore) -> dict[str, Any]:
    from rollpatch.engines.view_engine import ViewEngine

    last = max(world.digests)
    followers = [Follower(b, RUN, ViewEngine()) for b in boards]
    out: dict[str, Any] = {}
    with ThreadPoolExecutor(len(followers)) as pool:
        for phase, want in (("boot", 0), ("catchup", last)):
            before = dict(counter.counts)
            fetched = sum(f.status().bytes_fetched for f in followers)
            t0 = time.perf_counter()
            got = list(pool.map(lambda f, w=want: f.sync(w), followers))
            wall = time.perf_counter() - t0
            if got != [want] * len(followers):
                raise BenchError(f"followers reached {got}, wanted v{want}")
            for f in followers:
                view: View = f.engine.view  # type: ignore[attr-defined]
                if root_digest({n: t.digest() for n, t in view.items()}) != world.digests[want]:
                    raise BenchError(f"a follower's words at v{want} are not the publisher's")
            out[phase] = {k: counter.counts[k] - before[k] for k in before}
            out[phase]["wall_s"] = wall
            out[phase]["downstream"] = sum(f.status().bytes_fetched for f in followers) - fetched
            plan = followers[0].last_plan
            out[phase]["plan"] = [] if plan is None else [(s.base, s.to) for s in plan.steps]
    return out


def bench_relay(world: World, root: Path) -> dict[str, Any]:
    from rollpatch.relay import RelayConfig, RelayServer

    direct = CountingStore(open_store(world.board))
    plain = _fan_out(world, [Board(direct) for _ in range(FOLLOWERS)], direct)
    upstream = CountingStore(open_store(world.board))
    relay = RelayServer(upstream, RelayConfig(cache_dir=root / "relay-cache"))
    url = relay.start()
    try:
        relayed = _fan_out(world, [Board(open_store(url)) for _ in range(FOLLOWERS)], upstream)
        metric = relay.relay.metrics.total("rollpatch_relay_upstream_bytes_total")
    finally:
        relay.stop()
    if metric != upstream.counts["bytes"]:
        raise BenchError(
            f"relay metric says {metric} upstream bytes, the store saw {upstream.counts['bytes']}"
        )
    log(
        f"relay: upstream {direct.counts['bytes']:,} B direct vs {upstream.counts['bytes']:,} B "
        "through the relay"
    )
    return {"direct": plain, "relay": relayed, "relay_metric_bytes": metric}
