"""Link emulator configuration and statistics: plain data, validated, no I/O."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..validate import check_int, check_number

__all__ = ["MSS", "LinkConfig", "LinkStats", "parse_hostport"]

#: Bytes of payload per emulated TCP segment (Ethernet MTU 1500 minus IP and TCP headers with
#: timestamps); ``loss`` is a probability per segment of this size.
MSS = 1448
#: Upper bound on every size option, so a typo cannot ask for gigabytes of buffers.
_MAX_BYTES = 1 << 30


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

    upstream: tuple[str, int]
    """Where accepted connections are forwarded: ``(host, port)``."""
    listen: tuple[str, int] = ("127.0.0.1", 0)
    """Where the link listens; port 0 picks a free port (read it from ``Link.port``)."""
    latency_ms: float = 0.0
    """One-way delay added to every byte, each direction."""
    mbps: float | None = None
    """Bandwidth cap per direction in Mbit/s (10^6 bits), shared by every connection through
    this link; None: unlimited."""
    loss: float = 0.0
    """Probability that an MSS-sized segment is lost. TCP never loses bytes, so a loss shows up
    as a retransmission: the chunk holding the segment (and everything behind it, in order)
    arrives one round trip (``2 * latency_ms``, at least ``min_rto_ms``) later, and the
    retransmitted segment takes link time again. Congestion-window back-off is not modelled."""
    min_rto_ms: float = 1.0
    """Lower bound of the retransmission delay (matters when ``latency_ms`` is ~0)."""
    handshake: bool = True
    """New connections pay one round trip (TCP's three-way handshake) before their first
    byte leaves."""
    burst_bytes: int = 64 * 1024
    """Token bucket depth: bytes an idle link may send at once, before pacing starts."""
    chunk_bytes: int = 64 * 1024
    """Largest read from a socket; the unit the link schedules (and loses) at once."""
    window_bytes: int | None = None
    """Bytes per connection and direction that may be in the link (queued or in flight) before
    reading from the sender stops (backpressure). None: twice the bandwidth-delay product,
    between 256 KiB and 32 MiB. Smaller than the bandwidth-delay product caps throughput, as a
    small TCP window does."""
    max_connections: int = 256
    """Connections open at once; more are accepted and closed at once (counted as refused)."""
    connect_timeout_s: float = 10.0
    """How long opening the upstream connection may take before the client is dropped."""
    seed: int | None = None
    """Seed of the loss draws (None: nondeterministic)."""

    def __post_init__(self) -> None:
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
        _check_float("latency_ms", self.latency_ms, lo=0.0, hi=600_000.0)
        if self.mbps is not None:
            _check_float("mbps", self.mbps, lo=1e-3, hi=1e7)
        _check_float("loss", self.loss, lo=0.0, hi=0.5)
        _check_float("min_rto_ms", self.min_rto_ms, lo=0.0, hi=600_000.0)
        if not isinstance(self.handshake, bool):
            raise ConfigError("LinkConfig.handshake must be a bool", value=self.handshake)
        _check_int("burst_bytes", self.burst_bytes, lo=0)
        _check_int("chunk_bytes", self.chunk_bytes, lo=MSS)
        if self.window_bytes is not None:
            _check_int("window_bytes", self.window_bytes, lo=self.chunk_bytes)
        _check_int("max_connections", self.max_connections, lo=1, hi=65536)
        _check_float("connect_timeout_s", self.connect_timeout_s, lo=0.001, hi=3600.0)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=0, hi=2**63)

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


def _check_float(name: str, value: object, *, lo: float, hi: float) -> None:
    check_number("LinkConfig", name, value, lo, hi)


def _check_int(name: str, value: object, *, lo: int, hi: int = _MAX_BYTES) -> None:
    check_int("LinkConfig", name, value, lo, hi)
