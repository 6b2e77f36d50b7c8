"""bench/sidecar.py's report: proxy, commit and relay tables, and the targets."""

from __future__ import annotations

import statistics
from typing import Any

from _sidecar_proxy_report import _mb, _ms, _proxy_foot, _row, proxy_rows, render_targets
from _sidecar_relay import FOLLOWERS
from _sidecar_world import (
    BACKGROUND_CONCURRENCY,
)
from _util import machine_line, table


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
