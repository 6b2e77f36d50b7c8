"""bench/vllm.py's catch-up table: each catch-up path against 1 behind, per engine, in wall
time (visible->serving) and CPU time, medians; and the sample helpers the report shares."""

from __future__ import annotations

import math
import statistics
from typing import Any

from _util import table


def render_catchup(ctx: dict[str, Any]) -> str:
    """The catch-up rows against 1 behind, per engine: wall (visible->serving) and CPU time
    (this process + the vLLM worker), medians, with the plan's hops and the load."""
    k, fold = ctx["catchup_n"], ctx.get("fold_every", 0)
    anchor = f"{k} behind from v0" + (" (anchor: folded)" if fold else " (chain)")
    paths = [
        ("vLLM", "1 behind", one_behind(ctx)),
        ("vLLM", anchor, ctx["catchup"]),
        ("vLLM", f"{k} behind from v1 (chain)", ctx.get("catchup_chain") or []),
        ("built-in", "1 behind", one_behind(ctx, "reference_")),
        ("built-in", anchor, ctx["reference_catchup"]),
        (
            "built-in",
            f"{k} behind from v1 (booted at v1: chain)",
            ctx.get("reference_catchup_chain") or [],
        ),
        (
            "built-in",
            f"{k} behind from v1 (followed: rewind + fold)",
            ctx.get("reference_catchup_followed") or [],
        ),
    ]
    rows, one = [], {}
    for eng, name, runs in paths:
        if not runs or "cpu_s" not in runs[0]:
            continue
        vis, cpu = _med(runs, "visible_to_serving_s"), _med(runs, "cpu_s")
        if name == "1 behind":
            one[eng] = (vis, cpu)
        v1, c1 = one.get(eng, (vis, cpu))
        rows.append(
            [
                f"{eng} {name}",
                str(len(runs)),
                str(statistics.median(len(r["hops"]) for r in runs)),
                _ms(vis),
                f"{vis / v1:.2f}x",
                _ms(cpu),
                f"{cpu / c1:.2f}x",
                _ms(_med(runs, "stage_s")),
                _ms(_med(runs, "pause_s")),
                f"{statistics.median(r['load'] for r in runs):.1f}",
            ]
        )
    if not rows:
        return ""
    return table(
        [
            "catch-up",
            "n",
            "hops",
            "visible->serving p50",
            "/ 1 behind",
            "CPU p50",
            "/ 1 behind",
            "stage p50",
            "pause p50",
            "load",
        ],
        rows,
        [False] + [True] * 9,
    ) + (
        f"\n1 behind = v{k - 1} -> v{k}, timed in turn with the catch-ups (same load); CPU ="
        f" user + system of the bench process and the vLLM worker over the sync (all threads);"
        f" fold_every {fold}: v0 is an anchor, v1 is not; load = 1-min load average at each"
        f" sync's end (2 cores)"
    )


def _ms(s: float) -> str:
    if math.isnan(s):
        return "-"  # a path this run did not take (double-buffered at TP > 1)
    return f"{s * 1e3:.0f}" if s >= 0.1 else f"{s * 1e3:.1f}"


def _med(runs: list[dict[str, Any]], key: str) -> float:
    """The median of ``key`` over ``runs``; NaN when there are none."""
    return statistics.median(float(r[key]) for r in runs) if runs else math.nan


def _pct(part: float, whole: float) -> str:
    """``part`` as a percentage of ``whole``; "-" for a path not taken (NaN)."""
    return "-" if math.isnan(part) else f"{100 * part / whole:.1f}%"


def one_behind(ctx: dict[str, Any], prefix: str = "") -> list[dict[str, Any]]:
    """The 1-behind samples the catch-up ratios divide by (``prefix`` "reference_": the
    built-in engine's): those timed in turn with the catch-ups, or in a run from before them,
    the staged path's."""
    fallback = "reference" if prefix else "staged"
    return ctx.get(f"{prefix}catchup_one") or ctx[fallback]
