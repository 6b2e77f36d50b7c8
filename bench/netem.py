"""Link emulator benchmark: does the emulated link deliver what it is configured to?

Run: ``python bench/netem.py`` (about a minute), or e.g. ``--mbps 100,1000 --latency-ms 25
--mb 50 --json out.json``.

Per scenario, over real loopback TCP through :class:`rollpatch.netem.Link` (in this process,
on its own event-loop thread): a source server sends ``--mb`` MB per connection downstream
(the direction followers pull in), the clients read it to the end.

- ``rtt``: 20 one-byte ping-pongs on an open connection; p50 and min against the configured
  ``2 * latency``.
- ``1 conn`` / ``3 conns``: throughput of one download, and of three concurrent downloads
  sharing the cap (sum over the three), from connect to the last byte (so one handshake and
  one latency are included, as a real transfer pays them), against the cap.
- ``loss``: one download with ``--loss`` per segment (each loss costs a round trip; no
  congestion back-off is modelled, so this is an optimistic TCP).

The ``x cap`` column is achieved / configured; ``ideal s`` is bytes / cap + handshake + one-way
latency. Timing is wall clock; on a loaded machine everything is slower, never faster.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from typing import Any

from _util import log, machine, machine_line, table

from rollpatch.netem import Link, LinkConfig

_BLOCK = bytes(range(256)) * 1024  # 256 KiB


class _Source:
    """Per connection: reads a decimal byte count and a newline, sends that many bytes."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _serve(conn: socket.socket) -> None:
        with conn:
            f = conn.makefile("rb")
            while line := f.readline():
                n = int(line)
                if n == 0:  # ping
                    conn.sendall(b".")
                    continue
                while n > 0:
                    chunk = _BLOCK[:n]
                    conn.sendall(chunk)
                    n -= len(chunk)

    def close(self) -> None:
        self.sock.close()


def _download(port: int, n: int) -> float:
    """Seconds from connect to the last of ``n`` bytes."""
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"%d\n" % n)
        left = n
        while left > 0:
            data = s.recv(1 << 20)
            if not data:
                raise ConnectionError(f"closed with {left} bytes to go")
            left -= len(data)
    return time.perf_counter() - t0


def _rtts(port: int, count: int = 20) -> list[float]:
    out = []
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"0\n")
        s.recv(1)  # the handshake round trip is not part of the RTT
        for _ in range(count):
            t0 = time.perf_counter()
            s.sendall(b"0\n")
            s.recv(1)
            out.append(time.perf_counter() - t0)
    return out


def _concurrent(port: int, n: int, conns: int) -> float:
    times: list[float] = []
    threads = [
        threading.Thread(target=lambda: times.append(_download(port, n))) for _ in range(conns)
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(times) != conns:
        raise RuntimeError("a download failed")
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    src = _Source()
    rows: list[dict[str, Any]] = []
    n = int(args.mb * 1e6)
    try:
        for mbps in args.mbps:
            base = {"mbps": mbps, "latency_ms": args.latency_ms}
            cfg = LinkConfig(upstream=src.address, latency_ms=args.latency_ms, mbps=mbps)
            ideal = n * 8 / (mbps * 1e6) + 3 * args.latency_ms / 1e3
            with Link(cfg) as link:
                log(f"{mbps:g} Mbit/s, {args.latency_ms:g} ms: rtt")
                rtt = _rtts(link.port)
                rows.append(
                    {
                        **base,
                        "scenario": "rtt",
                        "conns": 1,
                        "bytes": 0,
                        "rtt_p50_ms": 1e3 * statistics.median(rtt),
                        "rtt_min_ms": 1e3 * min(rtt),
                    }
                )
                for conns in (1, 3):
                    log(f"{mbps:g} Mbit/s: {conns} x {args.mb:g} MB")
                    s = _concurrent(link.port, n, conns)
                    rows.append(
                        {
                            **base,
                            "scenario": f"{conns} conn" + "s" * (conns > 1),
                            "conns": conns,
                            "bytes": conns * n,
                            "seconds": s,
                            "ideal_s": ideal + (conns - 1) * n * 8 / (mbps * 1e6),
                            "achieved_mbps": conns * n * 8 / s / 1e6,
                        }
                    )
            if args.loss > 0:
                cfg = LinkConfig(
                    upstream=src.address,
                    latency_ms=args.latency_ms,
                    mbps=mbps,
                    loss=args.loss,
                    seed=0,
                )
                with Link(cfg) as link:
                    log(f"{mbps:g} Mbit/s: loss {args.loss:g}")
                    s = _download(link.port, n)
                    lost = link.stats().lost_segments
                rows.append(
                    {
                        **base,
                        "scenario": f"loss {args.loss:g}",
                        "conns": 1,
                        "bytes": n,
                        "seconds": s,
                        "ideal_s": ideal,
                        "achieved_mbps": n * 8 / s / 1e6,
                        "lost_segments": lost,
                    }
                )
    finally:
        src.close()
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    out = []
    for r in rows:
        if r["scenario"] == "rtt":
            cells = [
                f"{r['mbps']:g}",
                f"{r['latency_ms']:g}",
                "rtt",
                "1",
                "-",
                f"p50 {r['rtt_p50_ms']:.1f} ms",
                f"{2 * r['latency_ms']:.1f} ms",
                f"min {r['rtt_min_ms']:.1f} ms",
                "-",
            ]
        else:
            cells = [
                f"{r['mbps']:g}",
                f"{r['latency_ms']:g}",
                r["scenario"],
                str(r["conns"]),
                f"{r['bytes'] / 1e6:.0f}",
                f"{r['seconds']:.2f}",
                f"{r['ideal_s']:.2f}",
                f"{r['achieved_mbps']:.0f}",
                f"{r['achieved_mbps'] / r['mbps']:.2f}",
            ]
        out.append(cells)
    return table(
        [
            "cap Mbit/s",
            "latency ms",
            "scenario",
            "conns",
            "MB",
            "seconds",
            "ideal s",
            "Mbit/s",
            "x cap",
        ],
        out,
        right=[True, True, False] + [True] * 6,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--mbps",
        default="100,1000",
        type=lambda s: [float(x) for x in s.split(",")],
        help="caps to measure, Mbit/s (comma-separated)",
    )
    p.add_argument("--latency-ms", type=float, default=25.0, help="one-way latency")
    p.add_argument("--mb", type=float, default=40.0, help="MB per download")
    p.add_argument("--loss", type=float, default=1e-4, help="segment loss of the loss row")
    p.add_argument("--json", help="also write the rows and the machine here")
    args = p.parse_args()
    info = machine()
    rows = run(args)
    print(render(rows))
    print(machine_line(info))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
