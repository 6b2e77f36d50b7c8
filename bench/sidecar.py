"""Sidecar benchmark: proxy overhead, engine pause per commit, and relay fan-out.

Run: ``python bench/sidecar.py`` (about 4 minutes on the 2-core development machine),
``python bench/sidecar.py --quick`` (about 1.3 minutes), ``--json out.json`` for every sample.

**Model.** One random BF16 Llama from :func:`make_tiny_model` (hidden 256, 4 layers, 4 heads /
2 kv heads, ff 688, vocab 2048: 4.0M parameters, a 7.9 MB served view) served by the built-in
reference engine (CPU, ``threads=1``) in this process, as ``rollpatch sidecar --engine
reference`` runs it. Every engine of the run loads the same directory.

**Versions.** FP32 masters start as the model's own weights (v0, the only keyframe). Each next
version is one AdamW step (betas 0.9/0.999, ``--lr`` 3e-6, weight decay 0.01) with the Adam
state warm (``m`` at its stationary spread, ``v = E[g^2]``) and gradients ``s_t(0.15 P + e)``:
a persistent direction ``P`` plus i.i.d. noise, ``s_t`` a per-tensor scale; published as
``bf16`` by a synchronous :class:`Publisher` (skip strides (8,)) to a ``file://`` board.

**1. Proxy overhead.** The engine runs in **its own process** (the built-in engine,
``bench/_sidecar_engine.py``; with ``--engines reference,vllm`` also a vLLM 0.32 CPU server),
the sidecar in this one, over real sockets. The same streaming completions (8 short arithmetic
prompts, ``max_tokens`` 8, temperature 0, ``ignore_eos``, ``stream`` with
``include_usage``: every request streams 8 tokens) sent at 1, 16 and 64 concurrent requests
(closed loop), to the engine's own URL (direct) and through the sidecar (drain mode, follower
polling a still board), in chunks ordered (direct, sidecar, sidecar, direct) x 2 rounds (1
with ``--quick``) so drift in the machine's load hits both alike. The load generator is
``httpx.AsyncClient`` in a subprocess (``bench/_sidecar_load.py``). CPU per request: the
sidecar's (this process's ``time.process_time``) and the engine's (its process's, from
``/proc``), each over a chunk — unlike wall-clock rows they do not depend on other jobs.
Checked: every answer is 200 with 8 tokens and the same text for the same prompt on both
paths, and the sidecar labels it with the version it serves.

**2. Engine pause per commit.** For each commit mode a fresh engine + sidecar boots from the
board, then ``--versions`` versions are published one at a time, each waited for, under a
background load of 4 concurrent requests through the sidecar. Per commit: the gate's recorded
pause (``CommitGate.last.pause_s``, the one pause figure: the weight write, staged before; in
pause mode also the wait for the forward pass in flight) and the stall (``drain_s + pause_s``:
in drain mode how long admission stays closed, the wait for in-flight requests included). Baselines, after each mode, idle, on a
separate runtime of the same model: ``ReferenceRuntime.load_view`` of the full view already in
RAM (digests known: only the copy and the re-hash under the forward lock), the same after
reading and parsing the keyframe safetensors from the board (page cache warm), a cold
``ReferenceRuntime(model_dir)``, and, alternated with the RAM reload, the last step's patch
applied by ``ReferenceEngine.apply`` (the same swap, without server or load). Checked: every
commit's and every idle apply's engine digest equals the digest of ``cast_view(masters)``
computed here; in drain mode no response spans a commit.

**3. Relay fan-out.** 8 followers (each a :class:`Follower` on its own :class:`ViewEngine` and
its own board client) boot to v0 and then catch up to the last version, all at once, reading
the ``file://`` board directly or through a :class:`RelayServer` in front of it. Upstream
bytes are counted by one wrapper around the board's store (the same wrapper is the relay's
upstream), so both sides count the same reads. Checked: every follower's digest, recomputed
from its words, equals the publisher-side digest; the relay's own upstream-bytes metric agrees.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _sidecar_engine import cpu_s, engine_process
from _sidecar_load import MAX_TOKENS, BenchError, bodies, run_load
from _sidecar_relay import FOLLOWERS, bench_relay
from _sidecar_world import (
    BACKGROUND_CONCURRENCY,
    RUN,
    World,
    _pct,
    bench_commits,
    bench_reload,
)
from _util import log, machine, machine_line, table

from rollpatch.board import Board
from rollpatch.follower import FollowerConfig

# -- 1. proxy overhead ---------------------------------------------------------------------------


def bench_proxy(
    world: World, kind: str, levels: Sequence[tuple[int, int]], rounds: int
) -> list[dict[str, Any]]:
    """The engine in its own process; each level: ``rounds`` x (direct, sidecar, sidecar,
    direct) streaming chunks. CPU per request: the sidecar's (this process) and the
    engine's (its process), each over the chunk."""
    from rollpatch.sidecar import SidecarConfig
    from rollpatch.sidecar.server import start_sidecar

    adapter, model, url, pid, stop = engine_process(world, kind)
    sc = start_sidecar(
        world.board,
        RUN,
        adapter,
        url,
        config=SidecarConfig(
            commit_mode="drain", follower=FollowerConfig(poll_s=0.5, audit_bytes_per_s=None)
        ),
    )
    urls = {"direct": url, "sidecar": sc.url}
    body = bodies(model, stream=True)
    texts: dict[str, set[str]] = {}
    out = []
    try:
        if not sc.sidecar.follower.wait_for(0, 120):
            raise BenchError("the sidecar never became ready on v0")
        for u in urls.values():  # first requests of a process pay one-time costs
            run_load(u, 2, 16, 0, body)
        for c, n in levels:
            got: dict[str, list[dict[str, Any]]] = {"direct": [], "sidecar": []}
            for target in ("direct", "sidecar", "sidecar", "direct") * rounds:
                cpu0, eng0 = time.process_time(), cpu_s(pid)
                r = run_load(urls[target], c, n // (2 * rounds), min(c, 8), body)
                done = len(r["lat"]) + min(c, 8)
                r["cpu_per_req"] = (time.process_time() - cpu0) / done
                r["engine_cpu_per_req"] = (cpu_s(pid) - eng0) / done
                got[target].append(r)
                for k, v in r["texts"].items():
                    texts.setdefault(k, set()).update(v)
                if target == "sidecar" and set(r["labels"]) != {"0-0"}:
                    raise BenchError(f"sidecar labels {r['labels']} != served v0")
            row: dict[str, Any] = {"engine": kind, "c": c, "n": n}
            for target, runs in got.items():
                lat = [x for r in runs for x in r["lat"]]
                row[target] = {
                    "p50": _pct(lat, 50),
                    "p99": _pct(lat, 99),
                    "rps": len(lat) / sum(r["wall"] for r in runs),
                    "cpu": statistics.median(r["cpu_per_req"] for r in runs),
                    "engine_cpu": statistics.median(r["engine_cpu_per_req"] for r in runs),
                    "errors": [e for r in runs for e in r["errors"]],
                    "lat": lat,
                }
            log(
                f"{kind} c={c}: p50 direct {row['direct']['p50'] * 1e3:.1f} ms, sidecar "
                f"{row['sidecar']['p50'] * 1e3:.1f} ms; req/s {row['direct']['rps']:.1f} vs "
                f"{row['sidecar']['rps']:.1f}; sidecar CPU/req "
                f"{row['sidecar']['cpu'] * 1e3:.2f} ms"
            )
            out.append(row)
    finally:
        sc.stop()
        stop()
    if any(len(v) != 1 for v in texts.values()):
        raise BenchError("the same prompt got different completions at temperature 0")
    return out


# -- report --------------------------------------------------------------------------------------


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
        case = f"{r['engine']}, c={r['c']} streams, {r['n']} req"
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
                "-",
                f"{s['cpu'] * 1e3:+.2f} ms",
                float("nan"),
                "no sidecar",
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
        f"{r['engine']} {t} c={r['c']}: {len(r[t]['errors'])}"
        for r in ctx["proxy"]
        for t in ("sidecar", "direct")
    ]
    parts += [f"{m['mode']} mode: {len(m['errors'])}" for m in ctx["commits"]]
    return ", ".join(parts)


def render(ctx: dict[str, Any]) -> str:
    headers = ["part", "case", "metric", "rollpatch", "baseline", "added", "ratio", "baseline is"]
    rows = (
        proxy_rows(ctx["proxy"])
        + commit_rows(ctx["commits"], ctx["reload"])
        + relay_rows(ctx["relay"], ctx["last_version"])
    )
    right = [False, False, False, True, True, True, True, False]
    a, c0 = ctx["args"], ctx["relay"]["direct"]["catchup"]
    patch_kb = statistics.median(ctx["patch_bytes"]) / 1e3
    foot = [
        "",
        (
            f"machine: {machine_line(ctx['machine'])}; load avg {ctx['load'][0]:.1f} at start, "
            f"{ctx['load'][1]:.1f} at end (shared: compare rows of this run only); "
            f"{ctx['wall_s'] / 60:.1f} min wall"
        ),
        (
            f"model: make_tiny_model hidden 256, 4 layers, vocab 2048 ({ctx['params'] / 1e6:.1f}M "
            f"params, {_mb(ctx['view_bytes'])} bf16 view); proxy: engine in its own process, "
            "sidecar here, load generator in a third; commits: built-in engine in this process"
        ),
        (
            f"versions: AdamW lr {a['lr']:g}, {100 * statistics.median(ctx['changed']):.2f}% of "
            f"bf16 values change per step (median); step patch {patch_kb:.0f} kB (median) vs "
            f"{_mb(ctx['keyframe_bytes'])} keyframe"
        ),
        "rollpatch  through rollpatch (sidecar / patch commit / relay); baseline: without it",
        "added      rollpatch - baseline; ratio = rollpatch / baseline (< 1: rollpatch smaller)",
        (
            f"proxy      {MAX_TOKENS}-token completions, temperature 0, c concurrent requests "
            "(closed loop); baseline = the same engine's own URL; chunks in the order "
            f"{'(direct, sidecar, sidecar, direct) x ' + str(ctx['rounds'])};"
        ),
        (
            "           latency = client-side wall per request (pooled); throughput = requests / "
            "wall; server CPU/req = CPU time of the engine+sidecar process per request"
        ),
        ("           (median over chunks; immune to other jobs' load, unlike the wall-clock rows)"),
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
        (
            f"relay      {FOLLOWERS} Followers on ViewEngines sync at once; upstream = bytes/GETs "
            "the file:// board answered (objects, manifests, LATEST);"
        ),
        (
            f"           each follower downloads {_mb(c0['downstream'] / FOLLOWERS)} for the "
            f"catch-up (plan {ctx['relay_plan']}), the same with or without the relay"
        ),
        (
            f"verified:  {ctx['n_checked']} engine/follower digests equal cast_view(masters) "
            f"computed here; identical text per prompt on both proxy paths; {ctx['spanning']} of "
            f"{ctx['bg_requests']} pause-mode responses span a commit (drain: 0)"
        ),
        (
            f"failed:    requests that got no 200 (excluded above; listed in --json): "
            f"{_failures(ctx)}"
        ),
    ]
    return table(headers, rows, right) + "\n" + "\n".join(foot)


# -- main ----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests and versions")
    ap.add_argument("--lr", type=float, default=3e-6, help="AdamW learning rate")
    ap.add_argument(
        "--versions",
        type=int,
        default=None,
        help="versions published per commit mode (default 12, quick 4)",
    )
    ap.add_argument(
        "--engines",
        default="reference",
        help="proxy part: engines in their own process, comma-separated, or none "
        "to skip the part "
        "(reference, vllm; default reference)",
    )
    ap.add_argument("--json", default=None, help="also write every measurement here")
    args = ap.parse_args(argv)
    engines = [] if args.engines == "none" else args.engines.split(",")
    if not set(engines) <= {"reference", "vllm"}:
        ap.error("--engines: reference and/or vllm, or none")
    versions = args.versions or (4 if args.quick else 12)
    levels = [(1, 40), (16, 96), (64, 128)] if args.quick else [(1, 200), (16, 640), (64, 640)]
    mach = machine()
    load0 = mach["loadavg_1m"] or 0.0
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rp-bench-sidecar-") as tmp:
        root = Path(tmp)
        log("building the model and publishing v0")
        world = World(root, args.lr)
        log("1/3 proxy overhead (engine in its own process)")
        proxy = [
            row
            for kind in engines
            for row in bench_proxy(world, kind, levels, 1 if args.quick else 2)
        ]
        log("2/3 commits vs reloads")
        commits: list[dict[str, Any]] = []
        reload: dict[str, list[float]] = {}
        reps = 4 if args.quick else 8
        for i, mode in enumerate(("drain", "pause")):
            commits.append(bench_commits(world, mode, versions))
            more = bench_reload(world, reps, cold=i == 0)
            for k, v in more.items():
                reload.setdefault(k, []).extend(v)
        log("3/3 relay fan-out")
        relay = bench_relay(world, root)
        board = Board(world.board)
        last = max(world.digests)
        ctx = {
            "args": vars(args),
            "machine": mach,
            "rounds": 1 if args.quick else 2,
            "proxy": proxy,
            "commits": commits,
            "reload": reload,
            "relay": relay,
            "last_version": last,
            "changed": world.changed,
            "params": sum(t.n_elements for t in world.view.values()),
            "view_bytes": world.view.nbytes,
            "keyframe_bytes": board.manifest(RUN, 0).keyframes[0].ref.size,
            "patch_bytes": [
                board.manifest(RUN, v).patches_from(v - 1)[0].ref.size for v in range(1, last + 1)
            ],
            "relay_plan": " ".join(f"{b}->{t}" for b, t in relay["direct"]["catchup"]["plan"]),
            "n_checked": 2 * versions + 4 * FOLLOWERS + 2 * (reps + 1),
            "spanning": commits[1]["spanning"],
            "bg_requests": commits[1]["requests"],
        }
    ctx["wall_s"] = time.perf_counter() - t_start
    ctx["load"] = (load0, os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0)
    print(render(ctx))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ctx, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
