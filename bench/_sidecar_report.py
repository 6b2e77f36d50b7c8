"""bench/sidecar.py's report: proxy, commit and relay tables, and the targets."""

from __future__ import annotations

import math
import statistics
from typing import Any

from _sidecar_load import MAX_TOKENS
from _sidecar_relay import FOLLOWERS
from _sidecar_world import (
    BACKGROUND_CONCURRENCY,
)
from _util import machine_line, table


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
    return rows


#: Issue 10's targets for the sidecar in front of an engine in its own process.
TARGET_RATIO, TARGET_P50_ADDED_S = 0.95, 1e-3


def target_rows(proxy: list[dict[str, Any]]) -> list[list[str]]:
    """One row per engine, shape and level: the throughput ratio, the p50 latency the sidecar
    adds, its CPU per request (less its idle CPU), and whether both targets are met."""
    rows = []
    for r in proxy:
        s, d = r["sidecar"], r["direct"]
        ratio, added = s["rps"] / d["rps"], s["p50"] - d["p50"]
        met = ratio >= TARGET_RATIO and added <= TARGET_P50_ADDED_S
        rows.append(
            [
                r["engine"],
                "streams" if r.get("shape", "stream") == "stream" else "non-streaming",
                str(r["c"]),
                f"{d['rps']:.1f}/s",
                f"{s['rps']:.1f}/s",
                f"{ratio:.2f}",
                f"{d['p50'] * 1e3:.1f} ms",
                f"{s['p50'] * 1e3:.1f} ms",
                f"{added * 1e3:+.1f} ms",
                f"{(s['cpu'] - d['cpu']) * 1e3:.2f} ms",
                "yes" if met else "no",
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
        "p50 direct",
        "p50 sidecar",
        "p50 added",
        "sidecar CPU/req",
        "met",
    ]
    right = [False, False] + [True] * 9
    return "\n".join(
        [
            (
                f"targets (issue 10): throughput ratio >= {TARGET_RATIO:.2f} and p50 added <= "
                f"{TARGET_P50_ADDED_S * 1e3:g} ms, engine in its own process"
            ),
            table(headers, target_rows(proxy), right),
            (
                "sidecar CPU/req: the sidecar process's CPU per proxied request less its CPU per "
                "request while the direct chunks ran (follower polling)"
            ),
        ]
    )


def commit_rows(modes: list[dict[str, Any]], reload: dict[str, list[float]]) -> list[list[str]]:
    med = statistics.median
    ram, disk, cold = med(reload["ram"]), med(reload["disk"]), med(reload["cold"])
    idle = med(reload["apply"])
    stage = med(reload["stage"])
    rows = [
        _row(
            "commit",
            "idle, no server",
            "swap p50",
            _ms(idle),
            _ms(ram),
            f"{(idle - ram) * 1e3:+.1f} ms",
            idle / ram,
            "reload, view in RAM",
        ),
        _row(
            "commit",
            "idle, no server",
            "staging p50",
            _ms(stage),
            "-",
            "-",
            float("nan"),
            "stage(): prove, serving",
        ),
    ]
    for m in modes:
        swap = [r["swap_s"] for r in m["commits"]]
        stall = [r["stall_s"] for r in m["commits"]]
        staging = [r["fetch_s"] + r["stage_s"] for r in m["commits"]]
        case = f"{m['mode']}, {len(swap)} commits"
        rows += [
            _row(
                "commit",
                case,
                "swap p50",
                _ms(med(swap)),
                _ms(ram),
                f"{(med(swap) - ram) * 1e3:+.1f} ms",
                med(swap) / ram,
                "reload, view in RAM",
            ),
            _row(
                "commit",
                case,
                "swap p50",
                _ms(med(swap)),
                _ms(disk),
                f"{(med(swap) - disk) * 1e3:+.1f} ms",
                med(swap) / disk,
                "reload from disk",
            ),
            _row(
                "commit",
                case,
                "swap p50",
                _ms(med(swap)),
                _ms(cold),
                "-",
                med(swap) / cold,
                "cold engine load",
            ),
            _row(
                "commit",
                case,
                "swap max",
                _ms(max(swap)),
                _ms(max(reload["ram"])),
                "-",
                max(swap) / max(reload["ram"]),
                "reload in RAM, max",
            ),
            _row(
                "commit",
                case,
                "stall p50",
                _ms(med(stall)),
                "-",
                "-",
                float("nan"),
                "drain wait + swap" if m["mode"] == "drain" else "= swap + resume",
            ),
            _row(
                "commit",
                case,
                "staging p50",
                _ms(med(staging)),
                "-",
                "-",
                float("nan"),
                "fetch+decode, serving",
            ),
        ]
    return rows


def relay_rows(relay: dict[str, Any], last: int) -> list[list[str]]:
    rows = []
    for phase, case in (
        ("boot", f"{FOLLOWERS} boot to v0"),
        ("catchup", f"{FOLLOWERS} v0 -> v{last}"),
    ):
        r, d = relay["relay"][phase], relay["direct"][phase]
        rows += [
            _row(
                "relay",
                case,
                "upstream bytes",
                _mb(r["bytes"]),
                _mb(d["bytes"]),
                "-",
                r["bytes"] / d["bytes"],
                "no relay",
            ),
            _row(
                "relay",
                case,
                "upstream GETs",
                str(r["gets"]),
                str(d["gets"]),
                "-",
                r["gets"] / d["gets"],
                "no relay",
            ),
        ]
    return rows


def _failures(ctx: dict[str, Any]) -> str:
    parts = [
        f"{r['engine']} {r.get('shape', 'stream')} {t} c={r['c']}: {len(r[t]['errors'])}"
        for r in ctx["proxy"]
        for t in ("sidecar", "direct")
        if r[t]["errors"]
    ]
    parts += [f"{m['mode']} mode: {len(m['errors'])}" for m in ctx["commits"] if m["errors"]]
    return ", ".join(parts) or "none"


def render(ctx: dict[str, Any]) -> str:
    headers = ["part", "case", "metric", "rollpatch", "baseline", "added", "ratio", "baseline is"]
    commits, relay = ctx["commits"], ctx["relay"]
    rows = proxy_rows(ctx["proxy"])
    if commits:
        rows += commit_rows(commits, ctx["reload"])
    if relay is not None:
        rows += relay_rows(relay, ctx["last_version"])
    right = [False, False, False, True, True, True, True, False]
    foot = [
        "",
        (
            f"machine: {machine_line(ctx['machine'])}; load avg {ctx['load'][0]:.1f} at start, "
            f"{ctx['load'][1]:.1f} at end (shared: compare rows of this run only); "
            f"{ctx['wall_s'] / 60:.1f} min wall"
        ),
        (
            f"model: make_tiny_model hidden 256, 4 layers, vocab 2048 ({ctx['params'] / 1e6:.1f}M "
            f"params, {_mb(ctx['view_bytes'])} bf16 view); proxy: engine, sidecar (as "
            "`rollpatch sidecar --engine-url` runs it) and load generator each in its own "
            "process; commits: built-in engine in this one"
        ),
    ]
    if ctx["patch_bytes"]:
        foot.append(
            f"versions: AdamW lr {ctx['args']['lr']:g}, "
            f"{100 * statistics.median(ctx['changed']):.2f}% of bf16 values change per step "
            f"(median); step patch {statistics.median(ctx['patch_bytes']) / 1e3:.0f} kB "
            f"(median) vs {_mb(ctx['keyframe_bytes'])} keyframe"
        )
    foot += [
        "rollpatch  through rollpatch (sidecar / patch commit / relay); baseline: without it",
        "added      rollpatch - baseline; ratio = rollpatch / baseline (< 1: rollpatch smaller)",
    ]
    if ctx["proxy"]:
        foot += _proxy_foot(ctx)
    if commits:
        foot += _commit_foot(ctx)
    if relay is not None:
        c0 = relay["direct"]["catchup"]
        foot += [
            (
                f"relay      {FOLLOWERS} Followers on ViewEngines sync at once; upstream = "
                "bytes/GETs the file:// board answered (objects, manifests, LATEST);"
            ),
            (
                f"           each follower downloads {_mb(c0['downstream'] / FOLLOWERS)} for the "
                f"catch-up (plan {ctx['relay_plan']}), the same with or without the relay"
            ),
        ]
    checked = []
    if ctx["n_checked"]:
        checked.append(
            f"{ctx['n_checked']} engine/follower digests equal cast_view(masters) computed here"
        )
    if ctx["proxy"]:
        checked.append(
            "identical text per prompt on both proxy paths, every sidecar answer labelled"
        )
    if commits:
        checked.append(
            f"{ctx['spanning']} of {ctx['bg_requests']} pause-mode responses span a commit "
            "(drain: 0)"
        )
    foot += [
        f"verified:  {'; '.join(checked)}",
        (
            f"failed:    requests that got no 200 (excluded above; listed in --json): "
            f"{_failures(ctx)}"
        ),
    ]
    targets = render_targets(ctx["proxy"])
    out = table(headers, rows, right) + "\n" + "\n".join(foot)
    return out + ("\n\n" + targets if targets else "")


def _proxy_foot(ctx: dict[str, Any]) -> list[str]:
    return [
        (
            f"proxy      {MAX_TOKENS}-token completions, temperature 0, c concurrent requests "
            "(closed loop), streamed (SSE, usage in the last chunk) or not; baseline = the "
            "same engine's own URL;"
        ),
        (
            "           chunks in the order "
            f"{'(direct, sidecar, sidecar, direct) x ' + str(ctx['rounds'])}; latency = "
            "client-side wall per request (pooled); throughput = requests / wall"
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


def _commit_foot(ctx: dict[str, Any]) -> list[str]:
    return [
        (
            "commit     swap = CommitGate pause per commit (the staged writes + read-back; pause "
            "mode adds the wait for the forward in flight);"
        ),
        (
            f"           under {BACKGROUND_CONCURRENCY} concurrent requests; stall = the "
            "gate's drain_s + pause_s (drain: admission closed, includes waiting for in-flight "
            "requests)"
        ),
        (
            "           reload, view in RAM = ReferenceRuntime.load_view of the full view (copy + "
            "re-hash under the lock); reload from disk ="
        ),
        (
            "           read + parse the keyframe .safetensors (page cache warm) + load_view; cold "
            "= ReferenceRuntime(model_dir); baselines on a separate"
        ),
        (
            "           runtime, idle, after each mode; idle swap = ReferenceEngine.commit_staged of "
            "the last step's patch (staged first, timed apart), alternated with the"
        ),
        (
            f"           RAM reload; medians of {len(ctx['reload']['ram'])} "
            f"({len(ctx['reload']['cold'])} cold)"
        ),
        "           staging = fetch + decode before the commit, while the engine keeps serving",
    ]


# -- main ----------------------------------------------------------------------------------------
