"""The end of a demo run: invariant checks, the JSON report, plots and the summary table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import RollpatchError
from .config import RUN
from .live import fmt_bytes
from .monitor import Monitor
from .routing import routing_invariant, routing_line

__all__ = ["build_report", "check_invariants", "summary_table", "write_plots"]


def check_invariants(m: Monitor) -> dict[str, dict[str, Any]]:
    """Each invariant: ``{"ok": bool, "detail": str}`` (skipped ones have ``ok`` None)."""
    out: dict[str, dict[str, Any]] = {}
    ver = m.verified or {}
    if "skipped" in ver:
        out["labels_match_weights"] = {"ok": None, "detail": ver["skipped"]}
    else:
        checked, bad = int(ver.get("checked", 0)), int(ver.get("mismatches", -1))
        out["labels_match_weights"] = {
            "ok": checked > 0 and bad == 0,
            "detail": f"{checked} of {ver.get('of', '?')} rollouts served (used in training "
            f"or not: some were still in flight at the end) regenerated under their "
            f"labelled version: {bad} differ (token id or logprob); control: "
            f"{ver.get('control_detected', 0)}/{ver.get('control_rollouts', 0)} "
            "differ under the previous version",
        }
    final = m.latest
    steps = m.cfg.steps
    dropped = (m.trained or {}).get("dropped_versions", -1)
    seen = [v for _, v in m.latest_seen]
    out["latest_only_advanced"] = {
        "ok": not m.latest_backwards
        and final == steps
        and dropped == 0
        and sorted(m.published) == list(range(steps + 1)),
        "detail": f"{len(seen)} polls of LATEST, {len(m.latest_backwards)} moved backwards; "
        f"versions 0..{final} published ({dropped} dropped by the publisher)",
    }
    behind = {i.name: i.served for i in m.islands.values() if i.served != final}
    out["islands_on_latest"] = {
        "ok": not behind and final is not None,
        "detail": f"every island serves v{final}" if not behind else f"behind: {behind}",
    }
    out["fetched_bytes_verified"] = _verified_bytes(m)
    if m.cfg.model == "moe":
        out["routing_replays"] = routing_invariant(m.routing, ver)
    return out


def _verified_bytes(m: Monitor) -> dict[str, Any]:
    """Every commit's digest is the board's target; no follower error; no relay refusal."""
    problems = list(m.commit_order_errors)
    commits = 0
    for isl in m.islands.values():
        for v, _, digest in isl.commits:
            commits += 1
            try:
                target = m.board.manifest(RUN, v).target
            except RollpatchError as e:
                problems.append(f"{isl.name} v{v}: {e}")
                continue
            if digest != target:
                problems.append(
                    f"{isl.name} committed v{v} with digest {str(digest)[:12]} "
                    f"!= target {target[:12]}"
                )
        if isl.status.get("last_error"):
            problems.append(f"{isl.name}: {isl.status['last_error']}")
    refused = sum(r.refused for r in m.relays.values())
    if refused:
        why = "; ".join(
            f"{r.name}: " + ", ".join(f"{k} {n}" for k, n in sorted(r.refused_by.items()))
            for r in m.relays.values()
            if r.refused
        )
        problems.append(
            f"relays refused {refused} upstream answers ({why}; each logged with its key in "
            "logs/relays.log)"
        )
    fetched = sum(i.bytes_fetched for i in m.islands.values())
    return {
        "ok": not problems and commits > 0,
        "detail": (
            f"{commits} commits, each digest == the board's target; "
            f"{fmt_bytes(fetched)} fetched by islands, every object checked "
            "(size + BLAKE3) before use; relays refused 0"
        )
        if not problems
        else "; ".join(problems[:5]),
    }


def build_report(
    m: Monitor, invariants: dict[str, dict[str, Any]], timings: dict[str, float]
) -> dict[str, Any]:
    """The JSON report (see docs/demo.md, "The JSON report")."""
    ttv = m.time_to_version()
    full = m.ready.get("full_view_bytes")
    versions = []
    for v, pub in sorted(m.published.items()):
        versions.append(
            {
                "version": v,
                "t_latest": pub["t_latest"] - m.t0,
                "keyframe": pub["keyframe"],
                "patch_bytes": pub["patch_bytes"],
                "bytes_uploaded": pub["bytes"],
                "changed": pub["changed"],
                "time_to_version": ttv.get(v, {}),
            }
        )
    served = (m.trained or {}).get("served", {})
    islands = {}
    for isl in m.islands.values():
        islands[isl.name] = {
            "reads_from": isl.link,
            "versions_loaded": [v for v, _, _ in isl.commits],
            "answers_by_version": served.get(isl.name, {}),
            "answers": sum(served.get(isl.name, {}).values()),
            "bytes_fetched": isl.bytes_fetched,
            "final_version": isl.served,
            "mean_time_to_version_s": m.mean_ttv(isl.name),
            "commit_pause_s": isl.status.get("last_pause_s"),
        }
    used: dict[str, int] = {}
    dropped: dict[str, int] = {}
    for s in m.steps:
        for k, n in s["used_by_lag"].items():
            used[k] = used.get(k, 0) + n
        for k, n in s["dropped_by_lag"].items():
            dropped[k] = dropped.get(k, 0) + n
    cfg = m.cfg
    return {
        "config": json.loads(cfg.to_json()),
        "emulated_wan": {
            "mbps": cfg.wan_mbps,
            "latency_ms": cfg.wan_latency_ms,
            "note": "emulated on loopback by rollpatch.netem (real TCP through a "
            "userspace link emulator: latency_ms is the added round trip, "
            "half each way, mbps a cap per region and direction) between "
            "the board's origin relay and each regional relay; no real "
            "network",
        },
        "timings_s": timings,
        "model": {
            "params": m.ready.get("params"),
            "full_view_bytes": full,
            "served_elements": m.ready.get("n_elements"),
            "warmup_digit_mass": m.ready.get("digit_mass"),
        },
        "reward_curve": [s["reward"] for s in m.steps],
        "steps": [
            {
                k: s[k]
                for k in (
                    "step",
                    "version",
                    "reward",
                    "loss",
                    "ratio_mean",
                    "clip_frac",
                    "used_by_lag",
                    "dropped_by_lag",
                    "islands",
                    "step_s",
                    "wait_s",
                )
            }
            for s in m.steps
        ],
        "rollouts": {
            "total": (m.trained or {}).get("rollouts"),
            "used_by_lag": used,
            "dropped_by_lag": dropped,
            "refused_then_retried": m.steps[-1]["refusals"] if m.steps else 0,
        },
        "versions": versions,
        "patch_bytes_mean": _mean([p["patch_bytes"] for p in versions if p["version"] >= 1]),
        "islands": islands,
        "relays": {
            r.name: {
                "upstream_bytes": r.upstream_bytes,
                "served_bytes": r.served_bytes,
                "refused": r.refused,
                "refused_by_reason": r.refused_by,
                "link": r.link,
            }
            for r in m.relays.values()
        },
        "verification": m.verified,
        "routing": m.routing,
        "invariants": invariants,
        "ok": all(i["ok"] is not False for i in invariants.values()),
    }


def _by_lag(counts: dict[str, int]) -> str:
    if not counts:
        return "none"
    return ", ".join(f"lag {k}: {counts[k]}" for k in sorted(counts, key=int))


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summary_table(r: dict[str, Any]) -> str:
    """The human summary printed at the end."""
    full = r["model"]["full_view_bytes"]
    curve = r["reward_curve"]
    head = curve[: max(1, len(curve) // 5)]
    tail = curve[-max(1, len(curve) // 5) :]
    mean_patch = r["patch_bytes_mean"] or 0
    lines = [
        "",
        (
            f"== rollpatch demo: {len(curve)} GRPO steps, {len(r['versions'])} versions, "
            f"{r['timings_s']['total_s']:.0f} s =="
        ),
        (
            f"reward   {sum(head) / len(head):.2f} (first steps) -> {sum(tail) / len(tail):.2f} "
            "(last steps)"
        ),
        (
            f"versions full view {fmt_bytes(full)}; patch per version {fmt_bytes(mean_patch)} "
            f"({100 * mean_patch / full:.1f}% of the view)"
        ),
        (
            f"rollouts used     {_by_lag(r['rollouts']['used_by_lag'])}; dropped (in stale "
            f"groups) {_by_lag(r['rollouts']['dropped_by_lag'])}"
        ),
        (
            "time     "
            + ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in r["timings_s"].items())
        ),
        "",
        (
            f"{'island':<7} {'reads from':<26} {'versions':>8} {'answers':>8} {'fetched':>9} "
            f"{'ttv mean':>9} {'final':>6}"
        ),
    ]
    for name, i in r["islands"].items():
        ttv = i["mean_time_to_version_s"]
        lines.append(
            f"{name:<7} {i['reads_from']:<26} {len(i['versions_loaded']):>8} "
            f"{i['answers']:>8} {fmt_bytes(i['bytes_fetched']):>9} "
            f"{'-' if ttv is None else f'{ttv:.2f} s':>9} v{i['final_version']}"
        )
    for name, rel in r["relays"].items():
        lines.append(
            f"relay {name}: {fmt_bytes(rel['upstream_bytes'])} over the emulated WAN, "
            f"{fmt_bytes(rel['served_bytes'])} served to its islands"
        )
    if r.get("routing"):
        lines.append(routing_line(r["routing"]))
    lines.append("")
    for name, inv in r["invariants"].items():
        mark = {True: "PASS", False: "FAIL", None: "SKIP"}[inv["ok"]]
        lines.append(f"[{mark}] {name}: {inv['detail']}")
    return "\n".join(lines)


def write_plots(r: dict[str, Any], m: Monitor, out: Path) -> list[Path]:
    """reward.png, versions.png, bytes.png in ``out`` (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, (ax, dens) = plt.subplots(
        2, 1, figsize=(6, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    ax.plot(range(1, len(r["reward_curve"]) + 1), r["reward_curve"], marker=".")
    ax.axhline(0.1, ls=":", c="gray", label="chance (10%)")
    ax.set(ylabel="mean reward of the batch", ylim=(0, 1), title="GRPO reward (1+d → units digit)")
    ax.legend()
    n, full = r["model"].get("served_elements"), r["model"]["full_view_bytes"]
    vs = [p for p in r["versions"] if p["version"] >= 1]
    if n and full and vs:  # version n is published after step n
        dens.plot(
            [p["version"] for p in vs],
            [100 * p["changed"] / n for p in vs],
            marker=".",
            label="BF16 values changed",
        )
        dens.plot(
            [p["version"] for p in vs],
            [100 * p["patch_bytes"] / full for p in vs],
            marker="s",
            ms=3,
            label="patch size / full view",
        )
    dens.set(xlabel="step (= version published after it)", ylabel="% per step", ylim=(0, None))
    dens.legend(fontsize=7)
    paths.append(_save(fig, out / "reward.png"))

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.5, 6))
    # islands usually serve the same versions: offset each line a little so all stay visible
    styles = [("-", "o", -0.15), ("--", "s", 0.0), (":", "^", 0.15)]
    for i, isl in enumerate(m.islands.values()):
        ls, mk, dy = styles[i % len(styles)]
        pts = [(t - m.t0, v) for v, t, _ in isl.commits]
        top.step(
            [t for t, _ in pts],
            [v + dy for _, v in pts],
            where="post",
            ls=ls,
            lw=1.5,
            label=f"{isl.name} ({isl.link}){f', {dy:+.2f}' if dy else ''}",
        )
        ttv = [
            (p["version"], p["time_to_version"][isl.name]["seconds"])
            for p in r["versions"]
            if p["version"] >= 1 and isl.name in p["time_to_version"]
        ]
        bottom.plot(
            [v for v, _ in ttv], [s for _, s in ttv], ls=ls, marker=mk, ms=4, label=isl.name
        )
    pub = sorted((p["t_latest"], p["version"]) for p in r["versions"])
    top.step(
        [t for t, _ in pub], [v for _, v in pub], where="post", c="k", ls="--", lw=1, label="LATEST"
    )
    top.set(
        xlabel="seconds since start",
        ylabel="version served (lines offset ±0.15)",
        title="each island's version over time",
    )
    top.legend(fontsize=7)
    bottom.set(
        xlabel="version",
        ylabel="seconds",
        ylim=(0, None),
        title="time-to-version: LATEST names it → the island serves it",
    )
    bottom.legend(fontsize=7)
    paths.append(_save(fig, out / "versions.png"))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    vs = [p for p in r["versions"] if p["version"] >= 1]
    ax.bar([p["version"] for p in vs], [p["patch_bytes"] / 1e3 for p in vs], label="patch")
    ax.axhline(r["model"]["full_view_bytes"] / 1e3, c="r", ls="--", label="full view (checkpoint)")
    ax.set_yscale("log")  # real-regime patches are ~1% of the view: keep both readable
    ax.set(
        xlabel="version",
        ylabel="kB per version (10³ bytes, log scale)",
        title="bytes per version vs a full checkpoint",
    )
    ax.legend()
    paths.append(_save(fig, out / "bytes.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
