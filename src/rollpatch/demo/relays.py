"""The regional relays: ``python -m rollpatch.demo.relays --board URI --regions eu,us ...``.

One process serves one relay per remote region, each in its own server thread. A relay's
upstream is the board behind a :class:`~rollpatch.store.ThrottledStore`: an *emulated* WAN
link (added round-trip latency per upstream request, a shared bandwidth cap). Islands in the
region read through the relay over loopback at full speed; only board → relay is throttled.
Link counters are reported as events every half second while they change.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from .events import emit, watch_parent

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    from ..relay import RelayConfig, RelayServer
    from ..store import ThrottledStore, open_store
    from ..trust import Trust

    p = argparse.ArgumentParser(prog="python -m rollpatch.demo.relays")
    p.add_argument("--board", required=True, help="upstream board URI")
    p.add_argument("--regions", required=True, help="comma-separated region names")
    p.add_argument("--cache-root", required=True)
    p.add_argument("--mbps", type=float, required=True, help="emulated WAN bandwidth, Mbit/s")
    p.add_argument("--latency-ms", type=float, required=True,
                   help="emulated WAN round trip per upstream request, ms")
    p.add_argument("--ttl", type=float, default=0.2, help="LATEST / listing TTL, seconds")
    p.add_argument("--trust", help="trust root file: verify before caching")
    args = p.parse_args(argv)

    stop = threading.Event()
    watch_parent(lambda cmd: stop.set() if cmd.get("cmd") == "stop" else None, stop.set)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    links: dict[str, ThrottledStore] = {}
    servers: list[RelayServer] = []
    try:
        for region in [r for r in args.regions.split(",") if r]:
            link = ThrottledStore(open_store(args.board), args.mbps * 1e6,
                                  args.latency_ms / 1000)
            config = RelayConfig(cache_dir=Path(args.cache_root) / region,
                                 pointer_ttl=args.ttl, list_ttl=args.ttl)
            trust = None if args.trust is None else Trust.from_file(
                args.trust, state_path=config.cache_dir / "trust-state.json")
            server = RelayServer(link, config, trust=trust)
            servers.append(server)
            links[region] = link
            emit("listening", relay=region, url=server.start())
        last: dict[str, dict[str, float]] = {}
        while not stop.wait(0.5):
            for region, link in links.items():
                now = asdict(link.stats)
                if now != last.get(region):
                    emit("link", relay=region, **now)
                    last[region] = now
    finally:
        for server in servers:
            server.stop()
        for region, link in links.items():
            emit("link", relay=region, final=True, **asdict(link.stats))
            link.inner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
