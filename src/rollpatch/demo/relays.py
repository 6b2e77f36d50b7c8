"""The regional relays: ``python -m rollpatch.demo.relays --board URI --regions eu,us ...``.

One process serves the board over HTTP in the trainer's "region" (an origin relay, no
cache TTLs) and one relay per remote region, each in its own server thread. A remote relay
reaches the origin over real TCP through its own :class:`~rollpatch.netem.Link`: an *emulated*
WAN link on loopback (one-way latency of half the round trip, each connection's handshake, a
bandwidth cap shared by the region's connections). Islands in the region read through their
relay over loopback at full speed; only origin → relay crosses the emulated WAN. Link
counters are reported as events every half second while they change.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .events import emit, watch_parent

if TYPE_CHECKING:
    from ..netem import Link

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    from ..netem import Link, LinkConfig
    from ..relay import RelayConfig, RelayServer
    from ..trust import Trust

    p = argparse.ArgumentParser(prog="python -m rollpatch.demo.relays")
    p.add_argument("--board", required=True, help="upstream board URI")
    p.add_argument("--regions", required=True, help="comma-separated region names")
    p.add_argument("--cache-root", required=True)
    p.add_argument("--mbps", type=float, required=True, help="emulated WAN bandwidth, Mbit/s")
    p.add_argument(
        "--latency-ms",
        type=float,
        required=True,
        help="emulated WAN round trip (half of it each way), ms",
    )
    p.add_argument("--ttl", type=float, default=0.2, help="LATEST / listing TTL, seconds")
    p.add_argument("--trust", help="trust root file: verify before caching")
    args = p.parse_args(argv)

    stop = threading.Event()
    watch_parent(lambda cmd: stop.set() if cmd.get("cmd") == "stop" else None, stop.set)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    links: dict[str, Link] = {}
    servers: list[RelayServer] = []
    try:
        # the trainer's side: the board over HTTP, always fresh (no TTL on LATEST or lists)
        origin = RelayServer(
            args.board,
            RelayConfig(cache_dir=Path(args.cache_root) / "origin", pointer_ttl=0.0, list_ttl=0.0),
        )
        servers.append(origin)
        origin_port = int(origin.start().rstrip("/").rsplit(":", 1)[1])
        for region in [r for r in args.regions.split(",") if r]:
            link = Link(
                LinkConfig(
                    upstream=("127.0.0.1", origin_port),
                    latency_ms=args.latency_ms / 2,
                    mbps=args.mbps,
                )
            ).start()
            links[region] = link
            config = RelayConfig(
                cache_dir=Path(args.cache_root) / region, pointer_ttl=args.ttl, list_ttl=args.ttl
            )
            trust = (
                None
                if args.trust is None
                else Trust.from_file(args.trust, state_path=config.cache_dir / "trust-state.json")
            )
            server = RelayServer(link.url, config, trust=trust)
            servers.append(server)
            emit("listening", relay=region, url=server.start())
        last: dict[str, dict[str, int]] = {}
        while not stop.wait(0.5):
            for region, link in links.items():
                now = _counters(link)
                if now != last.get(region):
                    emit("link", relay=region, **now)
                    last[region] = now
    finally:
        for server in reversed(servers):
            server.stop()
        for region, link in links.items():
            emit("link", relay=region, final=True, **_counters(link))
            link.close()
    return 0


def _counters(link: Link) -> dict[str, int]:
    s = link.stats()
    return {
        "connections": s.connections,
        "bytes_down": s.bytes_down,
        "bytes_up": s.bytes_up,
        "lost_segments": s.lost_segments,
    }


if __name__ == "__main__":
    sys.exit(main())
