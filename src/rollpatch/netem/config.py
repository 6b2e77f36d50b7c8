"""Link emulator configuration and statistics: plain data, validated, no I/O."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..config import check_fields, setting
from ..errors import ConfigError
from ..validate import check_int

__all__ = ["MSS", "LinkConfig", "LinkStats", "parse_hostport", "show_hostport"]

#: Bytes of payload per emulated TCP segment (Ethernet MTU 1500 minus IP and TCP headers with
#: timestamps); ``loss`` is a probability per segment of this size.
MSS = 1448
#: Upper bound on every size option, so a typo cannot ask for gigabytes of buffers.
_MAX_BYTES = 1 << 30


def show_hostport(address: tuple[str, int]) -> str:
    """``(host, port)`` → ``"host:port"`` (``[v6]:port`` for an IPv6 host)."""
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _kib(text: str) -> int:
    try:
        return int(text) * 1024
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of KiB: {text!r}") from None


def parse_hostport(text: str, *, option: str = "address") -> tuple[str, int]:
    """``"host:port"`` (``[v6]:port`` too) → ``(host, port)``; :class:`ConfigError` names
    ``option`` when it is malformed."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{option} must be HOST:PORT", value=text, hint="e.g. 127.0.0.1:8000")
    return host, int(port)


@dataclass(frozen=True, kw_only=True)
class LinkConfig:
    """One emulated network link: where it listens, where it forwards, how it behaves.

    Both directions are shaped alike and independently (a full-duplex link): bytes wait for
    the shared token bucket of their direction, then ``latency_ms``, then are delivered in
    order. A round trip through the link therefore costs ``2 * latency_ms`` plus the real one.
    """

    upstream: tuple[str, int] = setting(
        help="HOST:PORT to forward connections to",
        metavar="HOST:PORT",
    )
    """Where accepted connections are forwarded: ``(host, port)``."""
    listen: tuple[str, int] = setting(
        ("127.0.0.1", 0),
        help="HOST:PORT to listen on (port 0: any free port)",
        metavar="HOST:PORT",
        show=show_hostport,
    )
    """Where the link listens; port 0 picks a free port (read it from ``Link.port``)."""
    latency_ms: float = setting(
        0.0,
        lo=0.0,
        hi=600_000.0,
        help="one-way delay per direction, ms (a round trip adds twice this)",
    )
    """One-way delay added to every byte, each direction."""
    mbps: float | None = setting(
        None,
        lo=1e-3,
        hi=1e7,
        help="bandwidth cap per direction, Mbit/s, shared by all connections (none: unlimited)",
    )
    """Bandwidth cap per direction in Mbit/s (10^6 bits), shared by every connection through
    this link; None: unlimited."""
    loss: float = setting(
        0.0, lo=0.0, hi=0.5, help="probability a 1448-byte segment is lost (costs a round trip)"
    )
    """Probability that an MSS-sized segment is lost. TCP never loses bytes, so a loss shows up
    as a retransmission: the chunk holding the segment (and everything behind it, in order)
    arrives one round trip (``2 * latency_ms``, at least ``min_rto_ms``) later, and the
    retransmitted segment takes link time again. Congestion-window back-off is not modelled."""
    min_rto_ms: float = setting(1.0, lo=0.0, hi=600_000.0, help="least retransmission delay, ms")
    """Lower bound of the retransmission delay (matters when ``latency_ms`` is ~0)."""
    handshake: bool = setting(
        True, help="charge new connections a round trip before their first byte"
    )
    """New connections pay one round trip (TCP's three-way handshake) before their first
    byte leaves."""
    burst_bytes: int = setting(64 * 1024, lo=0, hi=_MAX_BYTES, help="token bucket depth, bytes")
    """Token bucket depth: bytes an idle link may send at once, before pacing starts."""
    chunk_bytes: int = setting(64 * 1024, lo=MSS, hi=_MAX_BYTES, help="largest socket read, bytes")
    """Largest read from a socket; the unit the link schedules (and loses) at once."""
    window_bytes: int | None = setting(
        None,
        lo=MSS,
        hi=_MAX_BYTES,
        flag="--window-kb",
        metavar="KB",
        parse=_kib,
        show=lambda n: f"{n // 1024}",
        help="per-connection, per-direction bytes in flight, KiB (none: twice the "
        "bandwidth-delay product)",
    )
    """Bytes per connection and direction that may be in the link (queued or in flight) before
    reading from the sender stops (backpressure). None: twice the bandwidth-delay product,
    between 256 KiB and 32 MiB. Smaller than the bandwidth-delay product caps throughput, as a
    small TCP window does."""
    max_connections: int = setting(
        256, lo=1, hi=65536, help="connections open at once; more are closed at once"
    )
    """Connections open at once; more are accepted and closed at once (counted as refused)."""
    connect_timeout_s: float = setting(
        10.0, lo=0.001, hi=3600.0, help="seconds to open the upstream connection"
    )
    """How long opening the upstream connection may take before the client is dropped."""
    seed: int | None = setting(None, lo=0, hi=2**63, help="seed of the loss draws")
    """Seed of the loss draws (None: nondeterministic)."""

    def __post_init__(self) -> None:  # (host, port) pairs first, then the declared bounds
        up = self.upstream
        if (
            not isinstance(up, tuple)
            or len(up) != 2
            or not isinstance(up[0], str)
            or not up[0]
            or not _is_int(up[1])
            or not 0 < up[1] <= 65535
        ):
            raise ConfigError(
                "LinkConfig.upstream must be (host, port) with port 1-65535", value=up
            )
        ls = self.listen
        if (
            not isinstance(ls, tuple)
            or len(ls) != 2
            or not isinstance(ls[0], str)
            or not _is_int(ls[1])
            or not 0 <= ls[1] <= 65535
        ):
            raise ConfigError("LinkConfig.listen must be (host, port) with port 0-65535", value=ls)
        check_fields(self)
        if self.window_bytes is not None:
            check_int("LinkConfig", "window_bytes", self.window_bytes, self.chunk_bytes, _MAX_BYTES)

    @property
    def rate_bytes_per_s(self) -> float | None:
        """The cap in bytes per second (None: unlimited)."""
        return None if self.mbps is None else self.mbps * 1e6 / 8

    @property
    def rtt_s(self) -> float:
        """The round trip the link adds, in seconds."""
        return 2 * self.latency_ms / 1e3

    @property
    def window(self) -> int:
        """``window_bytes``, or the default derived from the bandwidth-delay product."""
        if self.window_bytes is not None:
            return self.window_bytes
        rate = self.rate_bytes_per_s
        if rate is None:
            return 4 << 20
        bdp = rate * max(self.rtt_s, 1e-3)
        return int(min(max(2 * bdp, 256 << 10), 32 << 20))


@dataclass(frozen=True)
class LinkStats:
    """A snapshot of what went through a link."""

    connections: int
    """Connections accepted and forwarded since the link started."""
    open: int
    """Connections open now."""
    refused: int
    """Connections closed at once: over ``max_connections``, or the upstream unreachable."""
    bytes_up: int
    """Bytes delivered client → upstream."""
    bytes_down: int
    """Bytes delivered upstream → client."""
    lost_segments: int
    """Segments the loss model dropped (and retransmitted)."""


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
