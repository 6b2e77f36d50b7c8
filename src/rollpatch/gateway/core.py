"""The gateway's state: islands, what each last reported, in-flight counts, and routing.

:class:`Gateway` holds no HTTP server: it polls each island's ``/version`` in a background
thread, folds in what responses report, and answers "which island next?" for a request.
The web app (``app``) forwards requests with it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from .. import jsonsafe
from ..errors import ConfigError
from ..serving.admission import Slot, wait_drained
from ..types import Constraint
from .config import GatewayConfig, IslandSpec, parse_island
from .metrics import GatewayMetrics
from .routing import RETRY_AFTER_CONFLICT, RETRY_AFTER_FAILURE, IslandView, Tier, fleet_latest, rank

__all__ = ["Gateway"]

#: A ``/version`` answer is a few hundred bytes.
_MAX_VERSION_BYTES = 1 << 20


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
        self._records = {s.name: _Record(IslandView(s.name, s.url)) for s in specs}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._rotation = itertools.count()
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
        import httpx

        with httpx.Client(timeout=self.config.poll_timeout_s) as client:
            while not self._stop.is_set():
                try:
                    r = client.get(f"{spec.url}/version")
                    r.raise_for_status()
                    # islands run on hosts we do not control: bounded, strict JSON only
                    body = jsonsafe.loads(
                        r.content,
                        what="/version answer",
                        max_bytes=_MAX_VERSION_BYTES,
                        max_depth=8,
                        island=spec.name,
                    )
                    if not isinstance(body, dict):
                        raise TypeError("/version did not answer a JSON object")
                except (httpx.HTTPError, ValueError, TypeError) as e:
                    self.observe_failure(spec.name, f"poll: {e}")
                else:
                    self.observe_version(spec.name, body)
                first.set()
                self._stop.wait(self.config.poll_s)

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
            )
            rec.lag = _int_or_none(body.get("lag"))
            rec.run = run
            rec.last_error = (
                body.get("last_error") if isinstance(body.get("last_error"), str) else None
            )
            rec.polled_at = time.time()
            rec.failed_at = None

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
            # what it said before is not what it is now: no state, no lag, no served version
            # until it answers (a restarted island may serve less, or another run)
            rec.view = replace(rec.view, served=None, reachable=False, state="UNREACHABLE")
            rec.lag = None
            rec.last_error = error
            rec.failed_at = time.monotonic()

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
        """Snapshots of every island, in configuration order."""
        with self._lock:
            return [self._records[s.name].view for s in self.specs]

    def latest(self) -> int | None:
        """The fleet's LATEST (:func:`~rollpatch.gateway.routing.fleet_latest`: no single island
        can inflate it)."""
        return fleet_latest(self.views())

    def describe(self) -> list[dict[str, Any]]:
        """What ``/islands`` reports: each island's last known ``/version`` and our view of it."""
        with self._lock:
            newest = fleet_latest([r.view for r in self._records.values()])
            out = []
            for s in self.specs:
                rec = self._records[s.name]
                v = rec.view
                # behind the fleet's LATEST: a sidecar's own lag comes from
                # its follower, stale while that follower is stopped or slow to poll
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
        views = self.views()
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
