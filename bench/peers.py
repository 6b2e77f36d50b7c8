"""Peers side by side: rollpatch, shardcast and XOR+zstd-1 over the same emulated WAN.

Run: ``python bench/peers.py`` (100M parameters, 10 versions, 1 Gbit/s, 50 ms RTT: about
15 minutes on 2 shared cores, most of it preparing versions and shardcast's transfers), or
``--params 20M --versions 4`` for a quick look. ``--json F`` writes every measurement.
shardcast comes with the ``bench`` extra: ``pip install -e '.[bench]'``.

**Versions.** :mod:`rollpatch.sim` (AdamW, warm Adam state, ``--lr`` 1e-6: ~1.2% of BF16
values change per step) makes v0..vN once (cached in ``--work``); each version is its BF16
view on disk (the safetensors checkpoint shardcast broadcasts) and its root digest. Before
each step the trainer loads that version's masters (the BF16 words widened to FP32, whose
cast is exactly the view), untimed.

**Topology, the same for every method.** Trainer region: the trainer (this process) and its
origin (rollpatch's board on ``file://`` served by a relay; shardcast's ``OriginServer``).
One emulated WAN link (``rollpatch.netem`` in its own process: ``--mbps`` shared per
direction, ``--rtt-ms`` round trip, real loopback TCP). Island region: one relay (rollpatch's
relay; shardcast's middle node) and ``--islands`` islands, each its own process, on loopback
behind it. Islands start holding v0 (untimed).

**Methods.** ``rollpatch``: ``Publisher`` (bf16, async) → board → relays → ``Follower`` into a
view engine (``--island-commit fused``, the default: the verified patch object decoded
straight into the live words in one native pass, ``apply_encoded``, inside the pause, as the
XOR islands apply theirs in place; ``incremental``: staged while serving and written in the
pause as the serving engines do, target digests checked in O(change); ``full``: every
touched tensor re-hashed inside the pause. No island re-hashes its live words in the
background: the follower's audit runs only where the engine implements ``audit()``, and
``ViewEngine`` does not; every island's words are re-hashed once, at the end). Followers
and XOR islands learn of
a version through the relays' long-poll of LATEST (docs/relay.md), which each relay answers
once the version's manifest and step patch are verified in its cache (the origin relay reads
the directory board's LATEST every ``--origin-watch-s`` and wakes at once on inotify when it
is renamed into place; the region relay gets the manifest and step patch pushed in the
origin's announcing answer, ``--push-bytes``, docs/relay.md "Push"; the islands' long-polls
of the region relay take them the same way, ``FollowerConfig.push_bytes``, rollpatch's and
XOR's alike). The trainer process imports torch and hands rollpatch's publisher the masters
as torch CPU tensors (``--trainer-cast torch``, the default: what a torch trainer hands it;
zero-copy views of the same memory); the publisher casts them with the native core in one
pass that also lists the step's changes (``publisher/cast.py``, the same path as numpy
masters: torch's own cast only for tensors on a device, or without the native core;
``tests/test_publisher_native_cast.py``), and composes each step
into its skip accumulators 0.5 s after LATEST moved (``core.SETTLE_AFTER_S``), not while the
islands decode it. ``xor``: the XOR+zstd-1 per-tensor deltas with xxh3-128 (Stitch's encoder
method; ``bench/_peers_xor.py``), published asynchronously on the same board, fetched through
the same relays; only the codec differs. ``shardcast``: the trainer writes the BF16
checkpoint and calls ``OriginServer.broadcast`` (BLAKE3 + 50 MB shards); the middle node
(polling every ``--poll-s``, the CLI's minimum is 1 s) pulls the shards over the link;
islands run shardcast's ``ClientNode.download_version`` from the middle and load the file.

**Per version** (published one at a time: the next step starts when every island serves the
previous one): bytes through the link (both directions, all traffic: polling included),
seconds from the trainer's call to each island serving it, seconds the trainer was blocked.
Peak RSS per island (VmHWM after it loaded v0) and of the region's relay / middle node. Every
island's final view is checked bit for bit against the simulator's digest; a mismatch fails
the run.

**Columns.** ``WAN MB/ver``: mean bytes through the link per version; ``all islands p50 s``
/ ``max s``: over versions, the time from the trainer's call until the *last* island serves
it; ``blocked``: the trainer's call (rollpatch and XOR: the host snapshot of the masters;
shardcast: writing the checkpoint and ``broadcast``); ``published``: from the call until the
version is on the board with LATEST moved (shardcast: ``broadcast`` returned); ``CPU s/ver``:
median CPU seconds (user + system) all the method's processes used per version — the trainer,
relays or middle node, link and islands — the work a version
costs whatever else the machine runs; a second table splits it by process (trainer, relays or
middle node, link, islands). Ratios are
against shardcast (``sc/this``: how many times more bytes / time shardcast needs) and against
XOR+zstd-1 (``this/xor``), all measured in the same run.

**Where the time goes** (printed under the table, ``bench/_peers_trace.py``): for each traced
method, the median over versions of each consecutive phase of the last island to serve the
version — the publisher's snapshot, encode, upload and LATEST; then, from the island's reads
(wall clock), LATEST noticed, manifest and patch objects received, staged, committed — and the
island's CPU queueing (Linux schedstat: threads runnable but not running) from notice to
serving.

**Fairness notes.** shardcast's clients start once the middle node holds every shard (the
bench peeks at its directory): real clients poll the middle's distribution file, which it
writes *before* its shards arrive, and retry 404s after 2 s, so this is shardcast's best
case. shardcast writes a temp file next to its package that concurrent clients on one machine
would race on; each island here gets its own. Its origin and middle serve one request at a
time (``http.server.HTTPServer``), as shipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from _peers_args import parse
from _peers_procs import BenchError, Child, Relay, free_port, link_child
from _peers_report import render, render_cpu, render_load, targets
from _peers_steps import steps
from _peers_trace import render as render_phases
from _peers_versions import as_torch, load_masters, prepare
from _util import fmt_size, log, machine, machine_line

from rollpatch.board import Board
from rollpatch.formats import cast_view
from rollpatch.io.safetensors import save_view
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.store import open_store

RUN = "bench"


def run_method(
    method: str, args: argparse.Namespace, work: Path, meta: dict[str, Any]
) -> dict[str, Any]:
    root = work / method
    shutil.rmtree(root, ignore_errors=True)
    (root / "logs").mkdir(parents=True)
    logs = root / "logs"
    closers: list[Callable[[], Any]] = []
    islands: list[Child] = []
    cpu_pids: list[int] = []  # relays and middle node, for the CPU per version
    expected = meta["digests"]
    island_job = {
        "mode": method,
        "run": RUN,
        "v0": str(work / "v0.safetensors"),
        "poll_s": args.poll_s,
        "last": args.versions,
        "expected": expected,
        "commit": args.island_commit,
    }
    out: dict[str, Any] = {"method": method, "versions": []}
    try:
        if method in ("rollpatch", "xor"):
            board_uri = f"file://{root / 'board'}"
            masters = load_masters(work, 0)
            if method == "rollpatch":
                hand = as_torch if args.trainer_cast == "torch" else dict
                pub = Publisher(board_uri, RUN, PublisherConfig(format="bf16"))
                pub.publish(hand(masters))
                pub.flush()

                def publish(m: dict[str, np.ndarray], v: int) -> float:
                    handed = hand(m)  # made before the timed call
                    t0 = time.perf_counter()
                    pub.publish(handed, v)
                    return time.perf_counter() - t0

                def durable(v: int) -> dict[str, float]:
                    st = next(s for s in pub.stats.versions if s.version == v)
                    return {k: float(x) for k, x in asdict(st).items() if k.endswith("_s")}

                closers.append(pub.close)
            else:
                from _peers_xor import XorPublisher  # xxhash: checked by _peers_needs

                xpub = XorPublisher(Board(open_store(board_uri)), RUN)
                xpub.publish(masters, 0)
                board = Board(open_store(board_uri))
                while board.latest(RUN) is None:
                    time.sleep(0.05)
                publish = xpub.publish

                def durable(v: int) -> dict[str, float]:
                    return xpub.stats[v]

                closers.append(xpub.close)
            del masters
            origin = Relay(
                board_uri,
                root / "origin-cache",
                logs,
                "origin-relay",
                0.0,
                0.0,
                args.origin_watch_s,
                args.relay_log_level,
            )
            closers.append(origin.close)
            cpu_pids.append(origin.proc.pid)
            link, lport = link_child(args.rtt_ms, args.mbps, origin.port, logs)
            closers.append(link.close)
            region = Relay(
                f"http://127.0.0.1:{lport}",
                root / "region-cache",
                logs,
                "region-relay",
                args.poll_s,
                args.poll_s,
                log_level=args.relay_log_level,
                extra=("--push-bytes", str(args.push_bytes)),
            )
            region_close = region.close
            cpu_pids.append(region.proc.pid)
            for i in range(args.islands):
                islands.append(Child(f"island{i}", {**island_job, "board": region.url}, logs))
                islands[-1].expect("ready", 300)
        else:
            from shardcast import OriginServer, logger

            logger.setLevel("WARNING")

            for d in ("origin", "middle"):
                (root / d).mkdir()
                (root / d / "data1.bin").write_bytes(b"\0")  # the clients' first probe
            origin_sc = OriginServer(str(root / "origin"), free_port())
            closers.append(origin_sc.shutdown)
            link, lport = link_child(args.rtt_ms, args.mbps, origin_sc.port, logs)
            closers.append(link.close)
            mport = free_port()
            mid = Child(
                "middle",
                {
                    "mode": "middle",
                    "upstream": f"http://127.0.0.1:{lport}",
                    "dir": str(root / "middle"),
                    "port": mport,
                    "check_interval": args.poll_s,
                },
                logs,
            )
            mid.expect("ready", 60)
            cpu_pids.append(mid.proc.pid)

            def region_close() -> int:
                done = mid.close()
                return int(done["peak"]) if done else 0

            for i in range(args.islands):
                d = root / f"island{i}"
                d.mkdir()
                islands.append(
                    Child(
                        f"island{i}",
                        {
                            **island_job,
                            "server": f"http://127.0.0.1:{mport}",
                            "dir": str(d),
                            "middle_dir": str(root / "middle"),
                        },
                        logs,
                    )
                )
                islands[-1].expect("ready", 300)
            ckpt = root / "checkpoint.safetensors"

            def publish(m: dict[str, np.ndarray], v: int) -> float:
                t0 = time.perf_counter()
                save_view(cast_view(m, "bf16"), ckpt)
                name = origin_sc.broadcast(str(ckpt))
                if name != f"v{v}":
                    raise BenchError(f"shardcast named version {v} {name!r}")
                blocked = time.perf_counter() - t0
                ckpt.unlink()
                sc_blocked[v] = blocked
                return blocked

            sc_blocked: dict[int, float] = {}

            def durable(v: int) -> dict[str, float]:
                return {"total_s": sc_blocked[v], "snapshot_s": sc_blocked[v]}

        out["versions"] = steps(args, work, publish, durable, link, islands, cpu_pids)
        for isl in islands:
            done = isl.close()
            if done is None or not done["bit_exact"]:
                raise BenchError(f"{method} {isl.name}: final view not bit-exact ({done})")
            out.setdefault("island_peaks", []).append(int(done["peak"]))
        islands.clear()
        out["region_peak"] = region_close()
    finally:
        for isl in islands:
            isl.proc.kill()
        for close in reversed(closers):
            try:
                close()
            except Exception as e:  # noqa: BLE001 (cleanup must reach every process)
                log(f"{method}: cleanup: {e}")
    return out


def main() -> int:
    args, methods = parse(__doc__.split("\n\n")[0])
    if args.trainer_cast == "torch":
        import torch  # noqa: F401 (a trainer's process has it; imported before any timing)
    work = Path(args.work or f"/tmp/rollpatch-peers-{os.getuid()}")
    work.mkdir(parents=True, exist_ok=True)
    info = machine()
    load0 = " ".join(f"{x:.1f}" for x in os.getloadavg())
    meta = prepare(args, work)
    results = {}
    for m in methods:
        log(
            f"{m}: {args.islands} islands, {args.versions} versions, {args.mbps:g} Mbit/s, "
            f"{args.rtt_ms:g} ms RTT"
        )
        results[m] = run_method(m, args, work, meta)
    changed = statistics.mean(meta["changed"].values())
    print(
        f"{fmt_size(meta['n_params'])} params (BF16 view {meta['view_bytes'] / 1e6:.0f} MB), "
        f"lr {args.lr:g}: {100 * changed:.2f}% of values change per step; "
        f"{args.versions} versions to {args.islands} islands over one link "
        f"({args.mbps:g} Mbit/s shared, {args.rtt_ms:g} ms RTT)"
    )
    print(render(results, meta))
    for line in targets(results):
        print(line)
    print(render_cpu(results))
    for m, r in results.items():
        traced = [x for x in r["versions"] if x.get("phases")]
        if traced:
            print(
                render_phases(
                    [x["phases"] for x in traced],
                    f"{m}: where the time goes",
                    [x["version"] for x in traced],
                )
            )
    print(render_load(results))
    print(
        f"islands commit {args.island_commit}; trainer hands {args.trainer_cast} masters "
        f"(rollpatch's snapshot: the native cast + compare either way); origin relay "
        f"reads LATEST every {args.origin_watch_s:g} s (and when inotify says it moved); region "
        f"relay accepts {args.push_bytes / 2**20:g} MiB pushed; load average at the start: "
        f"{load0}"
    )
    print(machine_line(info))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"machine": info, "args": vars(args), "meta": meta, "results": results}, indent=1
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
