"""The report of ``bench/peers.py``: per-method summaries, the table with ratios, the targets."""

from __future__ import annotations

import statistics
from typing import Any

from _util import table


def summarize(r: dict[str, Any]) -> dict[str, float]:
    vs = r["versions"]
    alls = [x["all_s"] for x in vs]
    return {
        "wan": statistics.mean(x["wan_bytes"] for x in vs),
        "p50": statistics.median(alls),
        "max": max(alls),
        "blocked_p50": statistics.median(x["blocked_s"] for x in vs),
        "blocked_max": max(x["blocked_s"] for x in vs),
        "published_p50": statistics.median(x["published_s"] for x in vs),
        "cpu": statistics.median(x.get("cpu_s", 0.0) for x in vs),
        "island_peak": max(r["island_peaks"]),
        "region_peak": r["region_peak"],
    }


def render(results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    s = {m: summarize(r) for m, r in results.items()}
    ref = s.get("shardcast")
    xor = s.get("xor")
    rows = []
    for m, x in s.items():
        rows.append(
            [
                m,
                f"{x['wan'] / 1e6:.2f}",
                f"{100 * x['wan'] / meta['view_bytes']:.2f}%",
                f"{ref['wan'] / x['wan']:.1f}x" if ref else "-",
                f"{x['wan'] / xor['wan']:.2f}" if xor else "-",
                f"{x['p50']:.2f}",
                f"{x['max']:.2f}",
                f"{ref['p50'] / x['p50']:.1f}x" if ref else "-",
                f"{x['p50'] / xor['p50']:.2f}" if xor else "-",
                f"{x['blocked_p50']:.2f}/{x['blocked_max']:.2f}",
                f"{x['published_p50']:.2f}",
                f"{x['cpu']:.2f}",
                f"{x['island_peak'] / 2**20:.0f}",
                f"{x['region_peak'] / 2**20:.0f}",
            ]
        )
    return table(
        [
            "method",
            "WAN MB/ver",
            "of view",
            "bytes sc/this",
            "bytes this/xor",
            "all islands p50 s",
            "max s",
            "time sc/this",
            "time this/xor",
            "blocked p50/max s",
            "published p50 s",
            "CPU s/ver",
            "island MiB",
            "relay MiB",
        ],
        rows,
        right=[False] + [True] * 13,
    )


def targets(results: dict[str, dict[str, Any]]) -> list[str]:
    s = {m: summarize(r) for m, r in results.items()}
    if "rollpatch" not in s:
        return []
    rp, out = s["rollpatch"], []
    checks = []
    if "shardcast" in s:
        sc = s["shardcast"]
        checks += [
            (
                "bytes <= 1/50 of shardcast",
                rp["wan"] * 50 <= sc["wan"],
                f"{sc['wan'] / rp['wan']:.1f}x fewer",
            ),
            (
                "every island >= 20x sooner than shardcast (p50)",
                rp["p50"] * 20 <= sc["p50"],
                f"{sc['p50'] / rp['p50']:.1f}x sooner",
            ),
        ]
    if "xor" in s:
        xo = s["xor"]
        checks += [
            (
                "sooner than XOR+zstd-1 (p50)",
                rp["p50"] < xo["p50"],
                f"{rp['p50']:.2f}s vs {xo['p50']:.2f}s",
            ),
            (
                "bytes <= 0.4x XOR+zstd-1",
                rp["wan"] <= 0.4 * xo["wan"],
                f"{rp['wan'] / xo['wan']:.2f}x",
            ),
        ]
    for what, ok, got in checks:
        out.append(f"target {'met    ' if ok else 'NOT MET'}  {what}: {got}")
    return out


def render_cpu(results: dict[str, dict[str, Any]]) -> str:
    """Median CPU seconds per version of each group of the method's processes: what a version
    costs where (on this 2-core machine the whole run shares the same cores, so a method's
    time to version cannot drop below its CPU seconds / cores, whatever the link)."""
    groups = ("trainer", "relays", "link", "islands")
    rows = []
    for m, r in results.items():
        parts = [x["cpu_parts"] for x in r["versions"] if x.get("cpu_parts")]
        if not parts:
            continue
        med = {g: statistics.median(p.get(g, 0.0) for p in parts) for g in groups}
        total = statistics.median(sum(p.values()) for p in parts)
        rows.append([m, *(f"{med[g]:.2f}" for g in groups), f"{total:.2f}"])
    return (
        "CPU seconds per version, median, by process (relays: shardcast's middle node)\n"
        + table(
            ["method", "trainer", "relays", "link", "islands (all)", "total"],
            rows,
            right=[False] + [True] * 5,
        )
    )


def render_load(results: dict[str, dict[str, Any]]) -> str:
    """The 1-minute load average read after each version, per method (min, median, max):
    the machine may be shared, and a method's times are only comparable at similar loads."""
    parts = []
    for m, r in results.items():
        loads = [x["load1"] for x in r["versions"] if "load1" in x]
        if loads:
            parts.append(
                f"{m} {min(loads):.1f} / {statistics.median(loads):.1f} / {max(loads):.1f}"
            )
    return "load average (1 min) after each version, min / median / max: " + "; ".join(parts)
