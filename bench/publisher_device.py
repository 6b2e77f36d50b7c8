"""Publisher benchmark: the device path (``diff_on="device"``) against the host path.

Run: ``python bench/publisher_device.py`` (100M parameters, 4 versions, about 3 minutes on
the 2-core development machine), or e.g. ``--params 20M --versions 3 --threads 1``.

**Data.** One :mod:`rollpatch.sim` simulator (AdamW, warm Adam state, ``--lr`` 1e-6: about
1.2% of BF16 values change per step) makes ``--versions`` consecutive FP32 master versions.
Each version is published twice, synchronously, to two in-memory boards, format ``bf16``, v0
a keyframe, the rest step patches (``skip_strides=()``): by the host path (numpy masters:
snapshot to host memory, numpy cast, native diff and encode) and by the device path (torch
CPU tensors: snapshot on the device, torch cast, compare, records and digests, native coding
of the records). Both boards must hold the same objects and manifest targets (checked).

**Columns.** Per path and version: the pipeline's own timings (``VersionStats``: snapshot,
cast, diff, encode, upload), the CPU time of the process over the publish (user + system,
both threads), and the bytes that cross from the masters' device to the host: the whole FP32
snapshot on the host path, the change records on the device path (``host_bytes``). On a CPU
the "device" is host memory, so this measures the cost of running the device code on a CPU,
where torch's kernels are slower than the native core; on a GPU the O(N) part runs on the
device and only the records cross.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from typing import Any

import _util
import torch

from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.sim import AdamSim, SimConfig


def _publish(pub: Publisher, sd: dict[str, Any]) -> tuple[float, float]:
    c0, t0 = time.process_time(), time.perf_counter()
    pub.publish(sd)
    return time.process_time() - c0, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="100M", help="simulated parameters (default 100M)")
    ap.add_argument("--versions", type=int, default=4, help="versions published (v0 keyframe)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument(
        "--threads", type=int, default=None, help="torch and native threads (default: all cores)"
    )
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        os.environ["ROLLPATCH_THREADS"] = str(args.threads)
    n = _util.parse_size(args.params)
    sim = AdamSim(SimConfig(n_params=n, lr=args.lr))
    tag = uuid.uuid4().hex[:8]
    common: dict[str, Any] = {
        "format": "bf16",
        "keyframe_every": 1_000_000,
        "skip_strides": (),
        "publisher_id": "bench",
    }
    host = Publisher(
        f"memory://bench-host-{tag}", "run", PublisherConfig(**common), asynchronous=False
    )
    dev = Publisher(
        f"memory://bench-dev-{tag}",
        "run",
        PublisherConfig(diff_on="device", **common),
        asynchronous=False,
    )
    print(f"# {_util.machine_line(_util.machine())}", file=sys.stderr)
    print(
        f"# {_util.fmt_size(sim.n_params)} params, lr {args.lr}, torch "
        f"{torch.__version__}, {torch.get_num_threads()} torch threads",
        file=sys.stderr,
    )
    rows = []
    for v in range(args.versions):
        if v:
            sim.step()
        masters = sim.masters()
        snap_bytes = sum(int(a.nbytes) for a in masters.values())
        for label, pub, sd in (
            ("host", host, masters),
            ("device", dev, {k: torch.from_numpy(a) for k, a in masters.items()}),
        ):
            cpu, wall = _publish(pub, sd)
            s = pub.stats.versions[-1]
            crossed = snap_bytes if label == "host" else s.host_bytes
            rows.append(
                [
                    label,
                    str(v),
                    "kf" if s.keyframe else "patch",
                    f"{wall:.2f}",
                    f"{cpu:.2f}",
                    f"{s.snapshot_s:.2f}",
                    f"{s.cast_s:.2f}",
                    f"{s.diff_s:.2f}",
                    f"{s.encode_s:.2f}",
                    f"{s.changed / n:.2%}",
                    f"{s.patch_bytes:,}",
                    f"{crossed:,}",
                ]
            )
        hm, dm = host.board.manifest("run", v), dev.board.manifest("run", v)
        if hm.target != dm.target or [p.ref for p in hm.patches] != [p.ref for p in dm.patches]:
            raise SystemExit(f"version {v}: the device path published other bytes")
    host.close()
    dev.close()
    print(
        _util.table(
            [
                "path",
                "v",
                "kind",
                "wall s",
                "cpu s",
                "snap s",
                "cast s",
                "diff s",
                "encode s",
                "changed",
                "patch B",
                "to host B",
            ],
            rows,
        )
    )
    for label in ("host", "device"):
        pat = [r for r in rows if r[0] == label and r[2] == "patch"]
        if pat:
            mean = sum(float(r[3]) for r in pat) / len(pat)
            cpu = sum(float(r[4]) for r in pat) / len(pat)
            print(f"{label}: patch versions mean wall {mean:.2f} s, cpu {cpu:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
