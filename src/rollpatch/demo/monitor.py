"""What the orchestrator knows about the run: events from the children plus periodic polls.

Events give exact times (a version became LATEST; an island committed it); polls give byte
counters (islands' ``/version``, relays' ``/metrics``) and an independent watch on the board's
LATEST pointer, which must never move backwards. Thread-safe: events arrive on the main
thread, polls on a background thread.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..board import Board
from ..errors import RollpatchError
from .config import RUN, DemoConfig

__all__ = ["IslandState", "Monitor"]

_METRIC = re.compile(r"^(rollpatch_relay_\w+?)(?:\{([^}]*)\})?\s+([0-9.eE+-]+)$", re.MULTILINE)
_REASON = re.compile(r'reason="([^"]*)"')


@dataclass
class IslandState:
    """One island as seen from the orchestrator."""

    name: str
    link: str
    url: str | None = None
    commits: list[tuple[int, float, str | None]] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    requests: int = 0

    @property
    def served(self) -> int | None:
        return self.commits[-1][0] if self.commits else None

    @property
    def bytes_fetched(self) -> int:
        return int(self.status.get("bytes_fetched") or 0)


@dataclass
class RelayState:
    """One regional relay: its URL, counters from ``/metrics`` and its link's counters."""

    name: str
    url: str | None = None
    upstream_bytes: int = 0
    served_bytes: int = 0
    refused: int = 0
    #: Refusals by the reason the relay counted (and logged, with the key, in its log).
    refused_by: dict[str, int] = field(default_factory=dict)
    link: dict[str, Any] = field(default_factory=dict)


class Monitor:
    """Aggregates events and polls into the state the live view and the report read."""

    def __init__(self, cfg: DemoConfig, board_uri: str, islands: list[tuple[str, str]]) -> None:
        self.cfg = cfg
        self.t0 = time.time()
        self.board = Board(board_uri)
        self.islands = {name: IslandState(name, link) for name, link in islands}
        self.relays: dict[str, RelayState] = {}
        self.published: dict[int, dict[str, Any]] = {}
        self.steps: list[dict[str, Any]] = []
        self.ready: dict[str, Any] = {}
        self.trained: dict[str, Any] | None = None
        self.verified: dict[str, Any] | None = None
        #: ``--model moe``: the trainer's routing report (demo.routing), else None.
        self.routing: dict[str, Any] | None = None
        self.latest_seen: list[tuple[float, int]] = []
        self.latest_backwards: list[tuple[int, int]] = []
        self.commit_order_errors: list[str] = []
        self.missed_polls = 0
        self.lock = threading.RLock()

    # -- events --------------------------------------------------------------------------------

    def on_event(self, who: str, ev: dict[str, Any]) -> None:
        """Fold in one child's event."""
        kind = ev["ev"]
        with self.lock:
            if kind == "published":
                self.published[int(ev["version"])] = ev
            elif kind == "step":
                self.steps.append(ev)
                for island, n in ev.get("islands", {}).items():
                    if island in self.islands:
                        self.islands[island].requests += int(n)
            elif kind == "commit":
                isl = self.islands[ev["island"]]
                v = int(ev["version"])
                if isl.commits and v <= isl.commits[-1][0]:
                    self.commit_order_errors.append(
                        f"{isl.name} committed v{v} after v{isl.commits[-1][0]}"
                    )
                isl.commits.append((v, float(ev["t"]), ev.get("digest")))
            elif kind == "link":
                self.relay(ev["relay"]).link = {
                    k: ev[k] for k in ("connections", "bytes_down", "bytes_up", "lost_segments")
                }
            elif kind == "ready":
                self.ready = ev
            elif kind == "trained":
                self.trained = ev
            elif kind == "verified":
                self.verified = ev
            elif kind == "routing":
                self.routing = {k: v for k, v in ev.items() if k != "ev"}

    def relay(self, name: str) -> RelayState:
        """The state of relay ``name`` (created on first use)."""
        with self.lock:
            return self.relays.setdefault(name, RelayState(name))

    # -- polls ---------------------------------------------------------------------------------

    def poll(self, client: Any) -> None:
        """One round of polls: LATEST on the board, each island, each relay."""
        try:
            p = self.board.latest(RUN)
        except RollpatchError:
            p = None
        if p is not None:
            with self.lock:
                if self.latest_seen and p.version < self.latest_seen[-1][1]:
                    self.latest_backwards.append((self.latest_seen[-1][1], p.version))
                self.latest_seen.append((time.time(), p.version))
        for isl in list(self.islands.values()):
            if isl.url is None:
                continue
            try:
                body = client.get(f"{isl.url}/version").json()
            except Exception:  # noqa: BLE001 (a missed poll only delays a counter)
                self.missed_polls += 1
                continue
            with self.lock:
                isl.status = body
        for relay in list(self.relays.values()):
            if relay.url is None:
                continue
            try:
                text = client.get(f"{relay.url}/metrics").text
            except Exception:  # noqa: BLE001 (as above)
                self.missed_polls += 1
                continue
            totals: dict[str, float] = {}
            refused_by: dict[str, int] = {}
            for name, labels, value in _METRIC.findall(text):
                totals[name] = totals.get(name, 0.0) + float(value)
                reason = _REASON.search(labels)
                if name == "rollpatch_relay_refused_total" and reason and float(value):
                    refused_by[reason.group(1)] = int(float(value))
            with self.lock:
                relay.upstream_bytes = int(totals.get("rollpatch_relay_upstream_bytes_total", 0))
                relay.served_bytes = int(totals.get("rollpatch_relay_served_bytes_total", 0))
                relay.refused = int(totals.get("rollpatch_relay_refused_total", 0))
                relay.refused_by = refused_by

    def start_polling(self, period_s: float = 0.5) -> threading.Event:
        """Poll in a daemon thread until the returned event is set."""
        import httpx

        stop = threading.Event()

        def loop() -> None:
            with httpx.Client(timeout=2.0) as client:
                while not stop.is_set():
                    self.poll(client)
                    stop.wait(period_s)

        threading.Thread(target=loop, name="demo-poll", daemon=True).start()
        return stop

    # -- derived -------------------------------------------------------------------------------

    @property
    def latest(self) -> int | None:
        with self.lock:
            return max(self.published) if self.published else None

    def lag(self, island: str) -> int | None:
        served, latest = self.islands[island].served, self.latest
        return None if served is None or latest is None else max(latest - served, 0)

    def time_to_version(self) -> dict[int, dict[str, dict[str, Any]]]:
        """Per version, per island: seconds from LATEST naming it to the island serving it
        (or, if the island skipped it, a newer version: ``exact`` False)."""
        out: dict[int, dict[str, dict[str, Any]]] = {}
        with self.lock:
            for v, pub in sorted(self.published.items()):
                row: dict[str, dict[str, Any]] = {}
                for isl in self.islands.values():
                    hit = next(((cv, t) for cv, t, _ in isl.commits if cv >= v), None)
                    if hit is not None:
                        row[isl.name] = {
                            "seconds": max(hit[1] - float(pub["t_latest"]), 0.0),
                            "exact": hit[0] == v,
                        }
                out[v] = row
        return out

    def mean_ttv(self, island: str, last: int | None = None) -> float | None:
        """Mean time-to-version of ``island`` over versions >= 1 (the last ``last`` ones)."""
        rows = [
            (v, r[island]["seconds"])
            for v, r in self.time_to_version().items()
            if v >= 1 and island in r
        ]
        if last is not None:
            rows = rows[-last:]
        return sum(s for _, s in rows) / len(rows) if rows else None
