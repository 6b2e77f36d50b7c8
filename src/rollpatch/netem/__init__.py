"""A WAN made of real sockets: a userspace TCP link emulator (docs/netem.md)::

    from rollpatch.netem import Link

    with Link(upstream=("127.0.0.1", 8000), latency_ms=25, mbps=1000) as link:
        fetch(f"http://127.0.0.1:{link.port}/...")   # 50 ms more per round trip, 1 Gbit/s shared

The kernel's ``netem`` queueing discipline is not available everywhere (and needs root); this
proxy gives the same three effects to any TCP client on loopback: one-way latency, a bandwidth
cap shared by every connection through the link (a token bucket per direction), and loss
emulated as retransmission delay. ``python -m rollpatch.netem`` runs one from the shell.
"""

from .bucket import TokenBucket
from .cli import main, register
from .config import MSS, LinkConfig, LinkStats, parse_hostport
from .link import Link
from .proxy import AsyncLink

__all__ = [
    "MSS",
    "AsyncLink",
    "Link",
    "LinkConfig",
    "LinkStats",
    "TokenBucket",
    "main",
    "parse_hostport",
    "register",
]
