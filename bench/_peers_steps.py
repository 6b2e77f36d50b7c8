"""The per-version loop of ``bench/peers.py``: publish one version, wait until every island
serves it, then record its timings, phases (``_peers_trace``), WAN bytes and CPU seconds."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _peers_procs import BenchError, Child, cpu_parts, cpu_seconds
from _peers_trace import phases, run_delay
from _peers_versions import load_masters
from _util import log

from rollpatch.publisher.core import SETTLE_AFTER_S

#: Seconds after SETTLE_AFTER_S within which rollpatch's deferred settle finishes (~50-160
#: CPU-ms at 100M parameters, docs/publisher.md) before a version's CPU is read.
CPU_TAIL_S = 0.5


def steps(
    args: argparse.Namespace,
    work: Path,
    publish: Callable[..., float],
    durable: Callable[[int], dict[str, float]],
    link: Child,
    islands: list[Child],
    others: list[int],
) -> list[dict[str, Any]]:
    conns = [0]
    pids = [isl.proc.pid for isl in islands] + [link.proc.pid, *others]
    groups = {  # where a version's CPU goes (relays or middle node: ``others``)
        "trainer": [os.getpid()],
        "relays": list(others),
        "link": [link.proc.pid],
        "islands": [isl.proc.pid for isl in islands],
    }

    def wan() -> int:
        link.send("stats")
        s = link.expect("stats", 30)
        conns[0] = int(s["connections"])
        return int(s["bytes_up"]) + int(s["bytes_down"])

    rows: list[dict[str, Any]] = []
    before = wan()
    conns_before = conns[0]
    for v in range(1, args.versions + 1):
        masters = load_masters(work, v)
        delay0, cpu0, parts0 = run_delay(), cpu_seconds(pids), cpu_parts(groups)
        t0 = time.time()
        blocked = publish(masters, v)
        del masters
        deadline = time.monotonic() + args.timeout_s
        while not all(v in isl.serving for isl in islands):
            if time.monotonic() > deadline:
                raise BenchError(f"v{v}: not every island served it within {args.timeout_s}s")
            for isl in islands:
                if isl.proc.poll() is not None:
                    raise BenchError(f"{isl.name} exited with status {isl.proc.returncode}")
            time.sleep(0.01)
        lat = [isl.serving[v] - t0 for isl in islands]
        trainer_delay = run_delay() - delay0  # the trainer's threads (publisher included)
        time.sleep(args.settle_s)  # trailing polls of this version count towards it
        pub = durable(v)
        # work a method defers past its islands' serving moment belongs to this version too:
        # rollpatch's publisher composes the step into its skip accumulators (and rebuilds a
        # skip patch's base) SETTLE_AFTER_S after LATEST moved, which the next version's
        # window (opened after load_masters) never sees. Wait for it, every method alike.
        settled = t0 + pub["total_s"] + SETTLE_AFTER_S + CPU_TAIL_S
        time.sleep(max(0.0, settled - time.time()))
        cpu = cpu_seconds(pids) - cpu0
        parts = {k: x - parts0[k] for k, x in cpu_parts(groups).items()}
        now = wan()
        last = max(islands, key=lambda isl: isl.serving[v])
        rows.append(
            {
                "version": v,
                "blocked_s": blocked,
                "published_s": pub["total_s"],
                "publisher": pub,
                "phases": (
                    phases(pub, t0, last.served[v], trainer_delay)
                    if "trace" in last.served[v]
                    else None
                ),
                "trace": last.served[v].get("trace"),
                "t_call": t0,
                "island_s": lat,
                "all_s": max(lat),
                "wan_bytes": now - before,
                "wan_connections": conns[0] - conns_before,
                "cpu_s": cpu,
                "cpu_parts": parts,
                "load1": os.getloadavg()[0],  # the machine is shared: read times beside it
            }
        )
        before, conns_before = now, conns[0]
        log(
            f"  v{v}: blocked {blocked:.2f}s, all islands {max(lat):.2f}s, "
            f"WAN {rows[-1]['wan_bytes'] / 1e6:.2f} MB"
        )
    return rows
