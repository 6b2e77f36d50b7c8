"""bench/vllm_load.py's analysis: streamed token arrivals laid over the bench's own windows.

A *window* is a span of ``time.monotonic()`` (system-wide, so the load generator's arrival
times and the bench's events share one clock) with a kind: ``idle`` (the load alone),
``stage`` (a follower sync up to its commit: fetch, stage in the worker while it serves),
``commit`` (the commit gate's run: pause, writes, reset, resume), ``sync`` (the two
together: what a whole sync costs, measured over its whole span, since a gap that straddles
the stage's end and the commit's start would count in both), ``reload`` (the engine's own
reload under its pause). For each kind, over all its windows:

- *tok/s*: token arrivals inside the windows per second of window;
- *gaps*: for every stream, each interval between two consecutive arrivals that overlaps a
  window (a stall that spans a commit counts once, whole); p50, p99 and the largest;
- *stall*: per window, the largest gap overlapping it (the normal gap included), then the
  median over the windows;
- *added*: what a window costs a stream that runs through it, in time: for every stream with
  arrivals before and after the window, the span from its last arrival before the window to
  its first after, less that many gaps at the idle windows' median gap; the median over all
  (window, stream) pairs. Short windows hold a token or two per stream, so *tok/s* there is
  coarse; *added* is not. Only streams already under way are measured (a request that starts
  inside a window has no arrival before it). Gaps are right-skewed, so a long window's
  *added* carries a bias even under the load alone; its null control (*null*) is the same
  measure over slices of the idle windows as long as the row's windows, and *net* = added −
  null is the row's cost beyond it.

NaN where a measure has nothing to measure (no idle window, no gap, no stream through).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Any, Literal

import numpy as np

Kind = Literal["idle", "stage", "commit", "sync", "reload"]
Mode = Literal["", "in_place", "double_buffer"]
KINDS: tuple[Kind, ...] = ("idle", "stage", "commit", "sync", "reload")
NAN = float("nan")


@dataclass(frozen=True)
class Window:
    kind: Kind
    t0: float
    t1: float
    mode: Mode = ""  # the commit's writes; "" for the windows of no commit

    @property
    def label(self) -> str:
        return f"{self.kind} ({self.mode})" if self.mode else self.kind


def _gaps(streams: list[list[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Every stream's consecutive arrival intervals: (starts, ends)."""
    starts = [np.asarray(s[:-1]) for s in streams if len(s) > 1]
    ends = [np.asarray(s[1:]) for s in streams if len(s) > 1]
    if not starts:
        return np.empty(0), np.empty(0)
    return np.concatenate(starts), np.concatenate(ends)


def _added(streams: list[np.ndarray], spans: list[tuple[float, float]], gap: float) -> float:
    """Median added time (ms) over (span, stream) pairs: see the module docstring."""
    got = []
    for t0, t1 in spans:
        for s in streams:
            if s.size < 2 or s[0] > t0 or s[-1] < t1:
                continue
            j = int(np.searchsorted(s, t0, "right")) - 1  # the last arrival at or before t0
            i = int(np.searchsorted(s, t1, "left"))  # the first at or after t1
            got.append((s[i] - s[j]) - (i - j) * gap)
    return 1e3 * median(got) if got else NAN


def _slices(windows: list[Window], length: float) -> list[tuple[float, float]]:
    """The idle windows cut into spans of ``length`` seconds."""
    out = []
    for w in windows:
        if w.kind == "idle" and length > 0:
            n = int((w.t1 - w.t0) // length)
            out += [(w.t0 + k * length, w.t0 + (k + 1) * length) for k in range(n)]
    return out


def _row(
    mine: list[Window],
    windows: list[Window],
    arrays: list[np.ndarray],
    arrivals: np.ndarray,
    gaps: tuple[np.ndarray, np.ndarray],
    idle_gap: float,
) -> dict[str, Any]:
    g0, g1 = gaps
    span = sum(w.t1 - w.t0 for w in mine)
    toks = sum(int(np.searchsorted(arrivals, w.t1) - np.searchsorted(arrivals, w.t0)) for w in mine)
    over = np.zeros(g0.size, bool)
    stalls = []
    for w in mine:
        hit = (g1 > w.t0) & (g0 < w.t1)
        over |= hit
        if hit.any():  # a window no gap overlaps has no stall (not a stall of 0)
            stalls.append(float((g1[hit] - g0[hit]).max()))
    got = g1[over] - g0[over]
    idle = mine[0].kind == "idle"  # the load alone: its null control is the measure itself
    added = NAN if idle else _added(arrays, [(w.t0, w.t1) for w in mine], idle_gap)
    null = NAN if idle else _added(arrays, _slices(windows, span / len(mine)), idle_gap)
    return {
        "window": mine[0].label,
        "n": len(mine),
        "mean_ms": 1e3 * span / len(mine),
        "tok_s": toks / span if span > 0 else NAN,
        "gap_p50_ms": 1e3 * float(np.percentile(got, 50)) if got.size else NAN,
        "gap_p99_ms": 1e3 * float(np.percentile(got, 99)) if got.size else NAN,
        "gap_max_ms": 1e3 * float(got.max()) if got.size else NAN,
        "stall_ms": 1e3 * median(stalls) if stalls else NAN,
        "added_ms": added,
        "null_ms": null,
        "net_ms": added - null,
    }


def summarize(streams: list[list[float]], windows: list[Window]) -> list[dict[str, Any]]:
    """One row per window label (in :data:`KINDS` order, then by mode): see the module
    docstring. ``tok_s_vs_idle``: the row's tok/s over the idle windows'."""
    arrivals = np.sort(np.concatenate([np.asarray(s) for s in streams if s] or [np.empty(0)]))
    g0, g1 = _gaps(streams)
    arrays = [np.asarray(s) for s in streams]
    idle_hit = np.zeros(g0.size, bool)
    for w in windows:
        if w.kind == "idle":
            idle_hit |= (g1 > w.t0) & (g0 < w.t1)
    idle_gap = float(np.median(g1[idle_hit] - g0[idle_hit])) if idle_hit.any() else NAN
    labels = sorted(
        {w.label: w for w in windows}.values(), key=lambda w: (KINDS.index(w.kind), w.mode)
    )
    rows = [
        _row(
            [w for w in windows if w.label == lab.label],
            windows,
            arrays,
            arrivals,
            (g0, g1),
            idle_gap,
        )
        for lab in labels
    ]
    idle = next((r["tok_s"] for r in rows if r["window"] == "idle"), NAN)
    for r in rows:
        r["tok_s_vs_idle"] = r["tok_s"] / idle if idle > 0 else NAN  # NaN > 0 is False
    return rows
