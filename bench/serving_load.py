"""Staging while the engine serves: what streaming clients feel while versions are committed.

Run: ``python bench/serving_load.py`` (vLLM, 103M parameters by default, a few minutes on the
2-core development machine; needs the vLLM venv from ``scripts/vllm-env``); ``--engine
sglang`` (the SGLang venv from ``scripts/sglang-env``); ``--engine builtin`` (rollpatch's
built-in engine serving in the bench's process, as inside the sidecar: generation and staging
share one process); ``--hidden H --layers L``,
``--versions N``, ``-c`` streams in flight, ``--max-tokens`` per request, ``--kv-on-commit
recompute|keep`` (vLLM: what a commit does to the KV of the streams in flight), ``--tp N``
(vLLM: tensor-parallel ranks, the cores split between them; every sync in place: the
double-buffered commit is TP 1's), ``--staging inline`` (vLLM: stage on the engine loop, not
in a thread), ``--json PATH``.

bench/vllm.py and bench/sglang.py time each path with the engine idle between commits. Here
the same follower
path runs under a closed-loop streaming load (``-c`` completions in flight, temperature 0,
``ignore_eos``, from its own process: bench/_sidecar_load.py, which keeps each chunk's
arrival time), and the bench lays its own events over the arrivals (bench/_load_windows.py):
per version, ``--idle-s`` of load alone, then ``Follower.sync(v)`` (its *stage* up to the
commit, then the *commit*: the gate's pause, writes, reset and resume; odd versions in place,
even ones double-buffered), then the engine's own reload of the same version under its pause
(the full-reload alternative, same load: vLLM's ``reload_weights`` under
``/pause?mode=keep``, SGLang's ``/update_weights_from_disk`` under its pause, the built-in
engine's keyframe load under its pause), with ``--idle-s`` unrecorded before it (the
commit's aftermath and the reload's stall stay out of each other's windows) and after it (the
reload's aftermath stays out of the next idle window). Before
the loaded run the same syncs run with no load, so the table also shows what the load costs
the staging. ``--max-tokens``: keep requests longer than the longest window (a stream must
run through a window for *added* to see it).

Printed: per window kind, tokens per second against the idle windows, the streams' gaps
between tokens (p50 / p99 / max), the median of each window's largest gap (*stall*), and the
time a window adds to a stream that runs through it with its null control and the two's
difference (*added*, *null*, *net*: bench/_load_windows.py says how each is computed); then
stage and visible→serving times with and without the load, the commit gate's pause (the
figure every report uses: from its call to its return) and, where the engine measures it
(vLLM's engine-core hook), the time the engine core itself held generation (*held*): under
load the pause also waits for the forward step in progress, whose tokens still arrive.
Every sync must leave the engine on the published digest, and every request must succeed
with ``max_tokens`` tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

from _load_engines import Side, start
from _load_windows import Window, summarize
from _sidecar_load import BackgroundLoad, bodies, check_errors
from _util import log, machine, machine_line, table
from _vllm_reference import follower, sync_to
from _vllm_server import BenchError
from _vllm_world import World, add_world_args, model_dims

from rollpatch.engines.vllm.kvmode import KvMode

MODES = ("in_place", "double_buffer")


def _mode(v: int, tp: int = 1) -> str:
    """Odd versions in place, even ones double-buffered (at TP > 1 all in place)."""
    return MODES[(v + 1) % 2] if tp == 1 else "in_place"


def _syncs(
    world: World, side: Side, windows: list[Window] | None, idle_s: float = 0.0, tp: int = 1
) -> list[dict[str, Any]]:
    """``Follower.sync(v)`` for v = 1..N from v0, each with its version's write mode; with
    ``windows``: ``idle_s`` of load alone first, each sync's stage and commit windows, and
    after it the engine's own reload of the same version under its pause (its window)."""
    engine = side.engine
    f = follower(world, engine)
    marks: list[tuple[float, float]] = []
    inner = f.gate.run

    def run(write: Any) -> Any:
        t0 = time.monotonic()
        try:
            return inner(write)
        finally:
            marks.append((t0, time.monotonic()))

    f.gate.run = run
    out = []
    for v in range(1, len(world.digests)):
        mode = _mode(v, tp)
        engine.writes = mode
        if windows is not None:
            t = time.monotonic()
            time.sleep(idle_s)
            windows.append(Window("idle", t, time.monotonic()))
        t0 = time.monotonic()
        rec = sync_to(f, world, v)
        if len(marks) != v:
            raise BenchError(f"v{v}: the sync ran {len(marks) - v + 1} commits, not one")
        c0, c1 = marks[-1]
        rec.update(mode=mode, loaded=windows is not None, commit_window_s=c1 - c0)
        side.settle()  # vLLM: the kernel-only words written after the pause, in the sync
        t2 = time.monotonic()
        if windows is not None:
            windows += [
                Window("stage", t0, c0, mode),
                Window("commit", c0, c1, mode),
                Window("sync", t0, max(c1, t2), mode),
            ]
            # unrecorded: the commit's aftermath out of the reload's window, and the reload's
            # stall out of the commit's (a gap that starts in the commit and ends after a
            # reload begun 0.14 s later showed as the commit's gap max: 1.6 s at 441M)
            time.sleep(idle_s)
            r0, r1 = side.reload(v)
            windows.append(Window("reload", r0, r1))
            rec["reload_s"] = r1 - r0
            time.sleep(idle_s)  # the reload's recompute out of the next idle window
        out.append(rec)
        log(
            f"  v{v} {mode}{' loaded' if windows is not None else ''}: stage "
            f"{rec['stage_s'] * 1e3:.0f} ms, pause {rec['pause_s'] * 1e3:.1f} ms"
            + (f", reload {rec['reload_s'] * 1e3:.0f} ms" if windows is not None else "")
        )
    engine.writes = "in_place"
    return out


def _stage_rows(syncs: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for mode in MODES:
        for loaded in (False, True):
            got = [s for s in syncs if s["mode"] == mode and s["loaded"] == loaded]
            if not got:
                continue
            med = {
                k: median(s[k] for s in got) * 1e3
                for k in ("stage_s", "pause_s", "visible_to_serving_s")
            }
            holds = [s["phases_ms"]["core_ms"] for s in got if "core_ms" in s["phases_ms"]]
            rows.append(
                [
                    mode,
                    f"{'under load' if loaded else 'no load'}",
                    str(len(got)),
                    f"{med['stage_s']:.0f}",
                    f"{med['pause_s']:.1f}",
                    f"{median(holds):.1f}" if holds else "-",
                    f"{med['visible_to_serving_s']:.0f}",
                ]
            )
    return rows


def _no_nan(x: Any) -> Any:
    """``x`` with every NaN as None (JSON has no NaN)."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_no_nan(v) for v in x]
    return x


def _ms(x: float, digits: int = 0) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"  # "-": nothing to measure (NaN)


def report(res: dict[str, Any]) -> str:
    w, a = res["world"], res["args"]
    head = (
        f"{res['args']['engine']}"
        + (f" (kv on commit: {a.get('kv_on_commit')})" if a.get("engine") == "vllm" else "")
        + (f", TP {a['tp']}" if a.get("tp", 1) > 1 else "")
        + (f", staging {a['staging']}" if a.get("staging", "thread") != "thread" else "")
        + f", {w['params'] / 1e6:.0f}M params, "
        f"{len(w['digests']) - 1} versions, "
        f"{res['args']['c']} streams x {res['args']['max_tokens']} tokens, load "
        f"{res['load'][0]:.1f} -> {res['load'][1]:.1f}\n{machine_line(res['machine'])}\n"
    )
    rows = [
        [
            r["window"],
            str(r["n"]),
            _ms(r["mean_ms"]),
            _ms(r["tok_s"], 1),
            _ms(r["tok_s_vs_idle"], 2),
            _ms(r["gap_p50_ms"], 1),
            _ms(r["gap_p99_ms"], 1),
            _ms(r["gap_max_ms"]),
            _ms(r["stall_ms"]),
            _ms(r["added_ms"]),
            _ms(r["null_ms"]),
            _ms(r["net_ms"]),
        ]
        for r in res["windows"]
    ]
    t1 = table(
        [
            "window",
            "n",
            "mean ms",
            "tok/s",
            "/ idle",
            "gap p50",
            "gap p99",
            "gap max",
            "stall",
            "added",
            "null",
            "net",
        ],
        rows,
    )
    t2 = table(
        ["writes", "load", "n", "stage ms", "pause ms", "held ms", "visible->serving ms"],
        _stage_rows(res["syncs"]),
    )
    return head + t1 + "\n\n" + t2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=("vllm", "sglang", "builtin"), default="vllm")
    add_world_args(ap, versions=6, hidden=1024, layers=8)
    ap.add_argument("-c", type=int, default=4, help="streams in flight (default 4)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    ap.add_argument("--idle-s", type=float, default=3.0, help="load alone before each sync")
    ap.add_argument(
        "--kv-on-commit",
        choices=("recompute", "keep"),
        default="recompute",
        help="vllm: what a commit does to the KV of the streams in flight (docs/vllm.md)",
    )
    ap.add_argument("--tp", type=int, default=1, help="vllm: tensor-parallel ranks (default 1)")
    ap.add_argument(
        "--staging",
        choices=("thread", "inline"),
        default="thread",
        help="vllm: stage in a thread while serving, or inline on the engine loop",
    )
    ap.add_argument("--json", default=None, help="also write every measurement here")
    args = ap.parse_args(argv)
    if args.versions < 2 or args.c < 1 or args.max_tokens < 2 or args.idle_s <= 0:
        ap.error("--versions >= 2, -c >= 1, --max-tokens >= 2, --idle-s > 0")
    if args.tp < 1 or (args.engine != "vllm" and (args.tp > 1 or args.staging != "thread")):
        ap.error("--tp >= 1; --tp above 1 and --staging inline for --engine vllm only")
    if args.kv_on_commit != "recompute" and args.engine != "vllm":
        ap.error("--kv-on-commit is vLLM's (the built-in engine keeps, SGLang recomputes)")
    mach, load0 = machine(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="rp-bench-load-") as tmp:
        root = Path(tmp)
        log(f"building the model and publishing v0..v{args.versions}")
        world = World(root, args.lr, args.versions, model_dims(args.hidden, args.layers), 8)
        log(f"starting {args.engine} on v0's checkpoint")
        side = start(args.engine, world, root, args.tp)
        if args.engine == "vllm":
            side.engine.kv = KvMode(args.kv_on_commit)  # type: ignore[attr-defined]
            side.engine.staging = args.staging  # type: ignore[attr-defined]
        try:
            log("no load: Follower.sync v1..vN")
            syncs = _syncs(world, side, None, tp=args.tp)
            side.back_to_v0()
            body = bodies(side.model, stream=True, max_tokens=args.max_tokens)
            log(f"under load ({args.c} streams): idle, sync, reload per version")
            load = BackgroundLoad(side.url, args.c, body, token_times=True)
            windows: list[Window] = []
            try:
                time.sleep(2.0)  # the streams under way
                syncs += _syncs(world, side, windows, args.idle_s, args.tp)
                time.sleep(1.0)
            finally:
                got = load.stop()
            check_errors(f"load on {side.url}", got)
        finally:
            side.close()
    res = {
        "args": vars(args),
        "machine": mach,
        "load": (load0, os.getloadavg()[0]),
        "world": {"params": world.params, "digests": world.digests, "changed": world.changed},
        "syncs": syncs,
        "windows": summarize(got["token_times"], windows),
        "window_spans": [[w.kind, w.mode, w.t0, w.t1] for w in windows],
        "token_times": got["token_times"],
    }
    print(report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(_no_nan(res)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
