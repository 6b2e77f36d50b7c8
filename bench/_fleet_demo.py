"""Validation: the simulator against a real `rollpatch demo` run (3 islands, 2 relays).

The demo's ``summary.json`` gives what the model needs and what it must predict: when LATEST
named each version, each version's patch bytes, the emulated WAN (bandwidth, added round
trip per upstream request: ``rollpatch.store.ThrottledStore``), the follower poll period and
the relays' TTLs (``rollpatch.demo.relays``: 0.2 s for LATEST and listings), and per island
the measured time from LATEST naming a version to the island serving it.

One number is calibrated, not predicted: the island-local cost of a version (fetch over
loopback, verify, decode, stage, drain in-flight requests, commit), taken as the *local*
island's mean time-to-version minus its expected poll wait (``poll_s / 2``). The two remote
islands (eu, us) are predictions: the same local cost plus what the model says the relay,
the TTL caches and the WAN add. The local island's row is shown as the calibration.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from _fleet_model import Costs, Link, Region, Scenario
from _fleet_sim import Version, simulate

#: ``rollpatch.demo.relays --ttl`` default (LATEST and listings), seconds.
DEMO_RELAY_TTL_S = 0.2
#: One HTTP request relay → island over loopback, seconds (order of magnitude; small).
LOOPBACK_RTT_S = 0.002


def validate(summary_path: Path, costs: Costs, seeds: int = 30) -> dict[str, Any]:
    """Predicted vs measured mean time-to-version (from LATEST) per island of a demo run."""
    d = json.loads(summary_path.read_text())
    cfg, model = d["config"], d["model"]
    rows = [v for v in d["versions"] if v["version"] >= 1]
    t0 = d["versions"][0]["t_latest"]
    versions = [Version(0, 0.0, 0.0, 0.0, 0.0, True)]
    view = float(model.get("full_view_bytes", 0) or 0)
    for r in rows:
        t = r["t_latest"] - t0 + 10.0
        versions.append(
            Version(
                r["version"],
                t,
                t,
                r["patch_bytes"] / view if view else 0.0,
                float(r["patch_bytes"]),
                bool(r["keyframe"]),
            )
        )
    measured = {
        name: float(
            np.mean(
                [
                    r["time_to_version"][name]["seconds"]
                    for r in rows
                    if name in r["time_to_version"]
                ]
            )
        )
        for name in d["islands"]
    }
    poll = float(cfg["poll_s"])
    local_cost = measured["local"] - poll / 2
    # one object per version, on one connection per request (rollpatch.netem: real TCP)
    wan = Link(
        bps=float(cfg["wan_mbps"]) * 1e6, rtt_s=float(cfg["wan_latency_ms"]) / 1e3, streams=1
    )
    regions = (
        Region(
            name="local", islands=1, home=True, relayed=False, upstream=Link(bps=8e9, rtt_s=0.0)
        ),
        Region(name="eu", islands=1, upstream=wan),
        Region(name="us", islands=1, upstream=wan),
    )
    predicted: dict[str, list[float]] = {n: [] for n in measured}
    for seed in range(seeds):
        sc = Scenario(
            name="demo",
            regions=regions,
            view_bytes=max(view, 1.0),
            format=costs.format,
            patch_frac=(1e-6, 1e-6),
            step_s=1.0,
            steps=len(rows),
            keyframe_every=0,
            ranks=1,
            poll_s=poll,
            pointer_ttl_s=DEMO_RELAY_TTL_S,
            list_ttl_s=DEMO_RELAY_TTL_S,
            relay_bps=8e9,
            island_bps=8e9,
            lan_rtt_s=LOOPBACK_RTT_S,
            apply_cores=1 << 20,
            commit_s=local_cost,
            seed=seed,
        )
        res = simulate(sc, costs, "rollpatch", versions=versions)
        for isl in res.islands:
            ttv = [next(t for t, n in isl.commits if n >= v.n) - v.t_latest for v in versions[1:]]
            predicted[isl.region].append(float(np.mean(ttv)))
    out = {}
    for name, m in measured.items():
        p = float(np.mean(predicted[name]))
        out[name] = {
            "measured_s": m,
            "predicted_s": p,
            "error": p / m - 1,
            "calibration": name == "local",
        }
    return {
        "summary": str(summary_path),
        "versions": len(rows),
        "view_bytes": view,
        "patch_bytes_mean": float(np.mean([r["patch_bytes"] for r in rows])),
        "wan_mbps": cfg["wan_mbps"],
        "wan_latency_ms": cfg["wan_latency_ms"],
        "poll_s": poll,
        "local_cost_s": local_cost,
        "islands": out,
    }
