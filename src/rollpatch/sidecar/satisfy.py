"""The version decision for a proxied request, on the event loop: LATEST read without
blocking the loop (:class:`LatestReader`), then :func:`satisfy` proxies, waits for catch-up
or refuses (409/503) by the constraint (docs/sidecar.md)."""

from __future__ import annotations

import asyncio
import logging

from starlette.responses import Response

from ..serving.responses import error_response
from ..types import Constraint
from .protocol import DEFAULT_WAIT_S, Decision, decide
from .service import Sidecar

__all__ = ["LatestReader", "conflict", "plain_proxy", "satisfy", "unavailable"]


class LatestReader:
    """LATEST for the event loop: the sidecar's cache when fresh; else one board read in a
    worker thread (the board may sit behind a slow relay: never on the loop), shared by every
    request that needs it meanwhile (a refresh is one read, not one per waiting request).

    ``needed=False``: the cached value as it is, stale or not, for a decision that LATEST
    cannot change (no ``max_lag``, and the served version satisfies the constraint); such a
    request then pays no thread hop and no board read on its way to the engine."""

    def __init__(self, sc: Sidecar) -> None:
        self.sc = sc
        self._reading: asyncio.Future[int | None] | None = None

    async def __call__(self, refresh: bool = False, needed: bool = True) -> int | None:
        if refresh:
            return await self._bounded(
                asyncio.ensure_future(asyncio.to_thread(self.sc.latest, True))
            )
        fresh, value = self.sc.cached_latest()
        if fresh or not needed:
            return value
        if self._reading is None:
            self._reading = reading = asyncio.ensure_future(asyncio.to_thread(self.sc.latest))
            reading.add_done_callback(self._read)
        return await self._bounded(self._reading)

    async def _bounded(self, reading: asyncio.Future[int | None]) -> int | None:
        """The read's answer, waited for at most ``latest_max_age_s`` (a board that accepts
        and never answers holds no request); then the newest known, stale: the caller's age
        check says so."""
        try:
            return await asyncio.wait_for(asyncio.shield(reading), self.sc.config.latest_max_age_s)
        except asyncio.TimeoutError:
            return self.sc.latest_seen()

    def _read(self, _: object) -> None:
        self._reading = None


async def satisfy(sc: Sidecar, latest_of: LatestReader, c: Constraint) -> Response | None:
    """Wait for catch-up when the constraint allows it; a response when it must refuse."""
    if sc.draining:  # shutting down: another island takes it (the gateway retries a 503)
        return unavailable(
            sc,
            "the sidecar is shutting down; send the request to another island",
            sc.follower.version,
            sc.latest_seen(),
        )
    served = sc.follower.version
    if served is None and sc.gate.busy:  # mid-commit an engine may report no version
        await asyncio.to_thread(sc.gate.wait_commit, sc.config.admit_timeout_s)
        for _ in range(100):  # the follower records the verified version just after
            served = sc.follower.version
            if served is not None:
                break
            await asyncio.sleep(0.01)
    if plain_proxy(c, served) is not None:
        return None
    # without max_lag, LATEST cannot turn a proxy decision into another: it is read (when
    # stale) only if the answer is not a plain proxy
    latest = await latest_of(needed=c.max_lag is not None)
    if c.max_lag is None and decide(c, served, latest).action != "proxy":
        latest = await latest_of()
    age = sc.latest_age()
    if c.max_lag is not None and served is not None and age > sc.config.latest_max_age_s:
        # the board is unreachable: how far behind this island is cannot be known
        reason = _stale(sc, age, "max_lag cannot be checked")
        return unavailable(sc, reason, served, latest, level=logging.WARNING)
    d = decide(c, served, latest)
    if d.action == "conflict" and d.need is not None:
        latest = await latest_of(True)
        d = decide(c, served, latest)
    if d.action == "proxy":
        return None
    age = sc.latest_age()
    if d.action == "conflict" and d.need is not None and age > sc.config.latest_max_age_s:
        # "not published yet" is only known from a LATEST read recently
        reason = _stale(sc, age, f"whether version {d.need} is published cannot be checked")
        return unavailable(sc, reason, served, latest, level=logging.WARNING)
    if d.action == "unavailable":  # with why, as /ready says it (the last sync's failure)
        return unavailable(sc, sc.not_ready_reason() or d.reason, None, latest)
    if d.action == "wait":
        wait_s = DEFAULT_WAIT_S if c.wait_s is None else c.wait_s
        assert d.need is not None
        if wait_s > 0:
            sc.said.event("catch_up", "", served=served, need=d.need, latest=latest, wait_s=wait_s)
        exact = c.exact_version is not None  # catch up to it, not past it
        if wait_s > 0 and await asyncio.to_thread(
            sc.follower.wait_for, d.need, wait_s, exact=exact
        ):
            return None
        reason = (
            f"behind: serving {served}, the request needs {d.need} (the caller asked not to "
            "wait; the island catches up as LATEST moves)"
            if wait_s == 0
            else d.reason + f" did not finish within {wait_s:g}s" + _last_failure(sc)
        )
        sc.metrics.request("conflict")
        return conflict(sc, served, reason)
    sc.metrics.request("conflict")
    return conflict(sc, served, d.reason, final=d.final)


def _last_failure(sc: Sidecar) -> str:
    """``; the last sync failed: ...`` while the follower's last sync failed (a corrupt
    object, an unreachable board), else nothing."""
    err = sc.follower.status().last_error
    return f"; the last sync failed: {err}" if err else ""


def _stale(sc: Sidecar, age: float, what: str) -> str:
    """The 503 for a LATEST not read for ``age`` s, with the follower's last error when it
    has one (an expired or refused LATEST is not an unreachable board)."""
    err = sc.follower.status().last_error
    why = f"the last read failed: {err}" if err else "the board or relay did not answer it"
    return f"LATEST has not been read for {age:.0f} s ({why}): {what}"


def plain_proxy(c: Constraint, served: int | None) -> Decision | None:
    """The proxy decision when LATEST cannot change it (no ``max_lag``, and ``served``
    satisfies the constraint), without looking LATEST up at all; else None."""
    if c.max_lag is not None:
        return None
    d = decide(c, served, None)
    return d if d.action == "proxy" else None


def unavailable(
    sc: Sidecar,
    reason: str,
    served: int | None,
    latest: int | None,
    *,
    level: int = logging.INFO,
) -> Response:
    """503 ``not_ready``, counted and logged (throttled per reason: ``refused``; WARNING when
    the board cannot be read, which an operator must hear of). Before session 43 the draining
    and stale-LATEST 503s were counted but never logged (an audit, L3)."""
    sc.metrics.request("unavailable")
    sc.said.event(
        "refused", f"503 {reason}", level, status=503, reason=reason, served=served, latest=latest
    )
    return error_response(503, reason, "not_ready", served=served, latest=latest)


def conflict(sc: Sidecar, served: int | None, reason: str, *, final: bool = False) -> Response:
    """409; ``final``: no retry can meet the constraint here (``x-should-retry: false``)."""
    sc.said.event(
        "refused",
        f"409 {reason}",
        status=409,
        reason=reason,
        served=served,
        latest=sc.latest_seen(),
    )
    return error_response(
        409,
        reason,
        "version_conflict",
        retryable=not final,
        served=served,
        latest=sc.latest_seen(),
        reason=reason,
    )
