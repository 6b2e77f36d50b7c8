"""The gateway's state: islands, what each last reported, in-flight counts, and routing.

:class:`Gateway` holds no HTTP server: it polls each island's ``/version`` in a background
thread, folds in what responses report, and answers "which island next?" for a request.
The web app (``app``) forwards requests with it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..errors import ConfigError
from ..logs import Throttle, event
from ..serving.admission import Slot, wait_drained
from ..types import Constraint
from .config import GatewayConfig, IslandSpec, parse_island
from .health import read_at
from .metrics import GatewayMetrics
from .poll import poll_loop
from .routing import (
    RETRY_AFTER_CONFLICT,
    RETRY_AFTER_FAILURE,
    IslandView,
    Tier,
    fleet_latest,
    fleet_newest,
    rank,
)

__all__ = ["Gateway"]

log = logging.getLogger("rollpatch.gateway")


@dataclass
class _Record:
    """Mutable knowledge of one island (guarded by the gateway's lock)."""

    view: IslandView
    lag: int | None = None
    run: str | None = None
    last_error: str | None = None
    polled_at: float | None = None
    #: When it was last found unreachable (time.monotonic(); None since it answered).
    failed_at: float | None = None
    #: Until when it is tried last, after a bad answer (time.monotonic()).
    penalized_until: float = 0.0
    #: Why (the bad answer), while penalized.
    penalty: str | None = None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _newer(old: int | None, new: int | None) -> int | None:
    """Versions only move forward: keep the larger of two known values."""
    if old is None or new is None:
        return new if old is None else old
    return max(old, new)


class Gateway:
    """Routes requests over islands (sidecars) by the versions they serve."""

    def __init__(
        self, islands: Sequence[IslandSpec | str], config: GatewayConfig | None = None
    ) -> None:
        specs = [parse_island(i) if isinstance(i, str) else i for i in islands]
        if not specs:
            raise ConfigError("a gateway needs at least one island", hint="--sidecar URL")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ConfigError(
                "island names must be unique", value=names, hint="name them: --sidecar NAME=URL"
            )
        self.config = config or GatewayConfig()
        self.specs = specs
        self.metrics = GatewayMetrics()
        #: Per-request events (a refusal, a bad answer, a broken stream): one line per kind
        #: every 10 s, ``repeated=N`` after.
        self.said = Throttle(log)
        self._records = {s.name: _Record(IslandView(s.name, s.url)) for s in specs}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._rotation = itertools.count()
        #: Runs in the order islands first reported them (ties of the fleet's run).
        self._runs_seen: dict[str, None] = {}
        self._fleet_run: str | None = self.config.run
        self._excluded: frozenset[str] = frozenset()
        #: Shutting down (:meth:`drain`): new requests are refused, in-flight ones finish.
        self.draining = False

    # lifecycle -----------------------------------------------------------------------------

    def start(self, first_poll_timeout_s: float | None = None) -> None:
        """Start polling; returns once every island answered (or failed) a first poll."""
        first = [threading.Event() for _ in self.specs]
        for spec, ev in zip(self.specs, first):
            t = threading.Thread(
                target=self._poll_loop,
                args=(spec, ev),
                daemon=True,
                name=f"rollpatch-gateway-poll-{spec.name}",
            )
            t.start()
            self._threads.append(t)
        deadline = time.monotonic() + (
            first_poll_timeout_s
            if first_poll_timeout_s is not None
            else self.config.poll_timeout_s + 1.0
        )
        for ev in first:
            ev.wait(max(deadline - time.monotonic(), 0))

    def stop(self) -> None:
        """Stop polling (in-flight forwards are the app's business)."""
        self._stop.set()
        for t in self._threads:
            t.join(self.config.poll_timeout_s + 1.0)
        self._threads.clear()

    def _poll_loop(self, spec: IslandSpec, first: threading.Event) -> None:
        asyncio.run(poll_loop(self, spec, first))

    def stopping(self) -> bool:
        return self._stop.is_set()

    def wait_stop(self, seconds: float) -> bool:
        """Sleep ``seconds``, or until :meth:`stop`; True when stopping."""
        return self._stop.wait(seconds)

    # knowledge ---------------------------------------------------------------------------

    def observe_version(self, name: str, body: dict[str, Any]) -> None:
        """Fold in a ``/version`` answer: authoritative, except that a served version never
        goes back while the island keeps answering for one run (a failure, or another run,
        forgets it: a restarted island may serve less). The island's LATEST is taken as
        reported (not the maximum ever seen): a bad LATEST it read once, then repaired, must
        not stick (routing never trusts one island's LATEST for the fleet anyway, see
        :func:`~rollpatch.gateway.routing.fleet_latest`)."""
        served = _int_or_none(body.get("served"))
        run = body.get("run") if isinstance(body.get("run"), str) else None
        with self._lock:
            rec = self._records[name]
            v = rec.view
            if rec.run is not None and run != rec.run:  # another run: its versions are others
                v = replace(v, served=None)
            rec.view = replace(
                v,
                served=None if served is None else _newer(v.served, served),
                latest=_int_or_none(body.get("latest")),
                state=str(body.get("state")) if body.get("state") else None,
                reachable=True,
                latest_read_at=read_at(body.get("latest_age_s")),
            )
            rec.lag = _int_or_none(body.get("lag"))
            rec.run = run
            rec.last_error = (
                body.get("last_error") if isinstance(body.get("last_error"), str) else None
            )
            rec.polled_at = time.time()
            rec.failed_at = None
            if run is not None:
                self._runs_seen.setdefault(run, None)
            self._check_runs()
        if v.reachable is not True:
            event(log, "island_up", island=name, run=run, served=served, was=v.state)

    def observe_response(
        self, name: str, status: int, *, served: int | None = None, latest: int | None = None
    ) -> None:
        """Fold in what a forwarded request taught: versions from headers or a 409 body."""
        with self._lock:
            rec = self._records[name]
            v = rec.view
            if status == 503:  # loading or recovering: it serves nothing verified right now
                rec.view = replace(v, served=None, latest=_newer(v.latest, latest), reachable=True)
            else:
                rec.view = replace(
                    v,
                    served=_newer(v.served, served),
                    latest=_newer(v.latest, latest),
                    reachable=True,
                )

    def observe_failure(self, name: str, error: str) -> None:
        """The island could not be reached (poll or request)."""
        with self._lock:
            rec = self._records[name]
            was = rec.view.reachable
            # what it said before is not what it is now: no state, no lag, no served version
            # until it answers (a restarted island may serve less, or another run)
            rec.view = replace(rec.view, served=None, reachable=False, state="UNREACHABLE")
            rec.lag = None
            rec.last_error = error
            rec.failed_at = time.monotonic()
        if was is not False:  # a change of state: once, not on every failed poll
            event(log, "island_unreachable", logging.WARNING, island=name, error=error)

    def penalize(self, name: str, error: str) -> None:
        """The island gave an answer the gateway refused (:class:`~.answers.BadAnswer`): it is
        tried only when no other island can be, for ``bad_answer_penalty_s``."""
        with self._lock:
            rec = self._records[name]
            rec.penalty = error
            rec.penalized_until = time.monotonic() + self.config.bad_answer_penalty_s
            rec.view = replace(rec.view, penalized=True)

    def _check_runs(self) -> None:
        """Settle the fleet's run (pinned by ``config.run``; else the one most islands report,
        then the one most serve a version of — a loading island of a run with nothing
        published does not outvote a serving one —, ties to the first reported) and which islands
        follow another (they get no requests). An island that goes down keeps its run here, so
        the fleet's run does not flip while its islands are down. Called with the lock held."""
        runs = {n: r.run for n, r in self._records.items() if r.run is not None}
        # only runs some island still reports: a hostile one cannot grow this
        self._runs_seen = {r: None for r in self._runs_seen if r in runs.values()}
        fleet = self.config.run
        if fleet is None and runs:
            counts = Counter(runs.values())
            serving = Counter(
                r.run
                for r in self._records.values()
                if r.run is not None and r.view.served is not None
            )
            order = list(self._runs_seen)
            fleet = min(counts, key=lambda r: (-counts[r], -serving[r], order.index(r)))
        excluded = frozenset(n for n, r in runs.items() if r != fleet)
        if fleet != self._fleet_run and self._fleet_run is not None:
            event(log, "fleet_run", logging.WARNING, run=fleet, was=self._fleet_run)
        for n in sorted(excluded - self._excluded):
            event(
                log,
                "island_other_run",
                logging.WARNING,
                island=n,
                run=runs[n],
                fleet_run=fleet,
                action="no requests are routed to it",
            )
        for n in sorted(self._excluded - excluded):
            event(log, "island_run_ok", island=n, run=runs.get(n), fleet_run=fleet)
        self._fleet_run, self._excluded = fleet, excluded

    def fleet_run(self) -> str | None:
        """The run the fleet follows (pinned, or most islands'); None before any report."""
        with self._lock:
            return self._fleet_run

    def excluded(self) -> frozenset[str]:
        """Islands that follow another run than the fleet's: never routed to."""
        with self._lock:
            return self._excluded

    def failed_since(self, name: str, t: float) -> bool:
        """Whether ``name`` was found unreachable (a poll or a request failed) after ``t``
        (time.monotonic()) and has not answered since."""
        with self._lock:
            at = self._records[name].failed_at
        return at is not None and at > t

    def admit(self, name: str) -> Slot:
        """Count a request in flight at ``name`` until the returned slot is released (on
        leaving its ``with`` block, or by the stream it was handed off to)."""
        self.acquire(name)
        return Slot(lambda: self.release(name))

    def acquire(self, name: str) -> None:
        """Count a request in flight at ``name`` (pair with :meth:`release`; :meth:`admit`
        pairs them)."""
        with self._lock:
            rec = self._records[name]
            rec.view = replace(rec.view, inflight=rec.view.inflight + 1)

    def release(self, name: str) -> None:
        with self._lock:
            rec = self._records[name]
            rec.view = replace(rec.view, inflight=max(rec.view.inflight - 1, 0))

    def inflight(self) -> int:
        """Requests in flight at all islands (a stream counts until it ends)."""
        with self._lock:
            return sum(r.view.inflight for r in self._records.values())

    def drain(self, grace_s: float, stop: threading.Event | None = None) -> bool:
        """Refuse new requests (503: a client or load balancer goes to another gateway) and
        wait up to ``grace_s`` for those in flight, streams included, to finish; ``stop``
        set cuts the wait short. True when none is left."""
        self.draining = True
        return wait_drained(self.inflight, grace_s, stop)

    def views(self) -> list[IslandView]:
        """Snapshots of every island, in configuration order (a penalty that ran out is
        lifted here)."""
        now = time.monotonic()
        with self._lock:
            for rec in self._records.values():
                if rec.view.penalized and now >= rec.penalized_until:
                    rec.view = replace(rec.view, penalized=False)
            return [self._records[s.name].view for s in self.specs]

    def routable(self) -> list[IslandView]:
        """:meth:`views` of the islands that follow the fleet's run."""
        excluded = self.excluded()
        return [v for v in self.views() if v.name not in excluded]

    def latest(self) -> int | None:
        """The fleet's LATEST (:func:`~rollpatch.gateway.routing.fleet_latest`: no single island
        can inflate it; islands of another run do not count)."""
        return fleet_latest(self.routable())

    def newest(self) -> int | None:
        """The newest version the fleet is known to have, what lags are measured from
        (:func:`~rollpatch.gateway.routing.fleet_newest`: a stuck island cannot hide its lag
        behind the median)."""
        return fleet_newest(self.routable())

    def describe(self) -> list[dict[str, Any]]:
        """What ``/islands`` reports: each island's last known ``/version`` and our view of it."""
        newest = self.newest()
        with self._lock:
            out = []
            for s in self.specs:
                rec = self._records[s.name]
                v = rec.view
                # behind the fleet's newest version: a sidecar's own lag comes from its
                # follower, stale while that follower is stopped, slow to poll or stuck
                lag = (
                    max(newest - v.served, 0)
                    if newest is not None and v.served is not None
                    else rec.lag
                )
                age = None if rec.polled_at is None else round(time.time() - rec.polled_at, 3)
                out.append(
                    {
                        "name": v.name,
                        "url": v.url,
                        "served": v.served,
                        "latest": v.latest,
                        "lag": lag,
                        "state": v.state,
                        "reachable": v.reachable,
                        "inflight": v.inflight,
                        "run": rec.run,
                        "excluded": (
                            f"follows run {rec.run!r}, the fleet follows {self._fleet_run!r}"
                            if s.name in self._excluded
                            else None
                        ),
                        "penalized": rec.penalty if v.penalized else None,
                        "last_error": rec.last_error,
                        "polled_age_s": age,
                    }
                )
            return out

    # routing -----------------------------------------------------------------------------

    def rotation(self) -> int:
        """A fresh round-robin offset for one request's tie-breaks."""
        return next(self._rotation)

    def choose(
        self, c: Constraint, tried: Sequence[str], last_status: int | None, rotate: int = 0
    ) -> IslandView | None:
        """The next island for a request, or None when no other island is worth a try.

        ``last_status`` is how the previous attempt ended (None: first attempt; 0: could not
        connect). An island is never tried twice for one request, unless it is the only one
        and it failed (503, 502, unreachable) rather than refused.
        """
        views = self.routable()
        latest = fleet_latest(views)
        allowed: frozenset[Tier] | None = None
        if last_status == 409:
            allowed = RETRY_AFTER_CONFLICT
        elif last_status is not None:
            allowed = RETRY_AFTER_FAILURE
        ranked = rank(views, c, latest, exclude=tried, allowed=allowed, rotate=rotate)
        if ranked:
            return ranked[0][0]
        if len(views) == 1 and last_status not in (None, 409):
            return views[0]
        return None
