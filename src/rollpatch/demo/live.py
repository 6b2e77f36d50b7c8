"""The terminal view: a small status block redrawn in place (plain ANSI), or log lines.

Live mode redraws the block every half second; ``--no-live`` (and any non-terminal stdout)
prints one line per training step instead, which is what CI logs and tests want.
"""

from __future__ import annotations

import sys
from itertools import pairwise
from typing import Any, TextIO

from .monitor import Monitor

__all__ = ["LiveView", "density", "fmt_bytes", "sparkline", "status_block", "step_line"]

_BARS = "▁▂▃▄▅▆▇█"


def fmt_bytes(n: float | None) -> str:
    """``1.2 MB``-style (decimal units)."""
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _secs(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f} s"


def sparkline(values: list[float], width: int = 25) -> str:
    """Rewards (0..1) as block characters; longer series are averaged into ``width`` bins."""
    if len(values) > width:
        edges = [round(i * len(values) / width) for i in range(width + 1)]
        values = [sum(values[a:b]) / (b - a) for a, b in pairwise(edges)]
    return "".join(_BARS[min(max(int(v * len(_BARS)), 0), len(_BARS) - 1)] for v in values)


def density(m: Monitor) -> str:
    """``v7 changed 1.9% patch 0.8%`` for the newest published step: the share of served
    values it changed, and its patch's size as a share of the full view."""
    with m.lock:
        v = max((v for v in m.published if v >= 1), default=None)
        pub = None if v is None else m.published[v]
        n, full = m.ready.get("n_elements"), m.ready.get("full_view_bytes")
    if pub is None or not n or not full:
        return "changed -  patch -"
    return (
        f"v{v} changed {100 * pub['changed'] / n:.1f}% patch {100 * pub['patch_bytes'] / full:.1f}%"
    )


def status_block(m: Monitor) -> list[str]:
    """The lines of the live view."""
    cfg = m.cfg
    with m.lock:
        steps = list(m.steps)
        latest = m.latest
        full = m.ready.get("full_view_bytes")
        patch = [p["patch_bytes"] for v, p in m.published.items() if v >= 1]
        relays = list(m.relays.values())
        islands = list(m.islands.values())
    last = steps[-1] if steps else {}
    used: dict[str, int] = {}
    dropped = 0
    for s in steps:
        for lag, n in s.get("used_by_lag", {}).items():
            used[lag] = used.get(lag, 0) + n
        dropped += sum(s.get("dropped_by_lag", {}).values())
    lags = " ".join(f"lag{k}:{used[k]}" for k in sorted(used, key=int)) or "-"
    reward = f"{last['reward']:.2f}" if last else "-"
    lines = [
        (
            f"rollpatch demo · async GRPO over 3 islands · WAN EMULATED on this machine: "
            f"{cfg.wan_mbps:g} Mbit/s, +{cfg.wan_latency_ms:g} ms RTT"
        ),
        (
            f"trainer  step {last.get('step', 0):>3}/{cfg.steps}  reward {reward}  "
            f"{sparkline([s['reward'] for s in steps])}  {density(m)}"
        ),
        (
            f"         LATEST v{latest if latest is not None else '-'}   rollouts used {lags}   "
            f"dropped (lag>{cfg.max_lag}) {dropped}"
        ),
        (
            f"{'island':<7} {'reads from':<26} {'serving':>7} {'lag':>4} {'fetched':>9} "
            f"{'ttv last':>9} {'ttv mean':>9} {'answers':>8}"
        ),
    ]
    for isl in islands:
        ttv = m.time_to_version()
        last_ttv = next(
            (
                r[isl.name]["seconds"]
                for v, r in sorted(ttv.items(), reverse=True)
                if v >= 1 and isl.name in r
            ),
            None,
        )
        served = f"v{isl.served}" if isl.served is not None else "-"
        lag = m.lag(isl.name)
        lines.append(
            f"{isl.name:<7} {isl.link:<26} {served:>7} "
            f"{lag if lag is not None else '-':>4} {fmt_bytes(isl.bytes_fetched):>9} "
            f"{_secs(last_ttv):>9} {_secs(m.mean_ttv(isl.name)):>9} "
            f"{isl.requests:>8}"
        )
    up = sum(r.upstream_bytes for r in relays)
    down = sum(r.served_bytes for r in relays)
    mean_patch = sum(patch) / len(patch) if patch else None
    share = (
        f" = {100 * mean_patch / full:.0f}% of the {fmt_bytes(full)} view"
        if mean_patch and full
        else ""
    )
    lines.append(
        f"bytes    board→relays {fmt_bytes(up)} (emulated WAN)   relays→islands "
        f"{fmt_bytes(down)}   patch/version {fmt_bytes(mean_patch)}{share}"
    )
    return lines


def step_line(m: Monitor, step: dict[str, Any]) -> str:
    """One plain log line for a finished step. The step has just published LATEST, so the
    islands are still on an earlier version, on its way to them: each is shown with the
    version it serves and how long that version took to reach it (time-to-version)."""
    parts = [
        f"step {step['step']:>3}/{m.cfg.steps}",
        f"reward {float(step['reward']):.3f}",
        density(m),
        f"LATEST v{step['version']} just published",
    ]
    ttv = m.time_to_version()
    for isl in m.islands.values():
        if isl.served is None:
            parts.append(f"{isl.name} -")
            continue
        hit = ttv.get(isl.served, {}).get(isl.name) if isl.served >= 1 else None
        took = f" (in {hit['seconds']:.2f} s)" if hit is not None else ""
        parts.append(f"{isl.name} v{isl.served}{took}")
    return "  ".join(parts)


class LiveView:
    """Redraws :func:`status_block` in place, or prints step lines when not live."""

    def __init__(self, monitor: Monitor, live: bool, stream: TextIO | None = None) -> None:
        self.m = monitor
        self.stream = stream if stream is not None else sys.stdout
        self.live = live and self.stream.isatty()
        self._drawn = 0
        self._steps_logged = 0

    def say(self, text: str) -> None:
        """A message above the block (the block is redrawn below it)."""
        self._clear()
        print(text, file=self.stream, flush=True)

    def refresh(self) -> None:
        if self.live:
            self._clear()
            lines = status_block(self.m)
            self.stream.write("\n".join(lines) + "\n")
            self.stream.flush()
            self._drawn = len(lines)
            return
        with self.m.lock:
            new = self.m.steps[self._steps_logged :]
        for step in new:
            print(step_line(self.m, step), file=self.stream, flush=True)
        self._steps_logged += len(new)

    def close(self) -> None:
        """Leave the last block on screen (live) or flush pending step lines."""
        if self.live:
            self.refresh()
            self._drawn = 0
        else:
            self.refresh()

    def _clear(self) -> None:
        if self.live and self._drawn:
            self.stream.write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = 0
