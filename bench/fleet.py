"""Fleet simulator: rollpatch vs XOR+zstd-1 deltas vs full-checkpoint broadcast on one fleet.

Run: ``python bench/fleet.py`` (the issue's frontier scenario and variants, a few seconds),
``--validate out/demo/summary.json`` to check the model against a real ``rollpatch demo`` run
(predicted vs measured time-to-version), ``--json PATH`` to write every number
(``frontier.ttv_p95_s``, ``frontier.egress_ratio``, ...).

Model and assumptions: docs/fleet.md; code: ``bench/_fleet_model.py`` (links, regions,
scenario, measured costs), ``_fleet_sim.py`` (the event loop), ``_fleet_metrics.py``,
``_fleet_scenarios.py``, ``_fleet_demo.py`` (validation).

Per-component CPU costs are *measured on this machine*: encode and decode+apply seconds per
byte of served view (as a function of the patch fraction) and XOR+zstd-1's size ratio are
fitted from ``bench/out/codec*.json`` (written by ``bench/codec.py``; one-thread rows of the
scenario's format); BLAKE3's rate (the full-checkpoint method hashes its shards) is measured
at start on 64 MiB. Everything else (links, fleet, core counts) is a stated assumption.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from _fleet_demo import validate
from _fleet_metrics import Summary, summarize
from _fleet_model import METHODS, Costs, Scenario, load_costs, measure_blake3
from _fleet_scenarios import frontier
from _fleet_sim import simulate
from _util import machine, machine_line, parse_size, table

HERE = Path(__file__).resolve().parent
DEFAULT_COSTS = [HERE / "out" / "codec.json", HERE / "out" / "codec-1b.json"]


def fmt_bytes(n: float) -> str:
    for unit, k in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_s(s: float) -> str:
    return "inf" if s == float("inf") else f"{s:.1f}"


def run_rows(
    label: str, sc: Scenario, costs: Costs, methods: tuple[str, ...]
) -> list[tuple[str, Scenario, Summary]]:
    out = []
    for m in methods:
        out.append((label, sc, summarize(sc, simulate(sc, costs, m))))  # type: ignore[arg-type]
    return out


def render(rows: list[tuple[str, Scenario, Summary]], base: dict[str, Summary]) -> str:
    head = [
        "scenario",
        "method",
        "payload/step",
        "publish s",
        "ttv p50 s",
        "ttv p95 s",
        "ttv max s",
        "egress/step",
        "egress/(payload×regions)",
        "egress vs rollpatch",
        "relay hit",
        "lag 0",
        "lag>K dropped",
        "skipped/island",
    ]
    body = []
    for label, sc, s in rows:
        ref = base[label]
        body.append(
            [
                label,
                s.method,
                fmt_bytes(s.payload_bytes),
                f"{s.publish_s:.1f}",
                fmt_s(s.ttv_p50_s),
                fmt_s(s.ttv_p95_s),
                fmt_s(s.ttv_max_s),
                fmt_bytes(s.egress_per_step),
                f"{s.egress_ratio:.3f}",
                f"{s.egress_per_step / ref.egress_per_step:.2f}x",
                f"{s.relay_hit:.3f}",
                f"{s.lag.get(0, 0.0):.3f}",
                f"{s.dropped_frac:.3f} (K={sc.max_lag})",
                f"{s.skipped:.1f}",
            ]
        )
    right = [False, False] + [True] * (len(head) - 2)
    return table(head, body, right)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--costs",
        nargs="*",
        type=Path,
        default=DEFAULT_COSTS,
        help="bench/codec.py JSON files to fit the codec costs from",
    )
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--islands", type=int, default=100)
    p.add_argument("--regions", type=int, default=5)
    p.add_argument("--inter-gbps", type=float, default=10.0)
    p.add_argument(
        "--validate",
        type=Path,
        default=None,
        help="a `rollpatch demo` summary.json to validate the model against",
    )
    p.add_argument(
        "--memory",
        type=parse_size,
        default=None,
        metavar="PARAMS",
        help="also measure memory budgets on a model of PARAMS (e.g. 100M)",
    )
    p.add_argument(
        "--overlap",
        type=parse_size,
        default=None,
        metavar="PARAMS",
        help="also validate the shard overlap against a real follower on a model of PARAMS",
    )
    p.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/rollpatch-fleet"),
        help="work directory of --memory (versions are cached there)",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    t_start = time.perf_counter()
    info = machine()
    print(machine_line(info))
    fmt = "fp8-e4m3-block128"
    costs = load_costs(list(args.costs), fmt, blake3_Bps=measure_blake3())
    print(
        f"costs ({fmt}, per core, s per byte of view = a + b·patch_frac; fitted from "
        f"{', '.join(costs.source)}): encode a={costs.enc[0]:.3e} b={costs.enc[1]:.3e}; "
        f"decode+apply a={costs.dec[0]:.3e} b={costs.dec[1]:.3e} (of it the verifying "
        f"re-hash a={costs.dec_verify[0]:.3e} b={costs.dec_verify[1]:.3e}); XOR+zstd-1 encode "
        f"a={costs.xor_enc[0]:.3e} b={costs.xor_enc[1]:.3e}, decode a={costs.xor_dec[0]:.3e} "
        f"b={costs.xor_dec[1]:.3e}, size {costs.xor_ratio:.2f}x rollpatch's; "
        f"BLAKE3 {costs.blake3_Bps / 1e9:.2f} GB/s (measured now)"
    )
    kw = {"islands": args.islands, "regions": args.regions, "inter_bps": args.inter_gbps * 1e9}
    front = frontier(steps=args.steps, **kw)  # type: ignore[arg-type]
    scenarios = [
        ("frontier", front, METHODS),
        ("frontier, patch 2%", dataclasses.replace(front, patch_frac=(0.02, 0.02)), ("rollpatch",)),
        (
            "frontier, patch 0.5%",
            dataclasses.replace(front, patch_frac=(0.005, 0.005)),
            ("rollpatch",),
        ),
        (
            "frontier, 256 apply cores/island",
            dataclasses.replace(front, apply_cores=256),
            ("rollpatch",),
        ),
        (
            "frontier, decode after the fetch (before)",
            dataclasses.replace(front, overlap_apply=False),
            ("rollpatch", "xor"),
        ),
        (
            "frontier, loss 1e-4, 64 streams",
            frontier(steps=args.steps, loss=1e-4, streams=64, **kw),
            ("rollpatch", "xor"),
        ),  # type: ignore[arg-type]
        (
            "frontier, 1 Gbit/s links",
            frontier(steps=args.steps, islands=args.islands, regions=args.regions, inter_bps=1e9),
            ("rollpatch", "xor"),
        ),
    ]
    rows: list[tuple[str, Scenario, Summary]] = []
    sim_s: dict[str, float] = {}
    for label, sc, methods in scenarios:
        t = time.perf_counter()
        rows += run_rows(label, sc, costs, methods)
        sim_s[label] = time.perf_counter() - t
    base = {label: s for label, _, s in rows if s.method == "rollpatch"}
    n_remote = sum(not r.home for r in front.regions)
    print(
        f"\nfrontier: {fmt_bytes(front.view_bytes)} view ({fmt}), {sum(r.islands for r in front.regions)} "
        f"islands in {len(front.regions)} regions ({n_remote} remote, "
        f"{args.inter_gbps:g} Gbit/s, RTT {', '.join(f'{r.upstream.rtt_s * 1e3:.0f}' for r in front.regions if not r.home)} ms), "
        f"a step every {front.step_s:g} s, {front.steps} steps, patch {front.patch_frac[0]:.1%}–"
        f"{front.patch_frac[1]:.1%} of the view, keyframe every {front.keyframe_every}; "
        f"{front.ranks} trainer ranks × {front.rank_cores} cores; islands decode on "
        f"{front.apply_cores} cores; max_lag K={front.max_lag}"
    )
    print(
        "ttv: seconds from the trainer's publish() call to an island serving that version "
        "(or newer), over every island and version; egress: bytes leaving the trainer's "
        "region per step\n"
    )
    print(render(rows, base))
    f = base["frontier"]
    targets = [
        (
            "frontier egress ≤ 1.2× (patch × regions)",
            f.egress_ratio <= 1.2,
            f"{f.egress_ratio:.3f}",
        ),
        ("frontier ttv p95 ≤ 30 s", f.ttv_p95_s <= 30.0, f"{f.ttv_p95_s:.1f} s"),
        (
            "simulator run for the frontier scenario < 60 s",
            sim_s["frontier"] < 60,
            f"{sim_s['frontier']:.1f} s (3 methods)",
        ),
    ]
    print("\ntargets:")
    for name, ok, got in targets:
        print(f"  [{'MET' if ok else 'MISSED'}] {name}: {got}")
    val = None
    if args.validate is not None:
        val = validate(args.validate, costs)
        print(
            f"\nvalidation against a real demo run ({val['summary']}: {val['versions']} "
            f"versions, view {fmt_bytes(val['view_bytes'])}, patch {fmt_bytes(val['patch_bytes_mean'])} "
            f"mean, emulated WAN {val['wan_mbps']} Mbit/s + {val['wan_latency_ms']} ms, "
            f"poll {val['poll_s']} s; island-local cost calibrated on 'local': "
            f"{val['local_cost_s']:.3f} s)"
        )
        vrows = [
            [
                n,
                f"{r['measured_s']:.3f}",
                f"{r['predicted_s']:.3f}",
                f"{r['error']:+.1%}",
                "calibration" if r["calibration"] else "prediction",
            ]
            for n, r in val["islands"].items()
        ]
        print(
            table(
                ["island", "measured ttv s", "predicted ttv s", "error", "row"],
                vrows,
                [False, True, True, True, False],
            )
        )
    mem = None
    if args.memory is not None:
        from _fleet_memory import render as render_memory
        from _fleet_memory import run as run_memory

        mem = run_memory(args.work, args.memory)
        print(
            f"\nmemory budgets (measured per phase in child processes: peak of live "
            f"allocations above the phase's start (tracemalloc), and peak-RSS growth; BF16 view "
            f"{fmt_bytes(mem['view_bytes'])}, {mem['n_params'] / 1e6:.0f}M params; one "
            f"publisher rank = the largest shard; the publisher's baseline includes the "
            f"trainer's FP32 masters, the follower's step baseline the engine's weights)"
        )
        print(render_memory(mem))
    ovl = None
    if args.overlap is not None:
        from _fleet_overlap import render as render_overlap
        from _fleet_overlap import run as run_overlap

        ovl = run_overlap(args.work, args.overlap)
        print(
            f"\nshard overlap, validated (a real follower syncing {ovl['ranks']} shard objects "
            f"per version of a {ovl['n_params'] / 1e6:.0f}M-param BF16 view "
            f"({fmt_bytes(ovl['view_bytes'])}) over an emulated {ovl['mbps']:g} Mbit/s, "
            f"{ovl['rtt_ms']:g} ms link; predicted = the model's formula over the parts "
            f"measured on their own in the same run)"
        )
        print(render_overlap(ovl))
    wall = time.perf_counter() - t_start
    print(f"\nsimulator wall time {wall:.1f} s")
    if args.json:
        doc: dict[str, Any] = {
            "machine": info,
            "args": {k: str(v) for k, v in vars(args).items()},
            "costs": dataclasses.asdict(costs),
            "frontier": {
                "ttv_p95_s": f.ttv_p95_s,
                "egress_ratio": f.egress_ratio,
                "sim_s": sim_s["frontier"],
            },
            "rows": [{"scenario": label, **dataclasses.asdict(s)} for label, _, s in rows],
            "targets": [{"target": n, "met": ok, "value": g} for n, ok, g in targets],
            "validation": val,
            "memory": mem,
            "overlap": ovl,
            "wall_s": wall,
        }
        args.json.write_text(json.dumps(doc, indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
