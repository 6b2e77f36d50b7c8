"""One version's timeline in ``bench/peers.py``: where the time from the trainer's step to every
island serving goes.

Island side: :class:`TracingStore` wraps the store a rollpatch island's follower reads through
and records every request (wall-clock start and end, key, bytes; the version a LATEST answer
named); :func:`run_delay` reads how long this process's threads waited on a run queue (Linux
schedstat: runnable, not running — CPU queueing). The island hands both to the driver with
each ``serving`` event, next to the follower's stage and commit timings.

Driver side: :func:`phases` turns one version's publisher stats and the last island's trace into
consecutive phases (they add up to the "all islands" time), and :func:`render` prints their
medians over versions.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _util import table

from rollpatch.latest import read_latest
from rollpatch.layout import manifest_version, object_hash, pointer_run
from rollpatch.store import ObjectInfo, Store

__all__ = ["PHASES", "TracingStore", "phases", "render", "run_delay"]


class TracingStore(Store):
    """``inner`` with every read recorded as ``[op, what, t0, t1, bytes, version]``."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.uri = inner.uri
        self.writable = False
        self._lock = threading.Lock()
        self._log: list[list[Any]] = []
        self._newest = -1
        #: :func:`run_delay` when a LATEST answer first named a newer version.
        self.delay_at_notice = 0.0

    def take(self) -> list[list[Any]]:
        """The requests recorded since the last call."""
        with self._lock:
            out, self._log = self._log, []
        return out

    def _record(self, op: str, key: str, t0: float, data: bytes | None) -> None:
        t1 = time.time()
        version = None
        what = "other"
        if (run := pointer_run(key)) is not None:
            what = "latest"
            if data is not None:
                version = read_latest(data, run, None)[0].version
                if version > self._newest:
                    self._newest, self.delay_at_notice = version, run_delay()
        elif (named := manifest_version(key)) is not None:
            what, version = "manifest", named[1]
        elif object_hash(key) is not None:
            what = "object"
        with self._lock:
            self._log.append([op, what, t0, t1, 0 if data is None else len(data), version])

    def _get(self, key: str) -> bytes:
        t0 = time.time()
        data = self.inner.get(key)
        self._record("get", key, t0, data)
        return data

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        t0 = time.time()
        data = self.inner.get_range(key, start, end)
        self._record("range", key, t0, data)
        return data

    def _list(self, prefix: str) -> list[str]:
        t0 = time.time()
        keys = self.inner.list(prefix)
        self._record("list", prefix, t0, None)
        return list(keys)

    def _head(self, key: str) -> ObjectInfo | None:
        t0 = time.time()
        info = self.inner.head(key)
        self._record("head", key, t0, None)
        return info

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        self._require_writable("put", key)

    def _delete(self, key: str) -> None:
        self._require_writable("delete", key)

    def _cas(self, key: str, data: bytes, *, expected: bytes | None) -> None:
        self._require_writable("cas", key)

    def close(self) -> None:
        self.inner.close()


def run_delay() -> float:
    """Seconds this process's live threads spent runnable but not running (schedstat field 2);
    threads that already exited are not counted, so this is a lower bound."""
    total = 0
    for stat in Path("/proc/self/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


#: The consecutive phases of one version, in order; they add up to the "all islands" time.
PHASES = (
    ("snapshot", "publish(): host snapshot (the trainer is blocked)"),
    ("encode", "publisher: queue + cast + diff + encode"),
    ("upload", "publisher: objects put on the board"),
    ("latest", "publisher: manifest put, LATEST advanced"),
    ("notice", "LATEST durable -> the island's read of LATEST names it"),
    ("manifest", "-> its manifest received (planning, GETs through relays)"),
    ("patch", "-> its patch objects received"),
    ("stage", "-> decoded and staged (engine serving the old version)"),
    ("commit", "-> committed and verified: serving (the pause inside)"),
)


def phases(
    pub: dict[str, float], t_call: float, island: dict[str, Any], trainer_delay: float = 0.0
) -> dict[str, float]:
    """One version's phases for one island (seconds); ``pub``: the publisher's stats,
    ``t_call``: wall clock of the trainer's call, ``island``: its ``serving`` event,
    ``trainer_delay``: the trainer process's CPU queueing over the version."""
    v = int(island["version"])
    trace = island.get("trace") or []
    durable = t_call + pub["total_s"]
    seen = [r[3] for r in trace if r[1] == "latest" and r[5] is not None and r[5] >= v]
    t_notice = min(seen) if seen else durable
    man = [r[3] for r in trace if r[1] == "manifest" and r[5] == v and r[2] >= t_notice - 1e-3]
    t_man = max(man) if man else t_notice
    objs = [r[3] for r in trace if r[1] == "object" and r[2] >= t_man - 1e-3]
    t_obj = max(objs) if objs else t_man
    t_serve = float(island["t"])
    staged = t_serve - t_obj - float(island.get("pause_s", 0.0))
    enc = sum(pub.get(k, 0.0) for k in ("queue_s", "cast_s", "diff_s", "encode_s"))
    out = {
        "snapshot": pub.get("snapshot_s", 0.0),
        "encode": enc,
        "upload": pub.get("upload_s", 0.0),
        "latest": pub["total_s"] - pub.get("snapshot_s", 0.0) - enc - pub.get("upload_s", 0.0),
        "notice": t_notice - durable,
        "manifest": t_man - t_notice,
        "patch": t_obj - t_man,
        "stage": staged,
        "commit": float(island.get("pause_s", 0.0)),
    }
    out["total"] = t_serve - t_call
    out["wan_gets"] = float(sum(1 for r in trace if r[1] in ("manifest", "object", "latest")))
    out["cpu_wait"] = float(island.get("run_delay_s", 0.0))
    out["trainer_wait"] = trainer_delay
    return out


def render(rows: Sequence[dict[str, float]], title: str, versions: Sequence[int] = ()) -> str:
    """Medians over versions of each phase (the last island to serve each version), and the
    phases of the slowest version (what sets the max); ``versions``: the rows' numbers."""
    if not rows:
        return f"{title}: no versions traced"
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    slow_i = max(range(len(rows)), key=lambda i: rows[i]["total"])
    slow = rows[slow_i]
    total = med["total"]
    lines = [
        [
            name,
            f"{1000 * med[name]:.0f}",
            f"{100 * med[name] / total:.0f}%",
            f"{1000 * slow[name]:.0f}",
            what,
        ]
        for name, what in PHASES
    ]
    lines.append(
        [
            "all islands",
            f"{1000 * total:.0f}",
            "100%",
            f"{1000 * slow['total']:.0f}",
            "the trainer's call -> serving",
        ]
    )
    for key, what in (
        ("trainer_wait", "trainer's threads runnable, not running (publisher included)"),
        ("cpu_wait", "the island's threads runnable, not running, from notice to serving"),
    ):
        lines.append(
            [
                "cpu queueing",
                f"{1000 * med[key]:.0f}",
                f"{100 * med[key] / total:.0f}%",
                f"{1000 * slow[key]:.0f}",
                f"{what} (within the above)",
            ]
        )
    name = f"v{versions[slow_i]}" if len(versions) == len(rows) else "slowest"
    return (
        f"{title}: p50 over versions of each phase (medians: they need not add up), the last "
        f"island to serve each version; {med['wan_gets']:.0f} reads per sync "
        f"(LATEST, manifests, objects); {name} ms: the slowest version's phases\n"
        + table(["phase", "ms", "share", name, "what"], lines, [False, True, True, True, False])
    )
