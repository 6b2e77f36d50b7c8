"""The tables of ``bench/board.py``: formatting, the publish and catch-up rows, the report."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from _board_data import FORMAT, GiB, gib
from _util import (
    machine_line,
    table,
)


def fmt_bytes(n: float) -> str:
    for unit, mult in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= mult:
            return f"{n / mult:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 10 else f"{x:.1f}"


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def publish_rows(
    store: str, recs: list[dict[str, Any]], peaks: list[int], base_rss: int
) -> list[list[str]]:
    rows = []
    kf, patch = recs[0], recs[1:]
    if patch:
        span = f"v{patch[0]['version']}..v{patch[-1]['version']} ({len(patch)})"
        ret = [r["call_return_s"] for r in patch]
        snap = [r["snapshot_s"] for r in patch]
        rows.append(
            [
                store,
                "publish() return",
                span,
                "-",
                "-",
                fmt_s(med(ret)),
                fmt_s(max(ret)),
                f"snapshot {fmt_s(med(snap))}",
                "-",
            ]
        )
        tot = [r["total_s"] for r in patch]
        objs = statistics.mean(1 + len(r["skip_bases"]) for r in patch)
        parts = " ".join(
            f"{k} {fmt_s(med([r[k + '_s'] for r in patch]))}"
            for k in ("cast", "diff", "encode", "upload", "commit")
        )
        rows.append(
            [
                store,
                "publish durable",
                span,
                f"{objs:.2f}",
                fmt_bytes(statistics.mean(r["bytes"] for r in patch)),
                fmt_s(med(tot)),
                fmt_s(max(tot)),
                parts,
                f"{gib(peaks[1])} (+{(peaks[1] - base_rss) / GiB:.1f})",
            ]
        )
    parts = " ".join(
        f"{k} {fmt_s(kf[k + '_s'])}" for k in ("call_return", "cast", "encode", "upload", "commit")
    )
    rows.append(
        [
            store,
            "publish durable",
            f"v{kf['version']} keyframe",
            "1",
            fmt_bytes(kf["bytes"]),
            fmt_s(kf["total_s"]),
            "-",
            parts.replace("call_return", "return"),
            f"{gib(peaks[0])} (+{(peaks[0] - base_rss) / GiB:.1f})",
        ]
    )
    return rows


def catch_up_rows(store: str, results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in results:
        path = {
            "chain": f"chain x{r['commits']}",
            "composed": "chain, 1 commit",
            "folded": "folded",
            "keyframe": "keyframe",
        }[r["path"]]
        if r["label"] == "1 behind":
            path = "step (=all)"
        rows.append(
            [
                store,
                f"catch-up {r['label']}",
                f"{path} {r['plan']}",
                str(r["objects"]),
                fmt_bytes(r["bytes"]),
                fmt_s(r["sync_s"]),
                "-",
                (
                    f"fetch {fmt_s(r['fetch_s'])} stage {fmt_s(r['stage_s'])} commit "
                    f"{fmt_s(r['commit_s'])}"
                ),
                gib(r["peak"]),
            ]
        )
    return rows


def render(rows: list[list[str]], ctx: dict[str, Any]) -> str:
    headers = [
        "store",
        "measure",
        "versions / plan",
        "objs",
        "bytes",
        "time s",
        "max s",
        "breakdown, s (median for publish rows)",
        "peak RSS",
    ]
    right = [False, False, False, True, True, True, True, False, True]
    a, sim, s3 = ctx["args"], ctx["sim"], ctx.get("s3")
    changed = 100 * med(sim["changed"]) / sim["n_params"] if sim["changed"] else 0.0
    foot = [
        "",
        (
            f"machine: {machine_line(ctx['machine'])}; load avg {ctx['load'][0]:.1f} at start, "
            f"{ctx['load'][1]:.1f} at end (shared machine: times are noisy, compare rows of this "
            f"run); {ctx['wall_s'] / 60:.1f} min wall"
        ),
        (
            f"sim: {sim['n_params']:,} params (hidden {sim['dims']['hidden']}, "
            f"{sim['dims']['layers']} layers), lr {a['lr']:g}, served {FORMAT} view "
            f"{fmt_bytes(sim['view_bytes'])}, {changed:.2f}% of its values change per step "
            f"(median); phase 1 (simulator alone, {gib(sim['rss'])} RSS): built in "
            f"{sim['init_s']:.0f}s, sim step {med(sim['steps_s']):.1f}s median, "
            f"{ctx['phase1_s']:.0f}s in all"
        ),
        (
            f"publisher: keyframe_every {a['keyframe_every']} (only v0 is a keyframe), "
            f"skip_strides {tuple(a['skip_strides'])}, max_pending 1; phase 2 (simulator freed): "
            "per version, rebuild FP32 masters whose bf16 cast is the simulator's view, "
            "publish(masters), flush() - nothing overlaps"
        ),
        (
            f"file: {a['versions']} versions v0..v{a['versions'] - 1} published live to file:// "
            "(fsync on, temp dir); catch-up reads them back (warm page cache)"
        ),
    ]
    if s3:
        foot += [
            (
                f"s3: moto standalone server process on loopback; publish rows: v0..v"
                f"{a['s3_versions'] - 1} of the same run published live again, to S3; catch-up "
                f"(paths {a['s3_paths']} and 1 behind) "
                f"reads a byte-identical mirror of the file run ({s3['mirror_keys']} keys, "
                f"{fmt_bytes(s3['mirror_bytes'])}, copied in {s3['mirror_s']:.0f}s); moto peak "
                f"RSS {gib(s3['moto_peak']) if s3['moto_peak'] else 'unknown'}"
            ),
        ]
    foot += [
        (
            "publish() return: wall time the caller is blocked (host snapshot of the masters + "
            "enqueue); publish durable: publish() call -> manifest written and LATEST advanced "
            "(PublisherStats.total_s)"
        ),
        (
            "  objs/bytes: objects and bytes uploaded per version (step patch + skip patches, "
            "mean); breakdown: cast, diff, encode (incl. composing and encoding skip patches), "
            "upload, commit (manifest + LATEST)"
        ),
        (
            "catch-up k behind: a replica holding last-k brought to last, one run each; chain xk "
            "= the k step patches, one Follower.sync and one commit each; chain, 1 commit = the "
            "step patches composed by the follower into one commit; folded = one sync with the "
            "board's fewest-bytes plan (skip patches), one commit; step (=all) = 1 behind, where "
            "every path is the same one patch; boot = empty engine: keyframe, then fewest-bytes "
            "patches"
        ),
        (
            "  objs/bytes: objects and bytes the follower fetched; time: wall of the sync(s) "
            "(plan, fetch, verify, stage, commit); breakdown: sums of Follower.status() "
            "timings"
        ),
        (
            "peak RSS: publish rows = VmHWM of the bench process while publishing the keyframe "
            f"/ the patch versions; (+x) = above its {gib(ctx['base_rss'])} before the first "
            "publish (interpreter, libraries, resident pages of the file-backed FP32 masters); catch-up "
            "rows = VmHWM of the follower subprocess during the sync (reset after its untimed "
            "setup, so the resident base view is included)"
        ),
        (
            f"verified: {ctx['n_checked']} replicas (start and end) and {ctx['n_manifests']} "
            "manifest targets bit-exact against cast_view(simulator masters).digest() from "
            "phase 1"
        ),
    ]
    return table(headers, rows, right) + "\n" + "\n".join(foot)
