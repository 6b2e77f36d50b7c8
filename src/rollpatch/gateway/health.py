"""The gateway's own health: whether it can serve at all (``/ready``), and how many islands
see a fresh LATEST (``/health``'s ``fresh``). Pure rules over :class:`IslandView` snapshots.

``/health`` says 200 while the gateway runs; ``/ready`` says whether a request without a
constraint would be served now, so that a load balancer stops sending requests to a gateway
whose islands are all down, loading or of another run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from ..types import Constraint
from .routing import IslandView, Tier, tier_of

__all__ = ["fresh_count", "not_ready_reason", "read_at", "ready_islands"]

#: Islands named at most in a ``/ready`` refusal (the rest are counted).
MAX_NAMED = 8


def read_at(age: Any) -> float | None:
    """When a sidecar last read LATEST (time.monotonic()), from ``/version``'s
    ``latest_age_s`` (seconds, or null: never)."""
    if not isinstance(age, (int, float)) or isinstance(age, bool) or not math.isfinite(age):
        return None
    return time.monotonic() - max(float(age), 0.0)


def fresh_count(islands: Sequence[IslandView], max_age_s: float, now: float) -> int:
    """Reachable islands whose sidecar read LATEST less than ``max_age_s`` before ``now``
    (time.monotonic()): the ones that can check a ``max_lag`` request (a sidecar refuses
    those with ``503`` once its LATEST is older than its ``latest_max_age_s``)."""
    return sum(
        1
        for i in islands
        if i.reachable and i.latest_read_at is not None and now - i.latest_read_at < max_age_s
    )


def _why(island: IslandView) -> str:
    if island.reachable is None:
        return "not polled yet"
    if not island.reachable:
        return "unreachable"
    if island.penalized:
        return "penalized for a bad answer"
    return f"serves no version (state {island.state})"


def ready_islands(islands: Sequence[IslandView], latest: int | None) -> list[IslandView]:
    """Those of ``islands`` (``latest``: their fleet's LATEST) that would serve a request
    without a constraint now: reachable, not penalized, serving a version."""
    return [i for i in islands if tier_of(i, Constraint(), latest) == Tier.READY]


def not_ready_reason(
    islands: Sequence[IslandView], latest: int | None, run: str | None
) -> str | None:
    """None when an island of the fleet's run (``islands``: those, with ``latest`` their
    LATEST) would serve a request without a constraint now; else why not, naming islands."""
    if ready_islands(islands, latest):
        return None
    fleet = "" if run is None else f" of run {run!r}"
    if not islands:
        return f"no island{fleet}: every island follows another run"
    named = "; ".join(f"{i.name}: {_why(i)}" for i in islands[:MAX_NAMED])
    more = f"; and {len(islands) - MAX_NAMED} more" if len(islands) > MAX_NAMED else ""
    return f"no island{fleet} can serve a request ({named}{more})"
