"""bench/vllm_load.py's analysis: streamed token arrivals laid over the bench's own windows.

A *window* is a span of ``time.monotonic()`` (system-wide, so the load generator's arrival
times and the bench's events share one clock) with a kind: ``idle`` (the load alone),
``stage`` (a follower sync up to its commit: fetch, stage in the worker while it serves),
``commit`` (the commit gate's run: pause, writes, reset, resume), ``reload`` (vLLM's own
``reload_weights`` under ``/pause?mode=keep``). For each kind, over all its windows:

- *tok/s*: token arrivals inside the windows per second of window;
- *gaps*: for every stream, each interval between two consecutive arrivals that overlaps a
  window (a stall that spans a commit counts once, whole); p50, p99 and the largest;
- *stall*: per window, the largest gap overlapping it, then the median over the windows (what
  one commit costs a client that is mid-stream);
- *added*: what a window costs a stream that runs through it, in time: for every stream with
  arrivals before and after the window, the span from its last arrival before the window to
  its first after, less that many gaps at the idle windows' median gap; the median over all
  (window, stream) pairs. Short windows hold a token or two per stream, so *tok/s* there is
  coarse; *added* is not. Its null control (*null*): the same measure over slices of the idle
  windows as long as the row's windows (0 ms when the load alone is steady).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Any

import numpy as np

KINDS = ("idle", "stage", "commit", "reload")


@dataclass(frozen=True)
class Window:
    kind: str
    t0: float
    t1: float
    mode: str = ""  # the commit's writes ("in_place", "double_buffer"); "" otherwise

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
    return 1e3 * median(got) if got else float("nan")


def _slices(windows: list[Window], length: float) -> list[tuple[float, float]]:
    """The idle windows cut into spans of ``length`` seconds."""
    out = []
    for w in windows:
        if w.kind == "idle" and length > 0:
            n = int((w.t1 - w.t0) // length)
            out += [(w.t0 + k * length, w.t0 + (k + 1) * length) for k in range(n)]
    return out


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
    idle_gap = float(np.median(g1[idle_hit] - g0[idle_hit])) if idle_hit.any() else 0.0
    labels = sorted(
        {w.label: w for w in windows}.values(), key=lambda w: (KINDS.index(w.kind), w.mode)
    )
    rows: list[dict[str, Any]] = []
    for lab in (w.label for w in labels):
        mine = [w for w in windows if w.label == lab]
        span = sum(w.t1 - w.t0 for w in mine)
        toks = sum(
            int(np.searchsorted(arrivals, w.t1) - np.searchsorted(arrivals, w.t0)) for w in mine
        )
        over = np.zeros(g0.size, bool)
        stalls = []
        for w in mine:
            hit = (g1 > w.t0) & (g0 < w.t1)
            over |= hit
            stalls.append(float((g1[hit] - g0[hit]).max()) if hit.any() else 0.0)
        gaps = g1[over] - g0[over]
        rows.append(
            {
                "window": lab,
                "n": len(mine),
                "mean_ms": 1e3 * span / len(mine),
                "tok_s": toks / span if span > 0 else 0.0,
                "gap_p50_ms": 1e3 * float(np.percentile(gaps, 50)) if gaps.size else 0.0,
                "gap_p99_ms": 1e3 * float(np.percentile(gaps, 99)) if gaps.size else 0.0,
                "gap_max_ms": 1e3 * float(gaps.max()) if gaps.size else 0.0,
                "stall_ms": 1e3 * median(stalls),
                # the load alone has no "added": its null control is the measure itself
                "added_ms": float("nan")
                if lab == "idle"
                else _added(arrays, [(w.t0, w.t1) for w in mine], idle_gap),
                "null_ms": float("nan")
                if lab == "idle"
                else _added(arrays, _slices(windows, span / len(mine)), idle_gap),
            }
        )
    idle = next((r["tok_s"] for r in rows if r["window"] == "idle"), 0.0)
    for r in rows:
        r["tok_s_vs_idle"] = r["tok_s"] / idle if idle else 0.0
    return rows
