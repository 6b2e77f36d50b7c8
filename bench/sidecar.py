"""Sidecar benchmark: proxy overhead, engine pause per commit, and relay fan-out.

Run: ``python bench/sidecar.py`` (about 4 minutes on the 2-core development machine, when
quiet), ``python bench/sidecar.py --quick``, ``--json out.json`` for every sample;
``--parts proxy`` (or ``commits``, ``relay``) runs only those parts. At load 12–15, ``--quick
--parts proxy --shapes stream`` took about 4 minutes per engine (vLLM's boot included).

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
and so does the sidecar (``bench/_sidecar_proc.py``, as ``rollpatch sidecar --engine-url``
runs it: nothing of this process's heap in it), over real sockets. The same completions (8
short arithmetic prompts, ``max_tokens`` 8, temperature 0, ``ignore_eos``; ``--shapes``:
``stream`` with ``include_usage``, every request streaming 8 tokens, and ``once``, one JSON
answer) sent at 1, 16 and 64 concurrent requests (closed loop), to the engine's own URL
(direct) and through the sidecar (drain mode, follower polling a still board), in time-based
chunks (``--chunk-s``, default 5 s) alternated in ``--pairs`` (default 3) pairs (direct,
sidecar), (sidecar, direct), ... so drift in the machine's load hits both alike; each pair
gives one throughput ratio and one p50 difference, and their spread is reported
(``bench/_sidecar_proxy.py``). A last table holds issue 10's targets per engine, shape and level: the
throughput ratio (sidecar / direct, >= 0.95 wanted), the p50 latency the sidecar adds
(<= 1 ms wanted) and its CPU per request. The load generator is rollpatch's own pooled client on uvloop in a
subprocess (``bench/_sidecar_load.py``; its CPU per request is reported, far below the
sidecar's and the engine's). CPU per request: the sidecar's and the engine's process CPU
time (from ``/proc``) over a chunk, divided by its requests; the sidecar's baseline is its
own CPU over the direct chunks (the follower polling, nothing proxied). Unlike wall-clock
rows, CPU rows hardly depend on other jobs. Checked: every answer is 200 with 8 tokens and
the same text for the same prompt on both paths, and the sidecar labels it with the version
it serves.

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
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _sidecar_proxy import bench_proxy
from _sidecar_relay import FOLLOWERS, bench_relay
from _sidecar_report import render
from _sidecar_world import RUN, World, bench_commits, bench_reload
from _util import log, machine

from rollpatch.board import Board


def _levels(text: str, ap: argparse.ArgumentParser) -> list[int]:
    """``--levels 1,16,64``: distinct positive concurrency levels."""
    try:
        cs = [int(x) for x in text.split(",")]
    except ValueError:
        ap.error(f"--levels: comma-separated positive integers, not {text!r}")
    if not cs or min(cs) < 1 or len(set(cs)) != len(cs):
        ap.error(f"--levels: distinct positive integers, not {text!r}")
    return cs


# -- report --------------------------------------------------------------------------------------


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
    ap.add_argument(
        "--shapes",
        default="stream,once",
        help="proxy part: request shapes, comma-separated (stream: SSE, once: one JSON "
        "answer; default both)",
    )
    ap.add_argument(
        "--parts",
        default="proxy,commits,relay",
        help="parts to run, comma-separated (proxy, commits, relay; default all)",
    )
    ap.add_argument(
        "--sidecar-loop",
        choices=("fast", "asyncio"),
        default="fast",
        help="proxy part: the sidecar server's event loop (fast: uvloop when installed, as "
        "`rollpatch sidecar` runs; asyncio: the loop before issue 10's work)",
    )
    ap.add_argument(
        "--sidecar-http",
        choices=("fast", "h11"),
        default="fast",
        help="proxy part: the sidecar server's HTTP parser (fast: httptools when installed, as "
        "`rollpatch sidecar` runs; h11: the parser before issue 10's work)",
    )
    ap.add_argument(
        "--sidecar-relay",
        choices=("tap", "task"),
        default="tap",
        help="proxy part: how the sidecar relays a stream (tap: in the engine connection's "
        "protocol, as `rollpatch sidecar` runs; task: in the request's task, as before)",
    )
    ap.add_argument(
        "--levels",
        default=None,
        help="proxy part: concurrency levels, comma-separated (default 1,16,64)",
    )
    ap.add_argument(
        "--chunk-s",
        type=float,
        default=None,
        help="proxy part: seconds per chunk (no request starts after that; default 5, quick 2)",
    )
    ap.add_argument(
        "--pairs",
        type=int,
        default=None,
        help="proxy part: alternated (direct, sidecar) chunk pairs per engine, shape and level "
        "(default 3, quick 2)",
    )
    ap.add_argument("--json", default=None, help="also write every measurement here")
    args = ap.parse_args(argv)
    engines = [] if args.engines == "none" else args.engines.split(",")
    if not set(engines) <= {"reference", "vllm"}:
        ap.error("--engines: reference and/or vllm, or none")
    shapes = args.shapes.split(",")
    if not shapes or not set(shapes) <= {"stream", "once"}:
        ap.error("--shapes: stream and/or once")
    parts = set(args.parts.split(","))
    if not parts or not parts <= {"proxy", "commits", "relay"}:
        ap.error("--parts: proxy, commits and/or relay")
    if "proxy" not in parts:
        engines = []
    versions = args.versions or (4 if args.quick else 12)
    levels = [1, 16, 64] if args.levels is None else _levels(args.levels, ap)
    chunk_s = args.chunk_s or (2.0 if args.quick else 5.0)
    pairs = args.pairs or (2 if args.quick else 3)
    if chunk_s <= 0 or pairs < 1:
        ap.error("--chunk-s must be positive and --pairs at least 1")
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
            for row in bench_proxy(
                world,
                kind,
                levels,
                pairs,
                chunk_s,
                shapes,
                args.sidecar_loop,
                args.sidecar_http,
                args.sidecar_relay,
            )
        ]
        commits: list[dict[str, Any]] = []
        reload: dict[str, list[float]] = {}
        reps = 4 if args.quick else 8
        if "commits" in parts:
            log("2/3 commits vs reloads")
            for i, mode in enumerate(("drain", "pause")):
                commits.append(bench_commits(world, mode, versions))
                more = bench_reload(world, reps, cold=i == 0)
                for k, v in more.items():
                    reload.setdefault(k, []).extend(v)
        relay: dict[str, Any] | None = None
        if "relay" in parts:
            if len(world.digests) < 2:
                world.step()  # the catch-up needs a version past v0
            log("3/3 relay fan-out")
            relay = bench_relay(world, root)
        board = Board(world.board)
        last = max(world.digests)
        ctx = {
            "args": vars(args),
            "machine": mach,
            "pairs": pairs,
            # passed through to bench's vLLM server (docs/vllm.md); unset: vLLM's own spin
            "vllm_poll_ms": os.environ.get("ROLLPATCH_VLLM_POLL_MS") if "vllm" in engines else None,
            "chunk_s": chunk_s,
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
            "relay_plan": ""
            if relay is None
            else " ".join(f"{b}->{t}" for b, t in relay["direct"]["catchup"]["plan"]),
            "n_checked": (2 * versions + 2 * (reps + 1) if commits else 0)
            + (4 * FOLLOWERS if relay else 0),
            "spanning": commits[1]["spanning"] if commits else 0,
            "bg_requests": commits[1]["requests"] if commits else 0,
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
