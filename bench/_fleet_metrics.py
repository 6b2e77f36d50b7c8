"""What a simulated run means: time-to-version, egress, relay hit rates, lag, dropped rollouts."""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from dataclasses import dataclass

import numpy as np
from _fleet_model import Scenario
from _fleet_sim import IslandRun, RunResult


@dataclass(frozen=True)
class Summary:
    method: str
    #: Seconds from the trainer's publish() call to each island serving that version (or a
    #: newer one), over every (island, version ≥ 1): percentiles.
    ttv_p50_s: float
    ttv_p95_s: float
    ttv_max_s: float
    #: Seconds from publish() to LATEST naming the version (trainer side), mean.
    publish_s: float
    #: Mean bytes per step of the method's payload (patch, delta, checkpoint).
    payload_bytes: float
    #: Bytes leaving the trainer's region per step, and that / (payload × remote regions).
    egress_per_step: float
    egress_ratio: float
    #: Relay hit rate: 1 − upstream bytes / bytes served to islands (remote regions).
    relay_hit: float
    #: Time-weighted share of island-time at each lag (LATEST − served).
    lag: dict[int, float]
    #: Rollout requests refused for lag > max_lag, and their share of all requests.
    dropped: float
    dropped_frac: float
    #: Versions each island skipped (never served), mean.
    skipped: float


def _served_at(commits: list[tuple[float, int]], t: float) -> int:
    times = [c[0] for c in commits]
    k = bisect.bisect_right(times, t) - 1
    return commits[k][1] if k >= 0 else 0


def ttvs(res: RunResult) -> np.ndarray:
    """Array [version − 1, island] of seconds from publish() to serving ≥ that version."""
    out = np.full((len(res.versions) - 1, len(res.islands)), np.inf)
    for j, isl in enumerate(res.islands):
        for v in res.versions[1:]:
            t = next((t for t, n in isl.commits if n >= v.n), None)
            if t is not None:
                out[v.n - 1, j] = t - v.t_call
    return out


def lag_shares(sc: Scenario, res: RunResult, isl: IslandRun) -> Counter[int]:
    """Seconds at each lag over [first call, last call + step)."""
    lat = [v.t_latest for v in res.versions]
    t0, t1 = res.versions[1].t_call, res.versions[-1].t_call + sc.step_s
    points = sorted(
        {t0, t1, *(t for t in lat if t0 < t < t1), *(t for t, _ in isl.commits if t0 < t < t1)}
    )
    acc: Counter[int] = Counter()
    for a, b in itertools.pairwise(points):
        latest = max(bisect.bisect_right(lat, a) - 1, 0)
        acc[max(latest - _served_at(isl.commits, a), 0)] += b - a
    return acc


def summarize(sc: Scenario, res: RunResult) -> Summary:
    t = ttvs(res)
    remote = [r for r in res.regions if not r.home]
    egress = sum(r.upstream_bytes for r in remote) / sc.steps
    payload = float(np.mean([v.bytes for v in res.versions[1:]]))
    served = sum(r.served_bytes for r in remote)
    hit = 1 - sum(r.upstream_bytes for r in remote) / served if served else float("nan")
    lags: Counter[int] = Counter()
    for isl in res.islands:
        lags.update(lag_shares(sc, res, isl))
    total = sum(lags.values())
    over = sum(s for k, s in lags.items() if k > sc.max_lag)
    skipped = np.mean([sc.steps - (len({n for _, n in i.commits}) - 1) for i in res.islands])
    return Summary(
        method=res.method,
        ttv_p50_s=float(np.percentile(t, 50)),
        ttv_p95_s=float(np.percentile(t, 95)),
        ttv_max_s=float(t.max()),
        publish_s=float(np.mean(res.publish_s)),
        payload_bytes=payload,
        egress_per_step=egress,
        egress_ratio=egress / (payload * len(remote)) if remote else float("nan"),
        relay_hit=hit,
        lag={k: s / total for k, s in sorted(lags.items())},
        dropped=over * sc.requests_per_s,
        dropped_frac=over / total if total else 0.0,
        skipped=float(skipped),
    )
