"""Which island should serve a request: pure ranking over what the gateway knows of each island.

An island is placed in a :class:`Tier` by the sidecar's own rule (:func:`decide` on its served
version and the fleet's LATEST), then ordered inside the tier. The gateway tries islands in
that order; after a refusal it re-ranks with what the refusal taught it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import IntEnum

from ..protocol import Action, decide
from ..types import Constraint

__all__ = [
    "RETRY_AFTER_CONFLICT",
    "RETRY_AFTER_FAILURE",
    "IslandView",
    "Tier",
    "fleet_latest",
    "fleet_newest",
    "rank",
    "tier_of",
]


class Tier(IntEnum):
    """How likely an island is to serve a constraint soon (lower is better)."""

    READY = 0  #: serves an acceptable version now
    CATCH_UP = 1  #: behind, but what it needs is published: its sidecar catches up, then serves
    FUTURE = 2  #: the version is not published as far as we know; the sidecar re-reads LATEST
    UNKNOWN = 3  #: not polled yet, or loading (its sidecar answers 503 until ready)
    DOWN = 4  #: its last poll or request failed, or it gave a bad answer lately; it may be back
    HOPELESS = 5  #: serves a version newer than ``exact_version``; versions only move forward


#: After a 409, only islands that can serve by current knowledge are worth another try.
RETRY_AFTER_CONFLICT = frozenset({Tier.READY, Tier.CATCH_UP})
#: After a 503 or a failure, anything but an island that is certain to refuse.
RETRY_AFTER_FAILURE = frozenset(Tier) - {Tier.HOPELESS}


@dataclass(frozen=True)
class IslandView:
    """A snapshot of one island as the gateway knows it."""

    name: str
    url: str
    #: verified version its engine serves (None: not loaded, or never heard from)
    served: int | None = None
    #: LATEST as its sidecar last saw it
    latest: int | None = None
    #: follower state (IDLE, FETCHING, STAGING, COMMITTING, ERROR)
    state: str | None = None
    #: None until the first poll answers or fails
    reachable: bool | None = None
    #: requests this gateway has in flight there
    inflight: int = 0
    #: it gave a bad answer lately (labels outside the constraint, none, too large): tried
    #: only when no other island can be, as if down
    penalized: bool = False
    #: when its sidecar last read LATEST (time.monotonic(), from ``/version``'s
    #: ``latest_age_s`` at the poll; None: never, or not reported)
    latest_read_at: float | None = None


def fleet_latest(islands: Sequence[IslandView]) -> int | None:
    """The newest version the fleet vouches for: the lower median of what the reachable
    islands report (each its LATEST, or its served version when that is newer).

    One island cannot inflate it: an island on a tampered board, or a hostile one, that says
    LATEST is 10^12 would otherwise make every ``max_lag`` request chase a version that does
    not exist. An underestimate is harmless (each sidecar enforces the constraint with its own
    LATEST; a refusal is retried elsewhere); with two islands the lower report wins.
    """
    up = [i for i in islands if i.reachable] or list(islands)
    seen = sorted(
        max(v for v in (i.latest, i.served) if v is not None)
        for i in up
        if i.latest is not None or i.served is not None
    )
    return seen[(len(seen) - 1) // 2] if seen else None


def fleet_newest(islands: Sequence[IslandView]) -> int | None:
    """The newest version the fleet is known to have, what an island's lag is measured from:
    the highest version a reachable island serves, or :func:`fleet_latest` when that is higher.

    Not the median: with two islands, one whose sidecar is stuck (its relay hung, its LATEST
    old) won the median, and its lag read 0 while it was 156 versions behind the other. Not
    the highest LATEST either: a LATEST one island alone reports (a tampered board's 10^12)
    would put every honest island 10^12 behind. A served version was verified and loaded, so
    it exists. An underestimate by the newest island's own lag (it is catching up) remains.
    """
    up = [i for i in islands if i.reachable] or list(islands)
    served = [i.served for i in up if i.served is not None]
    median = fleet_latest(islands)
    top = max(served, default=None)
    if top is None or median is None:
        return median if top is None else top
    return max(top, median)


def _tier(d_action: Action, need: int | None) -> Tier:
    if d_action == "proxy":
        return Tier.READY
    if d_action == "wait":
        return Tier.CATCH_UP
    if d_action == "unavailable":
        return Tier.UNKNOWN
    return Tier.FUTURE if need is not None else Tier.HOPELESS


def tier_of(island: IslandView, c: Constraint, latest: int | None) -> Tier:
    """Place ``island`` for constraint ``c`` given the fleet's ``latest``.

    The worse of two views: the fleet's (is its version acceptable?) and the island's own
    sidecar's, which decides with the LATEST it reads itself (will it answer at once, or wait
    to catch up first?).
    """
    if island.reachable is None:
        return Tier.UNKNOWN
    if not island.reachable or island.penalized:
        return Tier.DOWN
    d = decide(c, island.served, latest)
    fleet = _tier(d.action, d.need)
    if island.latest is None or island.latest == latest:
        return fleet
    own = decide(c, island.served, island.latest)
    return max(fleet, _tier(own.action, own.need))


def rank(
    islands: Sequence[IslandView],
    c: Constraint,
    latest: int | None,
    *,
    exclude: Collection[str] = (),
    allowed: Collection[Tier] | None = None,
    rotate: int = 0,
) -> list[tuple[IslandView, Tier]]:
    """Islands in the order to try them, with their tiers.

    Ready islands: least in flight first, then the freshest version. Islands that must catch
    up (or wait for a publish): the highest served version first, since it has the least to
    fetch. ``rotate`` breaks the remaining ties round-robin, so idle islands share the load.
    """
    n = max(len(islands), 1)
    keyed = []
    for i, island in enumerate(islands):
        if island.name in exclude:
            continue
        t = tier_of(island, c, latest)
        if allowed is not None and t not in allowed:
            continue
        newest = -(island.served if island.served is not None else -1)
        if t == Tier.READY:
            key: tuple[int, ...] = (island.inflight, newest)
        elif t in (Tier.CATCH_UP, Tier.FUTURE):
            key = (newest, island.inflight)
        else:
            key = (island.inflight,)
        keyed.append(((int(t), *key, (i - rotate) % n), island, t))
    keyed.sort(key=lambda k: k[0])
    return [(island, t) for _, island, t in keyed]
