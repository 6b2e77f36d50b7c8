"""bench/sidecar.py's proxy tables: per engine, shape and concurrency, the direct and sidecar
paths side by side, and the targets of issue 10 (throughput ratio, p50 added, CPU/request)."""

from __future__ import annotations

import math
from typing import Any

from _sidecar_load import MAX_TOKENS
from _sidecar_proxy import TARGET_P50_ADDED_S, TARGET_RATIO, meets
from _util import table


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 10 else f"{x:.2f} s"


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _row(
    part: str, case: str, metric: str, mine: str, base: str, added: str, ratio: float, vs: str
) -> list[str]:
    return [
        part,
        case,
        metric,
        mine,
        base,
        added,
        f"{ratio:.2f}" if not math.isnan(ratio) else "-",
        vs,
    ]


def proxy_rows(proxy: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in proxy:
        s, d = r["sidecar"], r["direct"]
        what = "streams" if r.get("shape", "stream") == "stream" else "non-streaming"
        case = f"{r['engine']}, c={r['c']} {what}, {r['n']} req"
        for q in ("p50", "p99"):
            rows.append(
                _row(
                    "proxy",
                    case,
                    f"{q} latency",
                    _ms(s[q]),
                    _ms(d[q]),
                    f"{(s[q] - d[q]) * 1e3:+.1f} ms",
                    s[q] / d[q],
                    "direct",
                )
            )
        rows.append(
            _row(
                "proxy",
                case,
                "throughput",
                f"{s['rps']:.1f}/s",
                f"{d['rps']:.1f}/s",
                f"{s['rps'] - d['rps']:+.1f}/s",
                s["rps"] / d["rps"],
                "direct",
            )
        )
        rows.append(
            _row(
                "proxy",
                case,
                "sidecar CPU/req",
                f"{s['cpu'] * 1e3:.2f} ms",
                f"{d['cpu'] * 1e3:.2f} ms",
                f"{(s['cpu'] - d['cpu']) * 1e3:+.2f} ms",
                float("nan"),
                "sidecar idle (direct)",
            )
        )
        rows.append(
            _row(
                "proxy",
                case,
                "engine CPU/req",
                _ms(s["engine_cpu"]),
                _ms(d["engine_cpu"]),
                f"{(s['engine_cpu'] - d['engine_cpu']) * 1e3:+.1f} ms",
                s["engine_cpu"] / d["engine_cpu"],
                "direct",
            )
        )
        if "client_cpu" in s:  # runs before the load generator reported its own
            rows.append(
                _row(
                    "proxy",
                    case,
                    "load generator CPU/req",
                    f"{s['client_cpu'] * 1e3:.2f} ms",
                    f"{d['client_cpu'] * 1e3:.2f} ms",
                    f"{(s['client_cpu'] - d['client_cpu']) * 1e3:+.2f} ms",
                    s["client_cpu"] / d["client_cpu"],
                    "direct",
                )
            )
    return rows


def _spread(xs: list[float], fmt: str) -> str:
    return "-" if not xs else f"{fmt.format(min(xs))}..{fmt.format(max(xs))}"


def target_rows(proxy: list[dict[str, Any]]) -> list[list[str]]:
    """One row per engine, shape and level: the throughput ratio, the p50 latency the sidecar
    adds, its CPU per request (less its idle CPU), whether both targets are met by the pooled
    figures, and per (direct, sidecar) chunk pair: the ratio's and the p50 added's range and
    how many pairs met both."""
    rows = []
    for r in proxy:
        s, d = r["sidecar"], r["direct"]
        ratio, added = s["rps"] / d["rps"], s["p50"] - d["p50"]
        met = meets(ratio, added)
        pairs = r.get("pairs", [])  # runs before time-based chunks had none
        rows.append(
            [
                r["engine"],
                "streams" if r.get("shape", "stream") == "stream" else "non-streaming",
                str(r["c"]),
                f"{d['rps']:.1f}/s",
                f"{s['rps']:.1f}/s",
                f"{ratio:.2f}",
                _spread([p["ratio"] for p in pairs], "{:.2f}"),
                f"{d['p50'] * 1e3:.1f} ms",
                f"{s['p50'] * 1e3:.1f} ms",
                f"{added * 1e3:+.1f} ms",
                _spread([p["p50_added"] * 1e3 for p in pairs], "{:+.1f}"),
                f"{(s['cpu'] - d['cpu']) * 1e3:.2f} ms",
                f"{s['client_cpu'] * 1e3:.2f} ms" if "client_cpu" in s else "-",
                "yes" if met else "no",
                f"{sum(int(p['met']) for p in pairs)}/{len(pairs)}" if pairs else "-",
            ]
        )
    return rows


def render_targets(proxy: list[dict[str, Any]]) -> str:
    """The targets table (empty when the proxy part did not run)."""
    if not proxy:
        return ""
    headers = [
        "engine",
        "shape",
        "c",
        "direct",
        "sidecar",
        "ratio",
        "pair ratios",
        "p50 direct",
        "p50 sidecar",
        "p50 added",
        "pairs added ms",
        "sidecar CPU/req",
        "client CPU/req",
        "met",
        "pairs met",
    ]
    right = [False, False] + [True] * 13
    return "\n".join(
        [
            (
                f"targets (issue 10): throughput ratio >= {TARGET_RATIO:.2f} and p50 added <= "
                f"{TARGET_P50_ADDED_S * 1e3:g} ms, engine in its own process"
            ),
            table(headers, target_rows(proxy), right),
            (
                "sidecar CPU/req: the sidecar process's CPU per proxied request less its CPU per "
                "request while the direct chunks ran (follower polling); client CPU/req: the load "
                "generator's own, through the sidecar"
            ),
            (
                "ratio, p50 added, met: all chunks of a path pooled; pair ratios, pairs added ms: "
                "min..max over the alternated (direct, sidecar) chunk pairs; pairs met: pairs "
                "meeting both targets"
            ),
        ]
    )


def _proxy_foot(ctx: dict[str, Any]) -> list[str]:
    out = [
        (
            f"proxy      {MAX_TOKENS}-token completions, temperature 0, c concurrent requests "
            "(closed loop), streamed (SSE, usage in the last chunk) or not; baseline = the "
            "same engine's own URL;"
        ),
        (
            f"           {ctx['pairs']} alternated pairs of {ctx['chunk_s']:g}-s chunks "
            "(direct, sidecar), (sidecar, direct), ... (no request starts after a chunk's "
            "time; those in flight finish);"
        ),
        (
            "           latency = client-side wall per request (pooled keep-alive client); "
            "throughput = requests / wall"
        ),
        (
            "           sidecar CPU/req = CPU time of the sidecar's process per "
            "request over a chunk, median over chunks; its baseline is the same process"
        ),
        (
            "           during the direct chunks (follower polling, nothing proxied): 'added' is "
            "what proxying costs; engine CPU/req likewise from /proc"
        ),
        "           (CPU rows depend far less on other jobs' load than the wall-clock rows)",
    ]
    if "vllm" in {r["engine"] for r in ctx["proxy"]}:
        poll = ctx.get("vllm_poll_ms")
        out.append(
            "           vLLM's shm readers: "
            + (
                f"ROLLPATCH_VLLM_POLL_MS={poll}"
                if poll
                else "vLLM's own 1-s spin (ROLLPATCH_VLLM_POLL_MS unset)"
            )
        )
    return out
