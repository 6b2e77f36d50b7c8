"""The relay client's keep-alive connections over an emulated WAN: what a follower's sync costs.

Run: ``python bench/relay_client.py`` (``--rtt-ms 50 --mbps 1000 --rounds 20``).

A relay (real process-local server on loopback) serves a board-like set of keys: LATEST, a
listing, a manifest of a few KiB and a 1 MiB patch. The client reaches it through
``rollpatch.netem`` (real TCP; a round trip costs ``--rtt-ms``; a new connection pays one
round trip for its handshake). One *sync* is the sequence a follower's catch-up makes: GET
LATEST, list the versions, GET the manifest, GET the patch. Measured per sync, alternating in
the same run: ``new connection`` (a connection per request, as the client did with urllib)
and ``keep-alive`` (``rollpatch.store.http_pool``: idle connections reused). The floor is
what the link alone costs for that sequence: 4 round trips plus the bytes at ``--mbps``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import blake3

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _util import log, machine, machine_line, table

from rollpatch.netem import Link
from rollpatch.relay import RelayConfig, RelayServer
from rollpatch.store import MemoryStore, open_store
from rollpatch.store.http_client import HttpStore

PATCH = b"p" * (1 << 20)
#: Sizes as a sync reads them. The pointer and the manifest-sized document sit outside the
#: board layout (the relay relays them as volatile keys, unchecked: the client's costs are
#: the same); the patch is a content-addressed object the relay verifies and caches.
KEYS = {
    "bench/latest.json": b'{"version": 7}',
    "bench/manifest.json": b"m" * 4096,
    f"runs/r/objects/{blake3.blake3(PATCH).hexdigest()}.rpatch": PATCH,
}
STEPS = ("LATEST", "list", "manifest", "patch")


def one_sync(c: HttpStore, fresh: bool) -> float:
    t = time.perf_counter()
    keys = list(KEYS)
    for step in STEPS:
        if fresh:
            c.close()  # no idle connection: the next request opens one
        if step == "list":
            c.list("runs/r/objects/")
        else:
            c.get(keys[{"LATEST": 0, "manifest": 1, "patch": 2}[step]])
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rtt-ms", type=float, default=50.0)
    ap.add_argument("--mbps", type=float, default=1000.0)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()

    origin = MemoryStore("origin")
    for k, v in KEYS.items():
        origin.put(k, v)
    with tempfile.TemporaryDirectory() as tmp:
        # pointer_ttl 0: every volatile read goes upstream (the origin is in memory here)
        server = RelayServer(origin, RelayConfig(cache_dir=Path(tmp), pointer_ttl=0.0))
        server.start()
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        try:
            with Link(
                upstream=(host, int(port)), latency_ms=args.rtt_ms / 2, mbps=args.mbps
            ) as link:
                c = open_store(link.url, retries=0)
                assert isinstance(c, HttpStore)
                one_sync(c, fresh=False)  # the relay's cache warm for both
                times: dict[bool, list[float]] = {True: [], False: []}
                for _ in range(args.rounds):
                    for fresh in (True, False):
                        times[fresh].append(one_sync(c, fresh))
                opened = c._pool.opened
        finally:
            server.stop()
    nbytes = sum(len(v) for v in KEYS.values())
    floor = 4 * args.rtt_ms / 1e3 + nbytes * 8 / (args.mbps * 1e6)
    rows = []
    base = statistics.median(times[True])
    for fresh, name in ((True, "new connection"), (False, "keep-alive")):
        med = statistics.median(times[fresh])
        rows.append(
            [
                name,
                f"{med * 1e3:.0f}",
                f"{min(times[fresh]) * 1e3:.0f}",
                f"{max(times[fresh]) * 1e3:.0f}",
                f"{med / floor:.2f}",
                f"{med / base:.2f}",
            ]
        )
    log(
        f"one sync (LATEST, list, manifest 4 KiB, patch 1 MiB) through {args.rtt_ms:g} ms RTT, "
        f"{args.mbps:g} Mbit/s; {args.rounds} rounds each, alternating; link floor "
        f"{floor * 1e3:.0f} ms"
    )
    print(
        table(
            ["client", "median ms", "min ms", "max ms", "/floor", "/new connection"],
            rows,
            [False, True, True, True, True, True],
        )
    )
    print(f"\nconnections opened: {opened}; machine: {machine_line(machine())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
